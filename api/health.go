// The nodes' state, /healthz and /readyz.

package api

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"
)

func (h *Handler) nodes(w http.ResponseWriter, r *http.Request) {
	ns := h.locker.Nodes(r.Context())
	if err := r.Context().Err(); err != nil {
		// The client left: the pings it cut short say nothing of the nodes.
		h.writeError(w, r, fmt.Errorf("nodes: %w", err))
		return
	}
	resp := &NodeList{Quorum: h.locker.Quorum(), Nodes: make([]Node, len(ns))}
	for i, n := range ns {
		resp.Nodes[i] = Node{Address: n.Addr, Up: n.Up, LatencyMS: float64(n.Latency.Microseconds()) / 1000}
		if !n.QuarantinedUntil.IsZero() {
			resp.Nodes[i].QuarantinedUntil = n.QuarantinedUntil.UTC().Format(time.RFC3339Nano)
			resp.Nodes[i].QuarantineReason = n.QuarantineReason
		}
		if n.Up {
			resp.Up++
		} else if n.Err != nil {
			resp.Nodes[i].Error = nodeErrorText(n.Err)
		}
	}
	writeJSON(w, http.StatusOK, resp)
}

func (h *Handler) healthz(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, &Health{Status: "ok"})
}

func (h *Handler) readyz(w http.ResponseWriter, r *http.Request) {
	if h.unready.Load() {
		retryAfterHeader(w, time.Second)
		writeJSON(w, http.StatusServiceUnavailable, &Health{Status: "shutting-down"})
		return
	}
	run := h.ready.join(r.Context(), h.checkReady)
	if h.readyJoined != nil {
		h.readyJoined()
	}
	select {
	case <-run.done:
		if run.panic != nil {
			panic(run.panic) // recovered as any handler's panic: a 500
		}
		code := http.StatusOK
		if run.health.Status != "ready" {
			code = http.StatusServiceUnavailable
			retryAfterHeader(w, time.Second)
		}
		writeJSON(w, code, run.health)
	case <-r.Context().Done():
		// The client left: there is nobody to answer. The last one to
		// leave a check ends it, so no later request joins a check
		// that began before it was sent.
		h.ready.leave(run)
		h.writeError(w, r, fmt.Errorf("readiness: %w", r.Context().Err()))
	}
}

// readiness runs /readyz's checks. A request joins the check running when it
// arrives, if any, else starts one, so concurrent probes share one check. A
// request's answer comes from a check that had not answered yet when it
// arrived: a check is forgotten once it answered or every request waiting
// for it left.
type readiness struct {
	mu  sync.Mutex
	run *readyRun
}

// readyRun is one check and the requests waiting for it.
type readyRun struct {
	waiters int
	cancel  context.CancelFunc
	// done is closed once health (or panic, if the check panicked) is set.
	done   chan struct{}
	health *Health
	panic  any
}

// join returns the running check, or starts one with check. The check is not
// cut short by the client that started it (others may join it), only when
// every waiter left.
func (rd *readiness) join(ctx context.Context, check func(context.Context) *Health) *readyRun {
	rd.mu.Lock()
	defer rd.mu.Unlock()
	if run := rd.run; run != nil {
		run.waiters++
		return run
	}
	cctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	run := &readyRun{waiters: 1, cancel: cancel, done: make(chan struct{})}
	rd.run = run
	go func() {
		defer close(run.done)
		defer cancel()
		defer rd.forget(run)
		defer func() { run.panic = recover() }()
		run.health = check(cctx)
	}()
	return run
}

// leave ends a waiter's interest in run, and run itself when it was the last.
func (rd *readiness) leave(run *readyRun) {
	rd.mu.Lock()
	defer rd.mu.Unlock()
	if run.waiters--; run.waiters == 0 && rd.run == run {
		rd.run = nil
		run.cancel()
	}
}

// forget makes run's check no longer joinable.
func (rd *readiness) forget(run *readyRun) {
	rd.mu.Lock()
	defer rd.mu.Unlock()
	if rd.run == run {
		rd.run = nil
	}
}

// checkReady asks the Redis nodes, then Postgres (within 2 s), for /readyz.
func (h *Handler) checkReady(ctx context.Context) *Health {
	ns := h.locker.Nodes(ctx)
	rh := &RedisHealth{Total: len(ns), Quorum: h.locker.Quorum()}
	for _, n := range ns {
		switch {
		case !n.QuarantinedUntil.IsZero():
			rh.Quarantined++
		case n.Up:
			rh.Up++
		}
	}
	ph := &PostgresHealth{Up: true}
	pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	start := time.Now()
	if err := h.store.Ping(pctx); err != nil {
		ph.Up, ph.Error = false, "postgres does not answer"
		if ctx.Err() == nil {
			h.log.LogAttrs(ctx, slog.LevelWarn, "readiness: postgres down", slog.String("error", err.Error()))
		} else {
			// Every waiter left (probes with a short timeout): the ping
			// was cut short, which says only how long Postgres had not
			// answered.
			h.log.LogAttrs(ctx, slog.LevelInfo, "readiness: every probe left before postgres answered",
				slog.Float64("waited_ms", float64(time.Since(start).Microseconds())/1000))
		}
	}
	if g, ok := h.locker.(granter); ok && ph.Up {
		// Postgres answers, but does not record this server's heartbeat
		// (read-only, or its table locked): nothing is granted.
		if err := g.Granting(); err != nil {
			ph.Up, ph.Error = false, "postgres does not record this server's heartbeat (read-only, or blocked): nothing is granted"
			h.log.LogAttrs(ctx, slog.LevelWarn, "readiness: heartbeat not recorded", slog.String("error", err.Error()))
		}
	}
	resp := &Health{Status: "ready", Redis: rh, Postgres: ph}
	if rh.Up < rh.Quorum || !ph.Up {
		resp.Status = "unavailable"
	}
	return resp
}
