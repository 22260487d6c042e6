package chaos_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	// toxiproxy, run in process, puts latency and blackholes between the
	// servers and single Redis nodes, and between one client and a server:
	// the faults of a network the tests cannot otherwise partition on a
	// loopback-only machine.
	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/rs/zerolog"

	"github.com/redfence/redfence"
	"github.com/redfence/redfence/api"
	"github.com/redfence/redfence/chaos"
	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/internal/openapitest"
	"github.com/redfence/redfence/internal/testutil"
	"github.com/redfence/redfence/service"
	"github.com/redfence/redfence/store"
)

var (
	longRun = flag.Bool("long", false, "run the long versions of the scenarios (make chaos)")
	// report collects every scenario's figures; TestMain prints it. It is
	// package-level because tests have no other channel to TestMain.
	report chaos.Report
)

// size returns short in the default (make test) run and long under -long.
func size[T any](short, long T) T {
	if *longRun {
		return long
	}
	return short
}

func TestMain(m *testing.M) { os.Exit(runMain(m)) }

func runMain(m *testing.M) int {
	flag.Parse()
	start := time.Now()
	code := m.Run()
	if binaries.dir != "" {
		_ = os.RemoveAll(binaries.dir)
	}
	if report.Len() == 0 {
		return code
	}
	mode := "short"
	if *longRun {
		mode = "long"
	}
	title := fmt.Sprintf("Redfence chaos report: %s run, %d CPUs, %v", mode, runtime.NumCPU(), time.Since(start).Round(time.Second))
	report.Write(os.Stdout, title)
	if out := os.Getenv("CHAOS_OUT"); out != "" {
		if f, err := os.Create(filepath.Join(out, "chaos-report.txt")); err == nil {
			report.Write(f, title)
			_ = f.Close()
			fmt.Printf("\nreport saved to %s\n", f.Name())
		}
	}
	return code
}

// binaries are bin/redfence and the chaos client, built once per test
// binary (without -race: they are the system under test, not the tests).
var binaries struct {
	once             sync.Once
	dir              string
	redfence, client string
	err              error
}

func build(t *testing.T) (redfenceBin, clientBin string) {
	t.Helper()
	binaries.once.Do(func() {
		// go test puts its own GOROOT/bin first in the PATH of the tests.
		goBin, err := exec.LookPath("go")
		if err != nil {
			binaries.err = err
			return
		}
		mod, err := exec.Command(goBin, "env", "GOMOD").Output()
		if err != nil {
			binaries.err = fmt.Errorf("go env GOMOD: %w", err)
			return
		}
		dir, err := os.MkdirTemp("", "redfence-chaos-bin-")
		if err != nil {
			binaries.err = err
			return
		}
		binaries.dir = dir
		cmd := exec.Command(goBin, "build", "-o", dir+string(filepath.Separator), "./cmd/redfence", "./chaos/client")
		cmd.Dir = filepath.Dir(strings.TrimSpace(string(mod)))
		if out, err := cmd.CombinedOutput(); err != nil {
			binaries.err = fmt.Errorf("go build: %v\n%s", err, out)
			return
		}
		binaries.redfence, binaries.client = filepath.Join(dir, "redfence"), filepath.Join(dir, "client")
	})
	if binaries.err != nil {
		t.Fatal(binaries.err)
	}
	return binaries.redfence, binaries.client
}

// env is one scenario's world: 5 Redis nodes, a Postgres database, the
// servers, the history and the faults.
type env struct {
	t       *testing.T
	nodes   []*cluster.Redis
	raw     []*redis.Client // straight to the nodes, bypassing proxies
	proxies []*toxiproxy.Proxy
	toxics  *toxiproxy.ApiServer
	dbURL   string
	pg      *cluster.Postgres // set when the scenario owns its Postgres
	spec    *openapitest.Validator
	hist    chaos.History
	faults  chaos.Faults
	start   time.Time

	// What goes into the report (set by the scenario).
	id, title string
	control   bool
	result    *chaos.Result
	notes     []string
}

type envOptions struct {
	// proxies puts a toxiproxy proxy in front of every Redis node.
	proxies bool
	// ownPostgres starts a Postgres for this scenario alone (it may be
	// killed); otherwise a database on the test binary's shared server.
	ownPostgres bool
}

func newEnv(t *testing.T, id, title string, o envOptions) *env {
	t.Helper()
	e := &env{t: t, id: id, title: title, start: time.Now(), spec: openapitest.New(t, redfence.OpenAPI)}
	e.nodes = clustertest.Redis(t, 5, cluster.RedisOptions{})
	for _, n := range e.nodes {
		c := redis.NewClient(&redis.Options{Addr: n.Addr(), MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: time.Second, WriteTimeout: time.Second})
		t.Cleanup(func() { c.Close() })
		e.raw = append(e.raw, c)
	}
	if o.proxies {
		e.toxics = toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop())
		for i, n := range e.nodes {
			e.proxies = append(e.proxies, e.proxy(fmt.Sprintf("redis-%d", i), n.Addr()))
		}
	}
	if o.ownPostgres {
		e.pg = clustertest.Postgres(t)
		var err error
		if e.dbURL, err = e.pg.CreateDatabase(t.Context(), t.Name()); err != nil {
			t.Fatal(err)
		}
	} else {
		e.dbURL = clustertest.Database(t)
	}
	t.Cleanup(func() {
		report.Add(chaos.Scenario{ID: e.id, Title: e.title, Result: e.result, Faults: e.faults.Counts(),
			Duration: time.Since(e.start), Control: e.control, Notes: e.notes, Failed: t.Failed()})
	})
	return e
}

// proxy starts a toxiproxy proxy to upstream on a free loopback port.
func (e *env) proxy(name, upstream string) *toxiproxy.Proxy {
	e.t.Helper()
	if e.toxics == nil {
		e.toxics = toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop())
	}
	p := toxiproxy.NewProxy(e.toxics, name, "127.0.0.1:0", upstream)
	if err := p.Start(); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(p.Stop)
	return p
}

// addToxic adds a toxic (type, stream, attributes) named name to p.
func (e *env) addToxic(p *toxiproxy.Proxy, name, typ, stream string, attrs map[string]any) {
	e.t.Helper()
	b, _ := json.Marshal(map[string]any{"name": name, "type": typ, "stream": stream, "attributes": attrs})
	if _, err := p.Toxics.AddToxicJson(strings.NewReader(string(b))); err != nil {
		e.t.Fatalf("add toxic %s to %s: %v", name, p.Name, err)
	}
}

// removeToxic removes a toxic; it may run on any goroutine.
func (e *env) removeToxic(p *toxiproxy.Proxy, name string) {
	if err := p.Toxics.RemoveToxic(context.Background(), name); err != nil {
		e.t.Errorf("remove toxic %s from %s: %v", name, p.Name, err)
	}
}

// redisAddrs are the addresses the servers use: the proxies, if any.
func (e *env) redisAddrs() []string {
	var out []string
	for i, n := range e.nodes {
		if e.proxies != nil {
			out = append(out, e.proxies[i].Listen)
		} else {
			out = append(out, n.Addr())
		}
	}
	return out
}

// httpClient returns a client that validates every request and response
// against openapi.yaml, over a transport of its own.
func (e *env) httpClient(timeout time.Duration) *http.Client {
	tr := &http.Transport{MaxIdleConnsPerHost: 64, IdleConnTimeout: 30 * time.Second}
	e.t.Cleanup(tr.CloseIdleConnections)
	c := e.spec.Client(e.t, openapitest.Transport(tr))
	c.Timeout = timeout
	return c
}

func (e *env) client(id string, hc *http.Client) *chaos.Client {
	return &chaos.Client{ID: id, HTTP: hc, Record: e.hist.Add}
}

// serverConfig configures a server; the in-process-only fields are test
// switches `redfence serve` does not have.
type serverConfig struct {
	MaxTTL, NodeTimeout, IssueTimeout, StatementTimeout time.Duration
	DBMaxConns                                          int32

	// In-process servers only.
	Unfenced, NoQuarantine bool
	// StoreTimeout bounds reference-store calls (api.Options.StoreTimeout;
	// 0: its default).
	StoreTimeout time.Duration
	// Hook runs between quorum and issuance of acquires sent with
	// chaos.StallHeader (value: the header's).
	Hook func(ctx context.Context, key, value string)
}

func (c serverConfig) withDefaults() serverConfig {
	if c.MaxTTL == 0 {
		c.MaxTTL = 2 * time.Second
	}
	if c.NodeTimeout == 0 {
		c.NodeTimeout = 100 * time.Millisecond
	}
	if c.IssueTimeout == 0 {
		c.IssueTimeout = 2 * time.Second
	}
	if c.StatementTimeout == 0 {
		c.StatementTimeout = 5 * time.Second
	}
	return c
}

type server interface {
	URL() string
}

func links(ss ...server) func() []chaos.Link {
	return func() []chaos.Link {
		out := make([]chaos.Link, len(ss))
		for i, s := range ss {
			out[i] = chaos.Link{Base: s.URL()}
		}
		return out
	}
}

func link(s server) chaos.Link { return chaos.Link{Base: s.URL()} }

// inproc is a server in the test process, wired like cmd/redfence's Open
// but with the test-only switches.
type inproc struct {
	url    string
	locker *service.Locker
}

func (s *inproc) URL() string { return s.url }

type hookValue struct{}

func (e *env) startInproc(cfg serverConfig) *inproc {
	t := e.t
	t.Helper()
	cfg = cfg.withDefaults()
	ctx := t.Context()
	db, err := store.Open(ctx, e.dbURL, store.Options{MaxConns: cfg.DBMaxConns, StatementTimeout: cfg.StatementTimeout, Unfenced: cfg.Unfenced})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	if _, err := db.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	var nodes []service.Node
	for _, a := range e.redisAddrs() {
		n := service.NewRedisNode(a, service.RedisOptions{})
		t.Cleanup(func() { _ = n.Close() })
		nodes = append(nodes, n)
	}
	var reg service.Registry
	if !cfg.NoQuarantine {
		reg = db
	}
	var hook func(ctx context.Context, key string)
	if cfg.Hook != nil {
		hook = func(ctx context.Context, key string) {
			if v, ok := ctx.Value(hookValue{}).(string); ok {
				cfg.Hook(ctx, key, v)
			}
		}
	}
	logs := &testutil.Buffer{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("log of the in-process server (warnings):\n%s", logs.String())
		}
	})
	l, err := service.New(nodes, db, service.Options{
		NodeTimeout: cfg.NodeTimeout, MaxTTL: cfg.MaxTTL, IssueTimeout: cfg.IssueTimeout,
		Registry: reg, AfterQuorum: hook,
		Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Close)
	if err := l.Init(ctx); err != nil {
		t.Fatal(err)
	}
	h := api.NewHandler(l, db, api.Options{DefaultTTL: cfg.MaxTTL, OpenAPI: redfence.OpenAPI, StoreTimeout: cfg.StoreTimeout})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if v := r.Header.Get(chaos.StallHeader); v != "" {
				r = r.WithContext(context.WithValue(r.Context(), hookValue{}, v))
			}
			h.ServeHTTP(w, r)
		}),
		ReadHeaderTimeout: 5 * time.Second,
	}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return &inproc{url: "http://" + ln.Addr().String(), locker: l}
}

// proc is a `redfence serve` process.
type proc struct {
	t   *testing.T
	bin string
	env []string

	mu   sync.Mutex
	addr string // host:port once it serves; kept across restarts
	cmd  *exec.Cmd
	done chan struct{}
	logs []string // the last lines of its log
}

// Addr returns the address it listens on.
func (s *proc) Addr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.addr
}

func (s *proc) URL() string { return "http://" + s.Addr() }

func (e *env) startProc(cfg serverConfig) *proc {
	e.t.Helper()
	bin, _ := build(e.t)
	cfg = cfg.withDefaults()
	s := &proc{t: e.t, bin: bin, addr: "127.0.0.1:0", env: []string{
		"REDFENCE_REDIS_ADDRS=" + strings.Join(e.redisAddrs(), ","),
		"REDFENCE_DATABASE_URL=" + e.dbURL,
		"REDFENCE_MAX_TTL=" + cfg.MaxTTL.String(),
		"REDFENCE_DEFAULT_TTL=" + cfg.MaxTTL.String(),
		"REDFENCE_NODE_TIMEOUT=" + cfg.NodeTimeout.String(),
		"REDFENCE_ISSUE_TIMEOUT=" + cfg.IssueTimeout.String(),
		"REDFENCE_STATEMENT_TIMEOUT=" + cfg.StatementTimeout.String(),
		"REDFENCE_SHUTDOWN_TIMEOUT=1s",
		"REDFENCE_LOG_LEVEL=info",
		"REDFENCE_LOG_FORMAT=json",
		// The suite tests safety under faults, not access control.
		"REDFENCE_AUTH=false",
		"REDFENCE_RATE_LIMIT=0",
	}}
	if cfg.DBMaxConns > 0 {
		s.env = append(s.env, fmt.Sprintf("REDFENCE_DB_MAX_CONNS=%d", cfg.DBMaxConns))
	}
	if err := s.start(); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() {
		s.Kill()
		if e.t.Failed() {
			s.mu.Lock()
			e.t.Logf("last log lines of redfence on %s:\n%s", s.addr, strings.Join(s.logs, "\n"))
			s.mu.Unlock()
		}
	})
	return s
}

// start launches the process and waits until it serves (its "redfence
// serving" log line names the address).
func (s *proc) start() error {
	cmd := exec.Command(s.bin, "serve")
	cmd.Env = append(append(os.Environ(), s.env...), "REDFENCE_LISTEN_ADDR="+s.Addr())
	cmd.SysProcAttr = testutil.KillWithParent(&syscall.SysProcAttr{Setpgid: true})
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	ready := make(chan string, 1)
	done := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			s.mu.Lock()
			s.logs = append(s.logs, line)
			if len(s.logs) > 60 {
				s.logs = slices.Delete(s.logs, 0, len(s.logs)-60)
			}
			s.mu.Unlock()
			var l struct {
				Msg  string `json:"msg"`
				Addr string `json:"addr"`
			}
			if json.Unmarshal([]byte(line), &l) == nil && l.Msg == "redfence serving" {
				select {
				case ready <- l.Addr:
				default:
				}
			}
		}
		_ = cmd.Wait()
		close(done)
	}()
	s.mu.Lock()
	s.cmd, s.done = cmd, done
	s.mu.Unlock()
	select {
	case addr := <-ready:
		s.mu.Lock()
		s.addr = addr
		s.mu.Unlock()
		return nil
	case <-done:
		s.mu.Lock()
		defer s.mu.Unlock()
		return fmt.Errorf("redfence serve exited before serving:\n%s", strings.Join(s.logs, "\n"))
	case <-time.After(30 * time.Second):
		s.Kill()
		return errors.New("redfence serve did not start within 30s")
	}
}

// Kill kills the process with SIGKILL and waits until it has exited.
func (s *proc) Kill() {
	s.mu.Lock()
	cmd, done := s.cmd, s.done
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-done
}

// Restart starts the process again on the same address.
func (s *proc) Restart() {
	s.t.Helper()
	var err error
	for range 50 { // the port may take a moment to be free again
		if err = s.start(); err == nil {
			return
		}
		time.Sleep(50 * time.Millisecond) // polling for the port to be free
	}
	s.t.Fatal(err)
}

// waitFor polls cond every 10ms until it holds, failing the test after
// timeout.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond) // polling an observable condition
	}
}

// lockKey is the Redis key of the lock on name (default namespace).
func lockKey(name string) string { return "redfence:lock:" + name }

// holders returns, per node, the value of name's lock key ("" if none),
// reading the nodes directly.
func (e *env) holders(name string) []string {
	out := make([]string, len(e.raw))
	for i, c := range e.raw {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		v, err := c.Get(ctx, lockKey(name)).Result()
		cancel()
		if err == nil {
			out[i] = v
		}
	}
	return out
}

func count(vs []string, pred func(string) bool) int {
	n := 0
	for _, v := range vs {
		if pred(v) {
			n++
		}
	}
	return n
}

// lockKeys returns every lock key on every node with its PTTL (-1: no
// expiry).
func (e *env) lockKeys() map[string]time.Duration {
	out := make(map[string]time.Duration)
	for i, c := range e.raw {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		keys, err := c.Keys(ctx, "redfence:lock:*").Result()
		if err != nil {
			cancel()
			e.t.Fatalf("node %d: keys: %v", i, err)
		}
		for _, k := range keys {
			if d, err := c.PTTL(ctx, k).Result(); err == nil && d != -2 { // -2: expired meanwhile
				out[fmt.Sprintf("node %d %s", i, k)] = d
			}
		}
		cancel()
	}
	return out
}

// finals reads the final document of every name written in the history.
func (e *env) finals(l chaos.Link) map[string][]string {
	e.t.Helper()
	c := e.client("final-reader", e.httpClient(10*time.Second))
	c.Record = nil
	out := make(map[string][]string)
	for _, op := range e.hist.Ops() {
		if op.Kind != chaos.Write {
			continue
		}
		if _, done := out[op.Name]; done {
			continue
		}
		r := c.Read(e.t.Context(), l, op.Name)
		switch r.Status {
		case http.StatusOK:
			out[op.Name] = r.Elems
		case http.StatusNotFound:
			out[op.Name] = nil
		default:
			e.t.Fatalf("final read of %q: status %d %s %s", op.Name, r.Status, r.Problem, r.Err)
		}
	}
	return out
}

// check runs the checker on the history and keeps the result for the report.
func (e *env) check(l chaos.Link, exclusive bool) *chaos.Result {
	e.t.Helper()
	res := chaos.Check(e.hist.Ops(), e.finals(l), chaos.CheckOptions{
		Exclusive: exclusive, Windows: e.faults.Windows(), Label: e.t.Name(), Timeout: size(time.Minute, 3*time.Minute),
	})
	e.result = res
	if res.Visualization != "" {
		fmt.Printf("%s: porcupine visualisation saved to %s\n", e.t.Name(), res.Visualization)
		e.t.Logf("porcupine visualisation: %s", res.Visualization)
	}
	return res
}

// requireOK fails the test with the checker's violations unless res is OK,
// and unless the history holds a grant and at least minWrites acknowledged
// writes: a history without them passes every check of the checker, as one
// would whose store refused every write.
func requireOK(t testing.TB, res *chaos.Result, minWrites int) {
	t.Helper()
	if !res.OK() {
		t.Errorf("checker: %s\n  %s", res.Verdict(), strings.Join(res.Violations, "\n  "))
	}
	if res.Grants == 0 || res.ElemsAcked < minWrites {
		t.Errorf("checker: %d grants, %d acknowledged writes (refusals: %v); want at least 1 and %d: the checks passed vacuously",
			res.Grants, res.ElemsAcked, res.Refusals, minWrites)
	}
}

// errorsTB records Errorf calls instead of failing the test.
type errorsTB struct {
	testing.TB
	errs []string
}

func (r *errorsTB) Helper() {}

func (r *errorsTB) Errorf(format string, args ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}

func TestRequireOK(t *testing.T) {
	op := func(client string, kind chaos.Kind, call, status int, token int64) chaos.Op {
		return chaos.Op{Client: client, Kind: kind, Name: "n", Call: int64(call), Return: int64(call + 5), Status: status, Token: token, ValidityMS: 1000}
	}
	refused := func(client string, call int, token, current int64, elem string) chaos.Op {
		w := op(client, chaos.Write, call, http.StatusConflict, token)
		w.Problem, w.Current, w.Elems, w.Elem = "stale-token", &current, []string{elem}, elem
		return w
	}
	// A store that refuses every write, naming a newer token each time (a
	// token burned meanwhile, as far as the checker can tell): every check
	// passes.
	refusing := []chaos.Op{
		op("a", chaos.Acquire, 0, http.StatusCreated, 1), op("a", chaos.Read, 10, http.StatusNotFound, 0),
		refused("a", 20, 1, 2, "a-1"), op("a", chaos.Release, 30, http.StatusNoContent, 1),
		op("b", chaos.Acquire, 40, http.StatusCreated, 3), op("b", chaos.Read, 50, http.StatusNotFound, 0),
		refused("b", 60, 3, 4, "b-1"), op("b", chaos.Release, 70, http.StatusNoContent, 3),
	}
	for _, c := range []struct {
		name      string
		ops       []chaos.Op
		minWrites int
		fail      bool
	}{
		{"EveryWriteRefused", refusing, 1, true},
		{"NothingGranted", []chaos.Op{op("a", chaos.Acquire, 0, http.StatusConflict, 0)}, 0, true},
		{"NoWritesByDesign", refusing[:1], 0, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			res := chaos.Check(c.ops, map[string][]string{"n": nil}, chaos.CheckOptions{Exclusive: true})
			if !res.OK() {
				t.Fatalf("Check = %s %v; want OK (the history is vacuous, not wrong)", res.Verdict(), res.Violations)
			}
			tb := &errorsTB{TB: t}
			requireOK(tb, res, c.minWrites)
			if failed := len(tb.errs) > 0; failed != c.fail {
				t.Errorf("requireOK(%d grants, %d acknowledged writes, min %d) failed = %v %q; want %v", res.Grants, res.ElemsAcked, c.minWrites, failed, tb.errs, c.fail)
			}
		})
	}
}

func (e *env) note(format string, args ...any) {
	e.notes = append(e.notes, fmt.Sprintf(format, args...))
}

// ops returns the history's operations of kind that match pred.
func (e *env) ops(kind chaos.Kind, pred func(chaos.Op) bool) []chaos.Op {
	var out []chaos.Op
	for _, op := range e.hist.Ops() {
		if op.Kind == kind && (pred == nil || pred(op)) {
			out = append(out, op)
		}
	}
	return out
}

// latencies summarises the latencies of ops: p50, p99, max.
func latencies(ops []chaos.Op) (p50, p99, worst time.Duration) {
	if len(ops) == 0 {
		return 0, 0, 0
	}
	ds := make([]time.Duration, len(ops))
	for i, op := range ops {
		ds[i] = op.Latency()
	}
	slices.Sort(ds)
	return ds[len(ds)/2], ds[len(ds)*99/100], ds[len(ds)-1]
}

func ms(d time.Duration) string { return d.Round(time.Millisecond).String() }

// runBackground runs w in a goroutine; the returned func waits for it.
func runBackground(ctx context.Context, w *chaos.Workload) (wait func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		w.Run(ctx)
	}()
	return func() { <-done }
}

// copyLines sends each line of r to fn until r ends.
func copyLines(r io.Reader, fn func([]byte)) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		fn(sc.Bytes())
	}
}
