// Command bench measures Redfence side by side with the locks a user would
// otherwise pick — go-redsync/redsync v4 embedded in the process, and etcd's
// concurrency.Mutex — plus a single Redis node as the ceiling, all in one run
// on the same machine, and prints one table with the ratios between them.
//
// It starts everything it measures on free loopback ports (5 redis-server
// and Postgres through internal/cluster, one etcd, and a `redfence serve`
// process so that the server's CPU can be read from /proc) and stops it all
// on exit, Ctrl-C included.
//
// What it guarantees: every figure of one run is measured on the same
// servers, interleaved system by system, so ratios between systems are
// meaningful on a shared, noisy machine. What it does not: absolute numbers
// are this machine's at this moment; compare ratios, not cycles/s, across
// runs.
//
// Usage (from bench/): go run . [-duration 10s] [-workers 1,16,64] ...
// `make bench` and `make bench-quick` at the repository root run it. With
// -profile DIR it instead profiles the HTTP and in-process cases at 64
// workers (CPU, allocations, round trips) and writes the profiles to DIR.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/service"
	"github.com/redfence/redfence/store"
)

// config holds the flags.
type config struct {
	duration, warmup time.Duration
	workers          []int
	cases            []kind
	systems          []string
	ttl, wait        time.Duration
	handoffWorkers   int
	passes           int
	redfenceBin, src string
	baselineBin      string
	durable          bool
	serverLogLevel   string
	serverLog        string
	out, readme      string
	profileDir       string
}

// systemKeys are the -systems names, in table order.
var systemKeys = []string{"http", "http-base", "http-nethttp", "h2c", "inproc", "redsync", "etcd", "single"}

// defaultSystems are the systems run without -systems (h2c only on request).
var defaultSystems = []string{"http", "http-nethttp", "inproc", "redsync", "etcd", "single"}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run() error {
	cfg, err := parseFlags(os.Args[1:])
	if err != nil {
		return err
	}
	// go-redis logs dial failures (the degraded case's stopped node) for every
	// attempt; the table reports errors.
	redis.SetLogger(quietRedis{})
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	e, err := setup(ctx, cfg)
	if e != nil {
		defer e.close()
	}
	if err != nil {
		return err
	}
	if cfg.profileDir != "" {
		return e.profile(ctx)
	}
	results := e.measure(ctx)
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("interrupted: %w", err)
	}
	report := e.report(results)
	fmt.Print(report)
	if cfg.out != "" {
		if err := os.WriteFile(cfg.out, []byte(report), 0o644); err != nil {
			return err
		}
	}
	if cfg.readme != "" {
		if err := replaceSection(cfg.readme, report); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "bench: wrote the table into %s\n", cfg.readme)
	}
	return nil
}

func parseFlags(args []string) (config, error) {
	var c config
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.DurationVar(&c.duration, "duration", 10*time.Second, "measured time per cell")
	fs.DurationVar(&c.warmup, "warmup", time.Second, "unmeasured warm-up per cell and pass")
	fs.IntVar(&c.passes, "passes", 2, "passes over each group of cells, the systems in alternating order (forward, backward, ...), -duration split between them")
	workers := fs.String("workers", "1,16,64", "comma-separated worker counts for the distinct and contended cases")
	cases := fs.String("cases", "distinct,contended,handoff,degraded", "cases to run")
	systems := fs.String("systems", strings.Join(defaultSystems, ","), "systems to run: http (HTTP/1.1, lean wrk-style load generator), http-nethttp (HTTP/1.1 through net/http's client), h2c (HTTP/2 cleartext; starts the server with REDFENCE_H2C=true), inproc, redsync, etcd, single")
	fs.DurationVar(&c.ttl, "ttl", 10*time.Second, "lease TTL of every acquire")
	fs.DurationVar(&c.wait, "wait", 30*time.Second, "wait of blocking acquires (handoff)")
	fs.IntVar(&c.handoffWorkers, "handoff-workers", 64, "workers blocking on the hot name in the handoff case")
	fs.StringVar(&c.redfenceBin, "redfence", "", "redfence binary to run as the HTTP server (default: build ./cmd/redfence of -src)")
	fs.StringVar(&c.baselineBin, "baseline", "", "another redfence binary (e.g. an older build) to run beside the first as system http-base (added to -systems), on the same nodes and Postgres, for a same-run before/after ratio")
	fs.StringVar(&c.src, "src", "..", "root of the main module (to build redfence)")
	fs.BoolVar(&c.durable, "durable", true, "run Postgres with fsync on (etcd always fsyncs)")
	fs.StringVar(&c.serverLogLevel, "server-log-level", "info", "REDFENCE_LOG_LEVEL of the server (info: the production default)")
	fs.StringVar(&c.serverLog, "server-log", "", "file for the servers' output (default: discarded)")
	fs.StringVar(&c.out, "out", "", "also write the report to this file")
	fs.StringVar(&c.readme, "readme", "", "replace the section between <!-- bench:begin --> and <!-- bench:end --> of this file with the report")
	fs.StringVar(&c.profileDir, "profile", "", "profile the HTTP and in-process cases at 64 distinct workers instead, writing profiles to this directory")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	for w := range strings.SplitSeq(*workers, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(w))
		if err != nil || n < 1 {
			return c, fmt.Errorf("-workers: bad count %q", w)
		}
		c.workers = append(c.workers, n)
	}
	for k := range strings.SplitSeq(*cases, ",") {
		k := kind(strings.TrimSpace(k))
		if !slices.Contains([]kind{distinct, contended, handoff, degraded}, k) {
			return c, fmt.Errorf("-cases: unknown case %q", k)
		}
		c.cases = append(c.cases, k)
	}
	for s := range strings.SplitSeq(*systems, ",") {
		s = strings.TrimSpace(s)
		if !slices.Contains(systemKeys, s) {
			return c, fmt.Errorf("-systems: unknown system %q", s)
		}
		c.systems = append(c.systems, s)
	}
	if c.baselineBin != "" && !slices.Contains(c.systems, "http-base") {
		c.systems = append(c.systems, "http-base")
	}
	if c.profileDir != "" {
		c.systems = []string{"http", "inproc"}
	}
	if c.duration <= 0 || c.warmup < 0 {
		return c, errors.New("-duration must be positive and -warmup not negative")
	}
	return c, nil
}

// env is everything a run started.
type env struct {
	cfg     config
	tmp     string
	cl      *cluster.Cluster
	dbURL   string
	etcd    *etcd
	srv     *redfenceServer
	base    *redfenceServer // the -baseline server, or nil
	systems map[string]system
	admin   []*redis.Client // INFO readers, one per node
	pgAdmin *pgx.Conn
	seq     int
	// lastCmds is the Redis commandstats delta of the last cell.
	lastCmds map[string]int64
	versions string
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "bench: "+format+"\n", args...)
}

func (e *env) has(sys string) bool { return slices.Contains(e.cfg.systems, sys) }

func setup(ctx context.Context, cfg config) (*env, error) {
	e := &env{cfg: cfg, systems: map[string]system{}}
	var err error
	if e.tmp, err = os.MkdirTemp("", "redfence-bench-"); err != nil {
		return nil, err
	}
	logf("starting 5 redis-server and Postgres (fsync=%v)", cfg.durable)
	e.cl, err = cluster.Start(ctx, cluster.Options{Nodes: 5, DurablePostgres: cfg.durable})
	if err != nil {
		return e, err
	}
	logf("redis nodes %s, postgres pid %d", strings.Join(e.cl.Addrs(), " "), e.cl.Postgres.PID())
	if e.dbURL, err = e.cl.Postgres.CreateDatabase(ctx, "bench"); err != nil {
		return e, err
	}
	for _, a := range e.cl.Addrs() {
		e.admin = append(e.admin, redis.NewClient(&redis.Options{Addr: a, MaxRetries: -1, PoolSize: 1, ReadTimeout: 200 * time.Millisecond}))
	}
	if e.pgAdmin, err = pgx.Connect(ctx, e.dbURL); err != nil {
		return e, err
	}
	if cfg.profileDir != "" {
		if err := e.enableStatements(ctx); err != nil {
			return e, err
		}
	}

	// The in-process locker, and the schema for the server too.
	db, err := store.Open(ctx, e.dbURL, store.Options{})
	if err != nil {
		return e, err
	}
	if _, err := db.Migrate(ctx); err != nil {
		db.Close()
		return e, err
	}
	var nodes []service.Node
	var rnodes []*service.RedisNode
	for _, a := range e.cl.Addrs() {
		n := service.NewRedisNode(a, service.RedisOptions{})
		nodes = append(nodes, n)
		rnodes = append(rnodes, n)
	}
	closeInproc := func() {
		for _, n := range rnodes {
			_ = n.Close()
		}
		db.Close()
	}
	// Wired as cmd/redfence wires it, defaults for every option.
	locker, err := service.New(nodes, db, service.Options{Registry: db})
	if err == nil {
		err = locker.Init(ctx)
	}
	if err != nil {
		closeInproc()
		return e, err
	}
	closeNodes := closeInproc
	closeInproc = func() { locker.Close(); closeNodes() }
	inproc := &inprocSystem{locker: locker, closeF: closeInproc, ttl: cfg.ttl}
	if e.has("inproc") {
		e.systems["inproc"] = inproc
	} else {
		defer inproc.close() // it only applied the migrations
	}

	if e.has("http") || e.has("http-base") || e.has("http-nethttp") || e.has("h2c") {
		bin := cfg.redfenceBin
		var overlay string
		if cfg.profileDir != "" {
			bin = "" // needs the pprof overlay
			if overlay, err = e.pprofOverlay(); err != nil {
				return e, err
			}
		}
		if bin == "" {
			logf("building ./cmd/redfence in %s", cfg.src)
			if bin, err = buildRedfence(ctx, cfg.src, e.tmp, overlay); err != nil {
				return e, err
			}
		}
		key, err := createAPIKey(ctx, bin, e.dbURL)
		if err != nil {
			return e, err
		}
		env := []string{
			"REDFENCE_LOG_LEVEL=" + cfg.serverLogLevel,
			// The per-key rate limit is a policy, not a cost: raise it far
			// above any rate here (the limiter still runs on every request).
			"REDFENCE_RATE_LIMIT=1000000000", "REDFENCE_RATE_BURST=1000000000",
		}
		if e.has("h2c") {
			env = append(env, "REDFENCE_H2C=true")
		}
		if key == "" {
			env = append(env, "REDFENCE_AUTH=false")
		}
		if cfg.profileDir != "" {
			env = append(env, "REDFENCE_BENCH_PPROF_ADDR="+e.pprofAddr())
		}
		logf("starting %s serve", bin)
		if e.srv, err = startRedfence(ctx, bin, e.cl.Addrs(), e.dbURL, env, cfg.serverLog); err != nil {
			return e, err
		}
		maxW := max(cfg.handoffWorkers, slices.Max(cfg.workers))
		if e.has("http") {
			e.systems["http"] = newRawHTTPSystem("redfence http/1.1", e.srv, key, cfg.ttl)
		}
		if e.has("http-base") && cfg.baselineBin != "" {
			logf("starting baseline %s serve", cfg.baselineBin)
			if e.base, err = startRedfence(ctx, cfg.baselineBin, e.cl.Addrs(), e.dbURL, env, cfg.serverLog); err != nil {
				return e, err
			}
			e.systems["http-base"] = newRawHTTPSystem("redfence http/1.1 baseline", e.base, key, cfg.ttl)
		}
		if e.has("http-nethttp") {
			e.systems["http-nethttp"] = newHTTPSystem("redfence http/1.1 net/http client", e.srv, key, maxW, cfg.ttl, false)
		}
		if e.has("h2c") {
			e.systems["h2c"] = newHTTPSystem("redfence h2c", e.srv, key, maxW, cfg.ttl, true)
		}
	}
	if e.has("redsync") {
		e.systems["redsync"] = newRedsyncSystem(e.cl.Addrs(), cfg.ttl)
	}
	if e.has("single") {
		e.systems["single"] = &singleSystem{client: redis.NewClient(&redis.Options{Addr: e.cl.Addrs()[0]}), ttl: cfg.ttl}
	}
	if e.has("etcd") {
		logf("starting etcd")
		if e.etcd, err = startEtcd(ctx, cfg.serverLog); err != nil {
			return e, err
		}
		s, err := newEtcdSystem(e.etcd, cfg.ttl)
		if err != nil {
			return e, err
		}
		e.systems["etcd"] = s
	}
	e.versions = e.describe(ctx)
	return e, nil
}

// close stops everything setup started, in reverse order.
func (e *env) close() {
	for _, k := range slices.Backward(systemKeys) {
		if s, ok := e.systems[k]; ok {
			s.close()
		}
	}
	e.srv.stopServer()
	e.base.stopServer()
	if e.etcd != nil {
		e.etcd.stop()
	}
	for _, c := range e.admin {
		_ = c.Close()
	}
	if e.pgAdmin != nil {
		_ = e.pgAdmin.Close(context.Background())
	}
	if e.cl != nil {
		if err := e.cl.Close(); err != nil {
			logf("stopping the cluster: %v", err)
		}
	}
	if e.tmp != "" {
		_ = os.RemoveAll(e.tmp)
	}
}

func (s *redfenceServer) stopServer() {
	if s != nil {
		s.stop()
	}
}

// plan lists the cells in run order: within one (case, workers) the systems
// run back to back, so that each ratio compares figures taken close in time.
func (e *env) plan() []cell {
	var cells []cell
	add := func(k kind, w int, keys ...string) {
		for _, key := range keys {
			if s, ok := e.systems[key]; ok {
				cells = append(cells, cell{kind: k, workers: w, sys: s})
			}
		}
	}
	// Degraded cells run right after the healthy distinct cells of the same
	// worker count (at the fewest and the most workers), so that the
	// degraded ÷ healthy ratio compares neighbours too.
	degradedAt := []int{e.cfg.workers[0], slices.Max(e.cfg.workers)}
	for _, w := range e.cfg.workers {
		if slices.Contains(e.cfg.cases, distinct) {
			add(distinct, w, systemKeys...)
		}
		if slices.Contains(e.cfg.cases, degraded) && slices.Contains(degradedAt, w) {
			add(degraded, w, "http", "http-base", "http-nethttp", "h2c", "inproc", "redsync")
			degradedAt = slices.DeleteFunc(degradedAt, func(x int) bool { return x == w })
		}
	}
	if slices.Contains(e.cfg.cases, contended) {
		for _, w := range e.cfg.workers {
			add(contended, w, systemKeys...)
		}
	}
	if slices.Contains(e.cfg.cases, handoff) {
		add(handoff, e.cfg.handoffWorkers, "http", "http-base", "http-nethttp", "h2c", "inproc", "redsync", "etcd")
	}
	return cells
}

func (e *env) measure(ctx context.Context) []*result {
	cells := e.plan()
	passes := max(1, e.cfg.passes)
	logf("%d cells of %v in %d passes (+%v warm-up each): about %v", len(cells), e.cfg.duration, passes, e.cfg.warmup,
		(time.Duration(len(cells)) * (e.cfg.duration + time.Duration(passes)*(e.cfg.warmup+400*time.Millisecond))).Round(time.Second))
	// Settle first: freshly started servers (Postgres right after initdb
	// and its first checkpoint, etcd, cold caches and connection pools)
	// are slower for a few seconds, which would weigh on the first cells
	// only. Each system runs unmeasured at 16 workers on distinct names.
	measured := e.cfg.duration
	e.cfg.duration = max(3*e.cfg.warmup, 2*time.Second)
	var settled []string
	for _, c := range cells {
		if ctx.Err() != nil || c.kind != distinct || slices.Contains(settled, c.sys.name()) {
			continue
		}
		settled = append(settled, c.sys.name())
		e.run(ctx, cell{kind: distinct, workers: 16, sys: c.sys}, hooks{})
	}
	e.cfg.duration = measured
	logf("settled %d systems for %v each", len(settled), max(3*e.cfg.warmup, 2*time.Second))
	// Each group of cells (one case and worker count) runs in passes, the
	// systems in turn, forward then backward: a system's place in its group
	// matters (the first cell of a group measured up to 30% lower, for
	// reasons not isolated here), and alternating spreads that over every
	// system instead of the one that happens to come first. A system's
	// passes are merged into one result, measured for -duration in all.
	e.cfg.duration = measured / time.Duration(passes)
	defer func() { e.cfg.duration = measured }()
	var out []*result
	done := 0
	for len(cells) > 0 && ctx.Err() == nil {
		n := 1
		for n < len(cells) && cells[n].kind == cells[0].kind && cells[n].workers == cells[0].workers {
			n++
		}
		group := cells[:n]
		cells = cells[n:]
		merged := make([]*result, n)
		for p := range passes {
			for j := range n {
				if p%2 == 1 {
					j = n - 1 - j
				}
				if ctx.Err() != nil {
					break
				}
				t0 := time.Now()
				r := e.run(ctx, group[j], hooks{})
				logf("[%d/%d] %-9s w=%-3d %-16s %9.0f cycles/s  p50 %-8s p99 %-8s errs %-4d (%.1fs, pass %d/%d) %s", done+j+1, done+len(group)+len(cells), r.kind, r.workers, r.system,
					r.rate(), fmtDur(r.pct(0.5)), fmtDur(r.pct(0.99)), r.errs+r.timeouts, time.Since(t0).Seconds(), p+1, passes, r.skipped)
				merged[j] = merged[j].merge(r)
			}
		}
		done += n
		for _, r := range merged {
			if r != nil {
				out = append(out, r)
			}
		}
	}
	return out
}

type quietRedis struct{}

func (quietRedis) Printf(context.Context, string, ...any) {}
