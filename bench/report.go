package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"time"
)

// describe names the machine and the servers' versions.
func (e *env) describe(ctx context.Context) string {
	cpu := "?"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for line := range strings.Lines(string(b)) {
			if v, ok := strings.CutPrefix(line, "model name"); ok {
				cpu = strings.TrimSpace(strings.TrimLeft(v, "\t :"))
				break
			}
		}
	}
	mem := "?"
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		var kb int64
		if _, err := fmt.Sscanf(string(b), "MemTotal: %d kB", &kb); err == nil {
			mem = fmt.Sprintf("%.0f GiB", float64(kb)/(1<<20))
		}
	}
	kernel := "?"
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		kernel = strings.TrimSpace(string(b))
	}
	redisV := "?"
	if b, err := exec.Command("redis-server", "--version").Output(); err == nil {
		for f := range strings.FieldsSeq(string(b)) {
			if v, ok := strings.CutPrefix(f, "v="); ok {
				redisV = v
			}
		}
	}
	pgV := "?"
	_ = e.pgAdmin.QueryRow(ctx, "SHOW server_version").Scan(&pgV)
	etcdV := "not run"
	if e.etcd != nil {
		etcdV = e.etcd.version() + " (1 member, WAL fsync on)"
	}
	fsync := "off"
	if e.cfg.durable {
		fsync = "on"
	}
	return fmt.Sprintf("%s on %d × %s, %s RAM, Linux %s, %s; redis-server %s × 5 (no persistence); "+
		"PostgreSQL %s (fsync %s, synchronous_commit on); etcd %s",
		time.Now().UTC().Format("2006-01-02 15:04 UTC"), runtime.NumCPU(), cpu, mem, kernel, runtime.Version(),
		redisV, pgV, fsync, etcdV)
}

// fmtDur prints a latency with 3 significant digits.
func fmtDur(d time.Duration) string {
	switch {
	case d <= 0:
		return "–"
	case d < time.Millisecond:
		return fmt.Sprintf("%.0fµs", float64(d)/float64(time.Microsecond))
	case d < 10*time.Millisecond:
		return fmt.Sprintf("%.2fms", float64(d)/float64(time.Millisecond))
	case d < 100*time.Millisecond:
		return fmt.Sprintf("%.1fms", float64(d)/float64(time.Millisecond))
	case d < 10*time.Second:
		return fmt.Sprintf("%.0fms", float64(d)/float64(time.Millisecond))
	}
	return fmt.Sprintf("%.1fs", d.Seconds())
}

func fmtRate(r float64) string {
	if r >= 100 {
		return fmt.Sprintf("%.0f", r)
	}
	return fmt.Sprintf("%.1f", r)
}

func fmtRatio(a, b float64) string {
	if a <= 0 || b <= 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f×", a/b)
}

// minCycles is the fewest cycles in a window for per-cycle figures and
// ratios to be shown: below it they divide by noise.
const minCycles = 20

func fmtCPU(r *result, d time.Duration, applies bool) string {
	if !applies || r.cycles < minCycles {
		return "–"
	}
	return fmt.Sprintf("%.3f", r.perK(d))
}

func fmtPer(r *result, n int64) string {
	if r.cycles < minCycles || n < 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f", float64(n)/float64(r.cycles))
}

// report renders the results as Markdown: the measurements, the ratios
// between peers measured in the same run, and the targets.
func (e *env) report(rs []*result) string {
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	passes := max(1, e.cfg.passes)
	p("Measured by `make bench` (bench/), %v per cell after %v warm-up, lease TTL %v, hold 0.", e.cfg.duration, e.cfg.warmup, e.cfg.ttl)
	if passes > 1 {
		p(" Each group of cells (a case and worker count) runs in %d passes of %v per cell, the systems in turn and in alternating order (forward, then backward), each after its own warm-up; a cell's passes are pooled.", passes, e.cfg.duration/time.Duration(passes))
	}
	p("\n")
	p("%s.\n\n", e.versions)
	p("- **distinct**: each worker locks its own name; **contended**: all workers try-lock one name (wait 0; etcd `TryLock`), cycles/s counts grants;\n")
	p("  tries/s counts every acquire call (granted, refused as held, failed): on distinct names a gap between the two is a system refusing a name its own worker just released;\n")
	p("  **handoff**: all workers block on one name (wait %v, etcd `Lock`), cycles/s = grants/s and latency = wait-to-grant;\n", e.cfg.wait)
	p("  **degraded**: distinct with one of the 5 Redis nodes SIGSTOPped.\n")
	p("- Latency: granted acquires only. Per-cycle figures and ratios need %d cycles in the window (– otherwise). CPU: seconds per 1,000 cycles;", minCycles)
	p("\n  client = this process (the load generator for HTTP, the whole lock for in-process systems),\n")
	p("  http/1.1 = a wrk-style load generator (one keep-alive connection per worker, no client goroutines); \"net/http client\" = the same server through Go's net/http client;\n")
	p("  server = `redfence serve` or etcd, redis = the 5 nodes, pg = Postgres and its backends. Redis RT: socket reads on the nodes per cycle (round trips);\n")
	p("  pg xacts: Postgres write transactions per cycle. redfence (h2c, http/1.1, in-proc) issue a durable fencing token per grant; redsync and the single node issue none;\n")
	p("  etcd's lock key revision is its fencing token.\n\n")

	p("| case | workers | system | cycles/s | tries/s | acquire p50 | p99 | p99.9 | errors | CPU client | server | redis | pg | total | redis RT/cycle | pg xacts/cycle |\n")
	p("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	var notes []string
	for _, r := range rs {
		if r.skipped != "" {
			p("| %s | %d | %s | skipped | | | | | | | | | | | | |\n", r.kind, r.workers, r.system)
			notes = append(notes, fmt.Sprintf("- %s/%d/%s skipped: %s", r.kind, r.workers, r.system, r.skipped))
			continue
		}
		tries := fmtRate(r.tryRate())
		errs := fmt.Sprint(r.errs)
		if r.timeouts > 0 {
			errs += fmt.Sprintf(" (+%d wait timeouts)", r.timeouts)
		}
		if r.firstErr != "" {
			var kinds []string
			for k, n := range r.errKinds {
				kinds = append(kinds, fmt.Sprintf("%s %d", k, n))
			}
			slices.Sort(kinds)
			notes = append(notes, fmt.Sprintf("- %s/%d/%s errors: %s; first: %.160s", r.kind, r.workers, r.system, strings.Join(kinds, ", "),
				strings.ReplaceAll(r.firstErr, "\n", " ")))
		}
		usesRedis := r.system != "etcd"
		usesPG := strings.HasPrefix(r.system, "redfence")
		rt := "–"
		if usesRedis {
			rt = fmtPer(r, r.redisReads)
		}
		px := "–"
		if usesPG {
			px = fmtPer(r, r.pgXacts)
		}
		p("| %s | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n",
			r.kind, r.workers, r.system, fmtRate(r.rate()), tries, fmtDur(r.pct(0.5)), fmtDur(r.pct(0.99)), fmtDur(r.pct(0.999)), errs,
			fmtCPU(r, r.client, true), fmtCPU(r, r.server, r.hasServer), fmtCPU(r, r.redis, usesRedis), fmtCPU(r, r.pg, usesPG),
			fmtCPU(r, r.total(), true), rt, px)
	}
	if len(notes) > 0 {
		p("\nErrors (a failed cycle is not counted; the worker moves to a new name):\n\n%s\n", strings.Join(notes, "\n"))
	}

	find := func(k kind, w int, sys string) *result {
		for _, r := range rs {
			if r.kind == k && r.workers == w && r.system == sys && r.skipped == "" && r.cycles > 0 {
				return r
			}
		}
		return nil
	}
	rate := func(r *result) float64 {
		if r == nil || r.cycles < minCycles {
			return 0
		}
		return r.rate()
	}
	p50 := func(r *result) float64 {
		if r == nil || r.cycles < minCycles {
			return 0
		}
		return float64(r.pct(0.5))
	}
	cpuPer := func(r *result) float64 {
		if r == nil || r.cycles < minCycles {
			return 0
		}
		return r.total().Seconds() / float64(r.cycles)
	}

	// The HTTP row the targets judge: HTTP/1.1, what every client speaks,
	// when it ran (h2c, if it ran too, is shown alongside), else h2c.
	primary, other := "redfence http/1.1", "redfence h2c"
	if !slices.ContainsFunc(rs, func(r *result) bool { return r.system == primary && r.skipped == "" }) {
		primary, other = other, ""
	}
	p("\nRatios, same run (throughput: higher is better for Redfence; p50 and CPU per cycle: lower is better). http = redfence http/1.1, h2c = redfence h2c (– when not run):\n\n")
	p("| case | workers | http ÷ redsync | http ÷ etcd | h2c ÷ redsync | h2c ÷ etcd | in-proc ÷ redsync | in-proc ÷ etcd | http ÷ in-proc | http ÷ 1 node | p50 http ÷ etcd | p50 http ÷ in-proc | p50 h2c ÷ in-proc | CPU/cycle http ÷ redsync | CPU/cycle http ÷ etcd |\n")
	p("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	type kw struct {
		k kind
		w int
	}
	var rows []kw
	for _, r := range rs {
		if r.kind == degraded {
			continue
		}
		if len(rows) == 0 || rows[len(rows)-1] != (kw{r.kind, r.workers}) {
			rows = append(rows, kw{r.kind, r.workers})
		}
	}
	for _, row := range rows {
		hc, h, in := find(row.k, row.w, "redfence h2c"), find(row.k, row.w, "redfence http/1.1"), find(row.k, row.w, "redfence in-proc")
		rsync, et, one := find(row.k, row.w, "redsync"), find(row.k, row.w, "etcd"), find(row.k, row.w, "1 redis node")
		p("| %s | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", row.k, row.w,
			fmtRatio(rate(h), rate(rsync)), fmtRatio(rate(h), rate(et)), fmtRatio(rate(hc), rate(rsync)), fmtRatio(rate(hc), rate(et)),
			fmtRatio(rate(in), rate(rsync)), fmtRatio(rate(in), rate(et)),
			fmtRatio(rate(h), rate(in)), fmtRatio(rate(h), rate(one)), fmtRatio(p50(h), p50(et)), fmtRatio(p50(h), p50(in)), fmtRatio(p50(hc), p50(in)),
			fmtRatio(cpuPer(h), cpuPer(rsync)), fmtRatio(cpuPer(h), cpuPer(et)))
	}
	var degRows []string
	for _, r := range rs {
		if r.kind != degraded || r.skipped != "" {
			continue
		}
		healthy := find(distinct, r.workers, r.system)
		if healthy == nil {
			continue
		}
		degRows = append(degRows, fmt.Sprintf("| %s | %d | %s | %s | %s |", r.system, r.workers, fmtRatio(rate(r), rate(healthy)),
			fmtDur(r.pct(0.99)), fmtDur(healthy.pct(0.99))))
	}
	if len(degRows) > 0 {
		p("\nOne node SIGSTOPped, against the healthy distinct run:\n\n| system | workers | cycles/s degraded ÷ healthy | p99 degraded | p99 healthy |\n|---|---:|---:|---:|---:|\n")
		p("%s\n", strings.Join(degRows, "\n"))
	}

	// The -baseline build against the build under test, cell by cell.
	var baseRows []string
	for _, r := range rs {
		if r.system != "redfence http/1.1 baseline" || r.skipped != "" {
			continue
		}
		h := find(r.kind, r.workers, "redfence http/1.1")
		if h == nil {
			continue
		}
		baseRows = append(baseRows, fmt.Sprintf("| %s | %d | %s | %s | %s |", r.kind, r.workers,
			fmtRatio(rate(h), rate(r)), fmtRatio(p50(h), p50(r)), fmtRatio(cpuPer(h), cpuPer(r))))
	}
	if len(baseRows) > 0 {
		p("\nThis build (http/1.1) against the -baseline build, same run:\n\n| case | workers | cycles/s ÷ baseline | p50 ÷ baseline | CPU/cycle ÷ baseline |\n|---|---:|---:|---:|---:|\n")
		p("%s\n", strings.Join(baseRows, "\n"))
	}

	// The targets of issue 4 (Performance).
	maxW := 0
	for _, w := range e.cfg.workers {
		maxW = max(maxW, w)
	}
	minW := e.cfg.workers[0]
	var checks []string
	check := func(ok bool, okKnown bool, what string) {
		mark := "n/a"
		if okKnown {
			mark = map[bool]string{true: "met", false: "NOT met"}[ok]
		}
		checks = append(checks, fmt.Sprintf("- %s: %s", mark, what))
	}
	{
		h, rsync, et := find(distinct, maxW, primary), find(distinct, maxW, "redsync"), find(distinct, maxW, "etcd")
		known := h != nil && rsync != nil && et != nil
		also := ""
		if o := find(distinct, maxW, other); o != nil {
			also = fmt.Sprintf(" (%s: %s redsync, %s etcd)", other, fmtRatio(rate(o), rate(rsync)), fmtRatio(rate(o), rate(et)))
		}
		check(known && rate(h) > rate(rsync) && rate(h) > rate(et), known,
			fmt.Sprintf("%d workers, distinct: %s above redsync and etcd (goal 2×): %s redsync, %s etcd%s", maxW, primary,
				fmtRatio(rate(h), rate(rsync)), fmtRatio(rate(h), rate(et)), also))
	}
	{
		h, in, et := find(distinct, minW, primary), find(distinct, minW, "redfence in-proc"), find(distinct, minW, "etcd")
		known := h != nil && in != nil && et != nil
		also := ""
		if o := find(distinct, minW, other); o != nil {
			also = fmt.Sprintf(" (%s: %s, %s in-proc)", other, fmtDur(o.pct(0.5)), fmtRatio(p50(o), p50(in)))
		}
		check(known && p50(h) < p50(et) && p50(h) <= 1.5*p50(in), known,
			fmt.Sprintf("%d worker: %s acquire p50 below etcd's and ≤ 1.5× in-proc: %s vs etcd %s, in-proc %s (%s)%s", minW, primary,
				fmtDur(time.Duration(p50(h))), fmtDur(time.Duration(p50(et))), fmtDur(time.Duration(p50(in))), fmtRatio(p50(h), p50(in)), also))
	}
	{
		h, et := find(handoff, e.cfg.handoffWorkers, primary), find(handoff, e.cfg.handoffWorkers, "etcd")
		known := h != nil && et != nil
		also := ""
		if o := find(handoff, e.cfg.handoffWorkers, other); o != nil && et != nil {
			also = fmt.Sprintf(" (%s: %s)", other, fmtRatio(rate(o), rate(et)))
		}
		check(known && rate(h) >= rate(et), known, fmt.Sprintf("handoff: %s grants/s ≥ etcd's: %s%s", primary, fmtRatio(rate(h), rate(et)), also))
	}
	{
		d, h := find(degraded, maxW, primary), find(distinct, maxW, primary)
		known := d != nil && h != nil
		var limit time.Duration
		if h != nil {
			limit = 50*time.Millisecond + 2*h.pct(0.99) // default REDFENCE_NODE_TIMEOUT
		}
		check(known && rate(d) >= 0.8*rate(h) && d.pct(0.99) < limit, known,
			fmt.Sprintf("one node stopped, %d workers: %s ≥ 80%% of healthy and p99 < 50ms + 2 × healthy p99: %s, p99 %s (limit %s)", maxW, primary,
				fmtRatio(rate(d), rate(h)), fmtDur(func() time.Duration {
					if d == nil {
						return 0
					}
					return d.pct(0.99)
				}()), fmtDur(limit)))
	}
	p("\nTargets of issue 4:\n\n%s\n", strings.Join(checks, "\n"))
	return b.String()
}

const (
	beginMarker = "<!-- bench:begin -->"
	endMarker   = "<!-- bench:end -->"
)

// replaceSection writes report between the markers of file.
func replaceSection(file, report string) error {
	b, err := os.ReadFile(file)
	if err != nil {
		return err
	}
	s := string(b)
	i := strings.Index(s, beginMarker)
	j := strings.Index(s, endMarker)
	if i < 0 || j < i {
		return errors.New(file + ": no " + beginMarker + " … " + endMarker + " section to replace")
	}
	s = s[:i+len(beginMarker)] + "\n" + report + s[j:]
	return os.WriteFile(file, []byte(s), 0o644)
}
