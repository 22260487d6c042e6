package main

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/redfence/redfence/service"
)

// kind is a benchmark case.
type kind string

const (
	// distinct: every worker locks its own name (no contention).
	distinct kind = "distinct"
	// contended: every worker try-locks the same name (wait 0).
	contended kind = "contended"
	// handoff: every worker blocks on the same name (wait large, hold 0).
	handoff kind = "handoff"
	// degraded: distinct, with one Redis node SIGSTOPped.
	degraded kind = "degraded"
)

// cell is one measurement: a case, a number of workers, a system.
type cell struct {
	kind    kind
	workers int
	sys     system
}

// result is what one cell measured. Counts cover the measured window only:
// an acquire counts when it returned inside the window.
type result struct {
	kind    kind
	workers int
	system  string
	window  time.Duration
	// cycles: acquire granted and released; tries: acquire calls (granted,
	// held or failed); errs: failures; timeouts: blocking waits that ran out.
	cycles, tries, errs, timeouts int64
	firstErr                      string
	// errKinds counts the errors by kind (problem type or sentinel).
	errKinds map[string]int64
	// lat: latency of granted acquires (handoff: wait-to-grant), sorted.
	lat []time.Duration
	// CPU used during the window by this process (client), the system's
	// server process (redfence serve, etcd), the 5 Redis nodes, Postgres.
	client, server, redis, pg time.Duration
	hasServer                 bool
	// redisReads: socket reads on all Redis nodes (one per request without
	// pipelining, so round trips); pgXacts: Postgres write transactions.
	redisReads, pgXacts int64
	skipped             string
}

// merge returns r with o (the same cell, measured in another pass) added:
// windows, counts and CPU add up, latencies are pooled. A nil r returns o.
func (r *result) merge(o *result) *result {
	if r == nil {
		return o
	}
	if o == nil {
		return r
	}
	r.window += o.window
	r.add(o.cycles, o.tries, o.errs, o.timeouts, o.lat, o.firstErr, o.errKinds)
	slices.Sort(r.lat)
	r.client += o.client
	r.server += o.server
	r.redis += o.redis
	r.pg += o.pg
	r.redisReads += o.redisReads
	r.pgXacts += o.pgXacts
	if r.skipped == "" {
		r.skipped = o.skipped
	}
	return r
}

// add counts what one worker or pass saw (latencies appended unsorted).
func (r *result) add(cycles, tries, errs, timeouts int64, lat []time.Duration, firstErr string, kinds map[string]int64) {
	r.cycles += cycles
	r.tries += tries
	r.errs += errs
	r.timeouts += timeouts
	r.lat = append(r.lat, lat...)
	if r.firstErr == "" {
		r.firstErr = firstErr
	}
	for k, n := range kinds {
		if r.errKinds == nil {
			r.errKinds = map[string]int64{}
		}
		r.errKinds[k] += n
	}
}

func (r *result) rate() float64 {
	if r.window <= 0 {
		return 0
	}
	return float64(r.cycles) / r.window.Seconds()
}

func (r *result) tryRate() float64 {
	if r.window <= 0 {
		return 0
	}
	return float64(r.tries) / r.window.Seconds()
}

// pct returns the q-quantile of the granted acquires' latency.
func (r *result) pct(q float64) time.Duration {
	if len(r.lat) == 0 {
		return 0
	}
	i := int(float64(len(r.lat))*q+0.999999) - 1
	return r.lat[max(0, min(i, len(r.lat)-1))]
}

// perK returns CPU seconds per 1,000 cycles.
func (r *result) perK(d time.Duration) float64 {
	if r.cycles == 0 {
		return 0
	}
	return d.Seconds() / float64(r.cycles) * 1000
}

func (r *result) total() time.Duration { return r.client + r.server + r.redis + r.pg }

// snapshot is the state of the counters at one instant.
type snapshot struct {
	self, server, redis, pg time.Duration
	redisReads              int64
	redisCmds               map[string]int64
	pgXid                   int64
}

// snapshot reads every counter. server is the pid charged as server (0:
// none).
func (e *env) snapshot(ctx context.Context, server int) snapshot {
	var s snapshot
	var wg sync.WaitGroup
	reads := make([]int64, len(e.admin))
	cmds := make([]map[string]int64, len(e.admin))
	for i, c := range e.admin {
		wg.Go(func() { reads[i], cmds[i] = redisCounters(ctx, c) })
	}
	wg.Go(func() {
		// The next transaction id to be assigned: the difference between
		// two snapshots counts write transactions, exactly and at once
		// (pg_stat_database lags by up to a second or more).
		row := e.pgAdmin.QueryRow(ctx, "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
		if err := row.Scan(&s.pgXid); err != nil {
			s.pgXid = -1
		}
	})
	pt := scanProcs()
	s.self = selfCPU()
	s.server = pt.tree(server)
	for _, r := range e.cl.Redis {
		s.redis += pt.tree(r.PID())
	}
	s.pg = pt.tree(e.cl.Postgres.PID())
	wg.Wait()
	s.redisCmds = map[string]int64{}
	for i := range reads {
		s.redisReads += reads[i]
		for k, v := range cmds[i] {
			s.redisCmds[k] += v
		}
	}
	return s
}

// redisCounters returns a node's total_reads_processed and per-command
// calls (INFO commandstats). A node that does not answer (paused) gives
// zeros.
func redisCounters(ctx context.Context, c *redis.Client) (int64, map[string]int64) {
	ctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	info, err := c.Info(ctx, "stats", "commandstats").Result()
	if err != nil {
		return 0, nil
	}
	var reads int64
	cmds := map[string]int64{}
	for line := range strings.Lines(info) {
		line = strings.TrimSpace(line)
		if v, ok := strings.CutPrefix(line, "total_reads_processed:"); ok {
			reads, _ = strconv.ParseInt(v, 10, 64)
		}
		if rest, ok := strings.CutPrefix(line, "cmdstat_"); ok {
			name, stats, _ := strings.Cut(rest, ":")
			for kv := range strings.SplitSeq(stats, ",") {
				if v, ok := strings.CutPrefix(kv, "calls="); ok {
					n, _ := strconv.ParseInt(v, 10, 64)
					cmds[name] = n
				}
			}
		}
	}
	return reads, cmds
}

// hooks run at the edges of the measured window (profile mode).
type hooks struct {
	start func(ctx context.Context)
	stop  func(ctx context.Context)
}

// run measures one cell: workers loop acquire+release (hold 0) for the
// warm-up, then for the measured window.
func (e *env) run(ctx context.Context, c cell, h hooks) *result {
	r := &result{kind: c.kind, workers: c.workers, system: c.sys.name(), hasServer: c.sys.serverPID() != 0}
	e.seq++
	id := e.seq
	var wait time.Duration
	if c.kind == handoff {
		wait = e.cfg.wait
	}
	names := make([]string, c.workers)
	for i := range names {
		if c.kind == contended || c.kind == handoff {
			names[i] = fmt.Sprintf("bench-%d-hot", id)
		} else {
			names[i] = fmt.Sprintf("bench-%d-w%d", id, i)
		}
	}
	ws := make([]worker, 0, c.workers)
	defer func() {
		for _, w := range ws {
			w.close()
		}
	}()
	for i := range c.workers {
		w, err := c.sys.worker(ctx, i)
		if err != nil {
			r.skipped = err.Error()
			return r
		}
		ws = append(ws, w)
	}
	resume := func() {}
	if c.kind == degraded {
		node := e.cl.Redis[len(e.cl.Redis)-1]
		if err := node.Pause(); err != nil {
			r.skipped = err.Error()
			return r
		}
		var once sync.Once
		resume = func() { once.Do(func() { _ = node.Resume() }) }
		defer resume()
	}

	type wstat struct {
		lat                           []time.Duration
		cycles, tries, errs, timeouts int64
		firstErr                      string
		kinds                         map[string]int64
	}
	stats := make([]wstat, c.workers)
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	var phase atomic.Int32 // 0 warm-up, 1 measured, 2 done
	var wg sync.WaitGroup
	runtime.GC()
	for i, w := range ws {
		wg.Go(func() {
			st := &stats[i]
			name, gen := names[i], 0
			for runCtx.Err() == nil && phase.Load() < 2 {
				t0 := time.Now()
				rel, err := w.acquire(runCtx, name, wait)
				lat := time.Since(t0)
				in := phase.Load() == 1
				if err == nil {
					rctx, rcancel := context.WithTimeout(context.WithoutCancel(runCtx), 30*time.Second)
					if rerr := rel(rctx); rerr != nil {
						err = fmt.Errorf("release: %w", rerr)
					} else if in {
						st.cycles++
						st.lat = append(st.lat, lat)
					}
					rcancel()
				}
				if in {
					st.tries++
				}
				switch {
				case err == nil, errors.Is(err, errHeld):
				case errors.Is(err, errWaitTimeout):
					if in {
						st.timeouts++
					}
				default:
					if runCtx.Err() != nil {
						return
					}
					if in {
						st.errs++
						if st.firstErr == "" {
							st.firstErr = err.Error()
						}
						if st.kinds == nil {
							st.kinds = map[string]int64{}
						}
						st.kinds[errKind(err)]++
					}
					if c.kind == distinct || c.kind == degraded {
						// What failed may still hold the name: move on.
						gen++
						name = fmt.Sprintf("%s.%d", names[i], gen)
					}
					sleep(runCtx, 10*time.Millisecond)
				}
			}
		})
	}
	sleep(ctx, e.cfg.warmup)
	s0 := e.snapshot(ctx, c.sys.serverPID())
	if h.start != nil {
		h.start(ctx)
	}
	t0 := time.Now()
	phase.Store(1)
	sleep(ctx, e.cfg.duration)
	phase.Store(2)
	r.window = time.Since(t0)
	s1 := e.snapshot(ctx, c.sys.serverPID())
	if h.stop != nil {
		h.stop(ctx)
	}
	cancel() // ends blocked waits
	resume() // and calls stuck on the stopped node
	wg.Wait()

	for _, st := range stats {
		r.add(st.cycles, st.tries, st.errs, st.timeouts, st.lat, st.firstErr, st.kinds)
	}
	slices.Sort(r.lat)
	r.client = s1.self - s0.self
	r.server = s1.server - s0.server
	r.redis = s1.redis - s0.redis
	r.pg = s1.pg - s0.pg
	r.redisReads = s1.redisReads - s0.redisReads - int64(len(e.admin)) // our own INFO
	if s0.pgXid >= 0 && s1.pgXid >= 0 {
		r.pgXacts = s1.pgXid - s0.pgXid
	}
	e.lastCmds = diffCmds(s0.redisCmds, s1.redisCmds)
	sleep(ctx, 300*time.Millisecond) // let the servers settle before the next cell
	return r
}

// errKind names an error for the counts: the problem type of an HTTP error,
// the sentinel of a service error, else "other".
func errKind(err error) string {
	op := "acquire"
	if strings.HasPrefix(err.Error(), "release") {
		op = "release"
	}
	msg := err.Error()
	if i := strings.Index(msg, "urn:redfence:problem:"); i >= 0 {
		slug, _, _ := strings.Cut(msg[i+len("urn:redfence:problem:"):], `"`)
		return op + " " + slug
	}
	for _, s := range []struct {
		err  error
		name string
	}{
		{service.ErrNotHolder, "not-holder"}, {service.ErrQuorum, "quorum-unavailable"}, {service.ErrFencing, "fencing-unavailable"},
		{service.ErrExpired, "lease-expired"}, {context.DeadlineExceeded, "timeout"},
	} {
		if errors.Is(err, s.err) {
			return op + " " + s.name
		}
	}
	return op + " other"
}

func diffCmds(a, b map[string]int64) map[string]int64 {
	d := map[string]int64{}
	for k, v := range b {
		if n := v - a[k]; n > 0 && k != "info" {
			d[k] = n
		}
	}
	return d
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
