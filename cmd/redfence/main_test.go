package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/redfence/redfence/api"
	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/internal/testutil"
	"github.com/redfence/redfence/migrations"
)

// waitTimeout bounds every wait for an observable condition, and serves as
// a hang guard for calls that must return on their own.
const waitTimeout = 60 * time.Second

// envName derives the environment variable of a Config field the way
// envconfig does: the envconfig tag if set, else the field name split into
// words when split_words is set, upper-cased and prefixed with REDFENCE_.
func envName(f reflect.StructField) string {
	key := f.Name
	if f.Tag.Get("split_words") == "true" {
		var words []string
		for _, w := range regexp.MustCompile("([^A-Z]+|[A-Z]+[^A-Z]+|[A-Z]+)").FindAllString(f.Name, -1) {
			if m := regexp.MustCompile("([A-Z]+)([A-Z][^A-Z]+)").FindStringSubmatch(w); m != nil {
				words = append(words, m[1], m[2])
			} else {
				words = append(words, w)
			}
		}
		key = strings.Join(words, "_")
	}
	if alt := f.Tag.Get("envconfig"); alt != "" {
		key = alt
	}
	return strings.ToUpper(envPrefix + "_" + key)
}

func TestEnvName(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		field string
		want  string
	}{
		{"ListenAddr", "REDFENCE_LISTEN_ADDR"},
		{"RedisAddrs", "REDFENCE_REDIS_ADDRS"},
		{"DatabaseURL", "REDFENCE_DATABASE_URL"},
		{"MaxTTL", "REDFENCE_MAX_TTL"},
	} {
		f, ok := reflect.TypeFor[Config]().FieldByName(tc.field)
		if !ok {
			t.Errorf("Config has no field %s", tc.field)
			continue
		}
		if got := envName(f); got != tc.want {
			t.Errorf("envName(Config.%s) = %s; want %s", tc.field, got, tc.want)
		}
	}
}

func TestRun(t *testing.T) {
	t.Parallel()

	t.Run("Help", func(t *testing.T) {
		t.Parallel()
		var stdout, stderr bytes.Buffer
		if err := run(t.Context(), []string{"-h"}, &stdout, &stderr); err != nil {
			t.Fatalf("run -h = %v; want nil", err)
		}
		out := stdout.String()
		typ := reflect.TypeFor[Config]()
		for i := range typ.NumField() {
			name := envName(typ.Field(i))
			if !regexp.MustCompile(`\b` + name + `\b`).MatchString(out) {
				t.Errorf("run -h output lacks %s (Config.%s):\n%s", name, typ.Field(i).Name, out)
			}
		}
		for _, cmd := range []string{"serve", "dev", "migrate", "version"} {
			if !strings.Contains(out, "redfence "+cmd) {
				t.Errorf("run -h output lacks the command %q", cmd)
			}
		}
	})

	t.Run("SubcommandHelp", func(t *testing.T) {
		t.Parallel()
		for _, args := range [][]string{{"serve", "-h"}, {"keys", "create", "--help"}, {"keys", "revoke", "-h"}, {"healthcheck", "-h"}, {"version", "--help"}, {"version", "-h"}} {
			var stdout, stderr bytes.Buffer
			if err := run(t.Context(), args, &stdout, &stderr); err != nil {
				t.Errorf("run %q = %v; want nil", args, err)
			}
			if !strings.Contains(stdout.String(), "Usage: redfence") || stderr.Len() != 0 {
				t.Errorf("run %q: stdout %q, stderr %q; want the help on stdout only", args, stdout.String(), stderr.String())
			}
		}
	})

	t.Run("Version", func(t *testing.T) {
		t.Parallel()
		var stdout, stderr bytes.Buffer
		if err := run(t.Context(), []string{"version"}, &stdout, &stderr); err != nil {
			t.Fatalf("run version = %v; want nil", err)
		}
		if got := strings.Fields(stdout.String()); len(got) < 2 || got[0] != "redfence" {
			t.Errorf("run version printed %q; want \"redfence <version>\"", stdout.String())
		}
	})

	for _, tc := range []struct {
		name string
		args []string
	}{
		{"NoCommand", nil},
		{"UnknownCommand", []string{"frobnicate"}},
		{"UnknownFlag", []string{"migrate", "--frobnicate"}},
		{"ExtraArgs", []string{"serve", "extra"}},
		{"KeysCreateUnknownFlag", []string{"keys", "create", "--tenant", "x", "--bogus"}},
		{"HealthcheckExtraArgs", []string{"healthcheck", "extra"}},
		{"VersionUnknownFlag", []string{"version", "--bogus"}},
		{"VersionExtraArgs", []string{"version", "extra"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var stdout, stderr bytes.Buffer
			err := run(t.Context(), tc.args, &stdout, &stderr)
			if !errors.Is(err, errUsage) {
				t.Fatalf("run %q = %v; want errUsage", tc.args, err)
			}
			if code := exitCode(err); code != 2 {
				t.Errorf("exitCode(run %q) = %d; want 2", tc.args, code)
			}
			if stderr.Len() == 0 || stdout.Len() != 0 {
				t.Errorf("run %q printed %d bytes on stdout, %d on stderr; want the error and usage on stderr only", tc.args, stdout.Len(), stderr.Len())
			}
		})
	}
}

// testConfig returns the default configuration with the given backends,
// listening on a free loopback port, and with a node timeout generous
// enough for a loaded test machine.
func testConfig(t testing.TB, redisAddrs []string, databaseURL string) *Config {
	t.Helper()
	cfg, err := loadConfig()
	if err != nil {
		t.Fatalf("loadConfig: %v", err)
	}
	cfg.ListenAddr = "127.0.0.1:0"
	cfg.RedisAddrs = redisAddrs
	cfg.DatabaseURL = databaseURL
	cfg.NodeTimeout = 2 * time.Second
	cfg.ShutdownTimeout = 10 * time.Second
	cfg.Auth = false // access control has its own tests (auth_test.go)
	return cfg
}

func addrs(nodes []*cluster.Redis) []string {
	a := make([]string, len(nodes))
	for i, n := range nodes {
		a[i] = n.Addr()
	}
	return a
}

// discard is a logger that drops everything.
var discard = slog.New(slog.DiscardHandler)

// open runs Open and closes the server in t.Cleanup. The returned close
// function closes it earlier; it may be called once.
func open(t testing.TB, cfg *Config, log *slog.Logger) (*Server, func(context.Context) error) {
	t.Helper()
	s, err := Open(t.Context(), cfg, log, ServerOptions{})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	var once sync.Once
	closeFn := func(ctx context.Context) error {
		err := errors.New("closed twice")
		once.Do(func() { err = s.Close(ctx) })
		return err
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		once.Do(func() {
			if err := s.Close(ctx); err != nil {
				t.Errorf("Close: %v", err)
			}
		})
	})
	return s, closeFn
}

var httpClient = &http.Client{Timeout: waitTimeout}

// response is a received HTTP response with its body read.
type response struct {
	status int
	header http.Header
	body   []byte
}

// call sends a request to the server at addr; body, if not empty, is sent as
// JSON. hdr holds header name, value pairs.
func call(t testing.TB, method, addr, path, body string, hdr ...string) response {
	t.Helper()
	var r io.Reader
	if body != "" {
		r = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(t.Context(), method, "http://"+addr+path, r)
	if err != nil {
		t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Add(hdr[i], hdr[i+1])
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: reading body: %v", method, path, err)
	}
	return response{resp.StatusCode, resp.Header, b}
}

// expect checks the status of r and decodes its body into v (if not nil).
func expect(t testing.TB, what string, r response, status int, v any) {
	t.Helper()
	if r.status != status {
		t.Fatalf("%s: status %d (body %s); want %d", what, r.status, r.body, status)
	}
	if v != nil {
		if err := json.Unmarshal(r.body, v); err != nil {
			t.Fatalf("%s: decoding %s: %v", what, r.body, err)
		}
	}
}

// acquire takes the lock name on the server at addr and returns the grant.
func acquire(t testing.TB, addr, name string) api.LockResponse {
	t.Helper()
	var g api.LockResponse
	expect(t, "acquire "+name, call(t, http.MethodPost, addr, "/v1/locks/"+name, `{"ttl_ms":30000,"owner":"tester"}`), http.StatusCreated, &g)
	if g.LockToken == "" {
		t.Fatalf("acquire %s: empty lock_token", name)
	}
	return g
}

// redfenceConns counts the connections the store (application_name
// redfence) holds to the database at url.
func redfenceConns(ctx context.Context, url string) (int, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var n int
	err = conn.QueryRow(ctx, `
SELECT count(*) FROM pg_stat_activity
 WHERE datname = current_database() AND application_name = 'redfence'`).Scan(&n)
	return n, err
}

func TestOpen(t *testing.T) {
	t.Parallel()

	t.Run("ReportsDeadNodes", func(t *testing.T) {
		t.Parallel()
		nodes := clustertest.Redis(t, 1, cluster.RedisOptions{})
		// Three addresses where nothing listens (privileged ports no test
		// server takes; a port freed here could be taken by a parallel
		// test's server): 4 nodes, an even number.
		dead := []string{"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"}
		var logs testutil.Buffer
		log := slog.New(slog.NewJSONHandler(&logs, nil))
		open(t, testConfig(t, append(addrs(nodes), dead...), clustertest.Database(t)), log)
		out := logs.String()
		for _, a := range dead {
			if !strings.Contains(out, `"msg":"node does not answer","node":"`+a+`"`) {
				t.Errorf("no warning for the dead node %s:\n%s", a, out)
			}
		}
		if !strings.Contains(out, `"level":"ERROR","msg":"fewer Redis nodes answer than a majority`) {
			t.Errorf("no error for 1 node of 4 answering:\n%s", out)
		}
		if !strings.Contains(out, `"nodes":4,"quorum":3,"failures_tolerated":1`) {
			t.Errorf("no warning about an even number of nodes:\n%s", out)
		}
	})

	// Nodes that answer but are quarantined (new addresses while another
	// server may hold leases: here the same nodes spelt another way) are
	// logged as not counting, with the line the end of their quarantines
	// answers, never as not answering.
	t.Run("ReportsQuarantinedNodes", func(t *testing.T) {
		t.Parallel()
		url := clustertest.Database(t)
		nodes := addrs(clustertest.Redis(t, 3, cluster.RedisOptions{}))
		open(t, testConfig(t, nodes, url), discard)
		respelt := make([]string, len(nodes))
		for i, a := range nodes {
			respelt[i] = strings.Replace(a, "127.0.0.1:", "localhost:", 1)
		}
		var logs testutil.Buffer
		open(t, testConfig(t, respelt, url), slog.New(slog.NewJSONHandler(&logs, nil)))
		out := logs.String()
		// Once, when every node is recorded: not as each one is.
		if !strings.Contains(out, `"level":"ERROR","msg":"fewer Redis nodes count than a majority`) ||
			!strings.Contains(out, `"counting":0,"answering":3,"nodes":3`) || strings.Count(out, "fewer Redis nodes count") != 1 {
			t.Errorf("no single error for 3 quarantined nodes of 3 (counting 0, answering 3):\n%s", out)
		}
		if strings.Contains(out, "fewer Redis nodes answer") || strings.Contains(out, "does not answer") {
			t.Errorf("nodes that answer logged as not answering:\n%s", out)
		}
	})

	t.Run("ServeAndClose", func(t *testing.T) {
		t.Parallel()
		nodes := clustertest.Redis(t, 5, cluster.RedisOptions{})
		url := clustertest.Database(t)
		s, closeFn := open(t, testConfig(t, addrs(nodes), url), discard)
		addr := s.Addr()

		expect(t, "GET /healthz", call(t, http.MethodGet, addr, "/healthz", ""), http.StatusOK, nil)
		if g := acquire(t, addr, "x"); g.FencingToken != 1 || g.Name != "x" {
			t.Errorf("acquire x = name %q, fencing_token %d; want x, 1", g.Name, g.FencingToken)
		}

		ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
		defer cancel()
		if err := closeFn(ctx); err != nil {
			t.Fatalf("Close = %v; want nil", err)
		}
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			t.Errorf("dial %s after Close succeeded; want connection refused", addr)
		}
		testutil.WaitFor(t, waitTimeout, "the store's connections to close", func() (bool, error) {
			n, err := redfenceConns(t.Context(), url)
			return n == 0, err
		})
	})

	t.Run("Errors", func(t *testing.T) {
		t.Parallel()
		taken, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { taken.Close() })

		for _, tc := range []struct {
			name   string
			change func(*Config)
			want   string // in the error text
		}{
			{"NoRedis", func(c *Config) { c.RedisAddrs = nil }, "REDFENCE_REDIS_ADDRS"},
			{"NoDatabase", func(c *Config) { c.DatabaseURL = "" }, "REDFENCE_DATABASE_URL"},
			{"BadListenAddr", func(c *Config) { c.ListenAddr = "127.0.0.1:notaport" }, "127.0.0.1:notaport"},
			{"ListenAddrTaken", func(c *Config) { c.ListenAddr = taken.Addr().String() }, taken.Addr().String()},
		} {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				url := clustertest.Database(t)
				// Nodes of its own: nodes marked by servers of another
				// database are refused (ErrForeignNode).
				cfg := testConfig(t, addrs(clustertest.Redis(t, 3, cluster.RedisOptions{})), url)
				tc.change(cfg)
				s, err := Open(t.Context(), cfg, discard, ServerOptions{})
				if err == nil {
					s.Close(context.Background())
					t.Fatalf("Open succeeded; want an error mentioning %s", tc.want)
				}
				if !strings.Contains(err.Error(), tc.want) {
					t.Errorf("Open error = %q; want it to mention %s", err, tc.want)
				}
				// Whatever Open connected to is closed again.
				testutil.WaitFor(t, waitTimeout, "the store's connections to close", func() (bool, error) {
					n, err := redfenceConns(t.Context(), url)
					return n == 0, err
				})
			})
		}
	})

	t.Run("TwoServers", func(t *testing.T) {
		t.Parallel()
		nodes := clustertest.Redis(t, 5, cluster.RedisOptions{})
		url := clustertest.Database(t)
		// Both Open at once: their migrations race on the fresh database.
		var servers [2]*Server
		var errs [2]error
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range servers {
			wg.Go(func() {
				<-start
				servers[i], errs[i] = Open(t.Context(), testConfig(t, addrs(nodes), url), discard, ServerOptions{})
			})
		}
		close(start)
		wg.Wait()
		for i, s := range servers {
			if s != nil {
				t.Cleanup(func() {
					ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
					defer cancel()
					if err := s.Close(ctx); err != nil {
						t.Errorf("Close server %d: %v", i, err)
					}
				})
			}
		}
		if err := errors.Join(errs[:]...); err != nil {
			t.Fatalf("concurrent Open: %v", err)
		}
		a, b := servers[0].Addr(), servers[1].Addr()

		g := acquire(t, a, "x")
		if g.FencingToken != 1 {
			t.Errorf("acquire x on A: fencing_token %d; want 1", g.FencingToken)
		}
		var st api.LockStatus
		expect(t, "GET x on B", call(t, http.MethodGet, b, "/v1/locks/x", ""), http.StatusOK, &st)
		if !st.Held || st.LastFencingToken != 1 {
			t.Errorf("GET x on B = held %v, last_fencing_token %d; want true, 1", st.Held, st.LastFencingToken)
		}
		expect(t, "acquire x on B while A holds it", call(t, http.MethodPost, b, "/v1/locks/x", `{"ttl_ms":30000}`), http.StatusConflict, nil)
		expect(t, "release x on A", call(t, http.MethodDelete, a, "/v1/locks/x", "", api.LockTokenHeader, g.LockToken), http.StatusNoContent, nil)
		if g2 := acquire(t, b, "x"); g2.FencingToken != 2 {
			t.Errorf("acquire x on B after release: fencing_token %d; want 2", g2.FencingToken)
		}
	})
}

// TestRun_Migrate sets the environment, so it cannot run in parallel.
func TestRun_Migrate(t *testing.T) {
	names, err := fs.Glob(migrations.FS, "*.sql")
	if err != nil || len(names) == 0 {
		t.Fatalf("embedded migrations = %v, %v; want at least one", names, err)
	}

	t.Run("NoURL", func(t *testing.T) {
		t.Setenv("REDFENCE_DATABASE_URL", "")
		var stdout, stderr bytes.Buffer
		err := run(t.Context(), []string{"migrate"}, &stdout, &stderr)
		if err == nil || !strings.Contains(err.Error(), "REDFENCE_DATABASE_URL") {
			t.Errorf("run migrate without a URL = %v; want an error naming REDFENCE_DATABASE_URL", err)
		}
	})

	t.Run("Twice", func(t *testing.T) {
		t.Setenv("REDFENCE_DATABASE_URL", clustertest.Database(t))
		var stdout, stderr bytes.Buffer
		if err := run(t.Context(), []string{"migrate"}, &stdout, &stderr); err != nil {
			t.Fatalf("run migrate = %v; want nil (stderr: %s)", err, stderr.String())
		}
		for _, name := range names {
			if want := "applied " + name; !strings.Contains(stdout.String(), want) {
				t.Errorf("run migrate printed %q; want it to contain %q", stdout.String(), want)
			}
		}
		stdout.Reset()
		if err := run(t.Context(), []string{"migrate"}, &stdout, &stderr); err != nil {
			t.Fatalf("second run migrate = %v; want nil (stderr: %s)", err, stderr.String())
		}
		if got, want := strings.TrimSpace(stdout.String()), "database is up to date"; got != want {
			t.Errorf("second run migrate printed %q; want %q", got, want)
		}
	})

	// A database a newer redfence migrated: migrate says so, and serve
	// warns at start but serves (a rolling upgrade runs both versions).
	t.Run("NewerDatabase", func(t *testing.T) {
		url := clustertest.Database(t)
		cleanEnv(t)
		t.Setenv("REDFENCE_DATABASE_URL", url)
		var stdout, stderr bytes.Buffer
		if err := run(t.Context(), []string{"migrate"}, &stdout, &stderr); err != nil {
			t.Fatalf("run migrate = %v (stderr: %s)", err, stderr.String())
		}
		var newest int64
		for _, name := range names {
			var v int64
			if _, err := fmt.Sscanf(name, "%d_", &v); err != nil {
				t.Fatalf("migration %s: %v", name, err)
			}
			newest = max(newest, v)
		}
		conn, err := pgx.Connect(t.Context(), url)
		if err != nil {
			t.Fatal(err)
		}
		_, err = conn.Exec(t.Context(), `INSERT INTO redfence_schema_migrations (version_id, is_applied) VALUES ($1, true)`, newest+1)
		conn.Close(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		want := fmt.Sprintf("database schema is at version %d, newer than this binary's %d: a newer redfence migrated it", newest+1, newest)

		stdout.Reset()
		if err := run(t.Context(), []string{"migrate"}, &stdout, &stderr); err != nil {
			t.Fatalf("run migrate on a newer database = %v; want nil (stderr: %s)", err, stderr.String())
		}
		if got := strings.TrimSpace(stdout.String()); got != want {
			t.Errorf("run migrate on a newer database printed %q; want %q", got, want)
		}

		nodes := clustertest.Redis(t, 1, cluster.RedisOptions{})
		t.Setenv("REDFENCE_REDIS_ADDRS", strings.Join(addrs(nodes), ","))
		t.Setenv("REDFENCE_LISTEN_ADDR", "127.0.0.1:0")
		t.Setenv("REDFENCE_NODE_TIMEOUT", "2s")
		ctx, stop := context.WithCancel(t.Context())
		defer stop()
		logs := &testutil.Buffer{}
		served := make(chan error, 1)
		go func() { served <- run(ctx, []string{"serve"}, io.Discard, logs) }()
		warned := func() bool {
			for line := range strings.Lines(logs.String()) {
				var l struct{ Level, Msg string }
				if json.Unmarshal([]byte(line), &l) == nil && l.Level == "WARN" && strings.HasPrefix(l.Msg, want) {
					return true
				}
			}
			return false
		}
		testutil.WaitFor(t, waitTimeout, "serve's warning", func() (bool, error) {
			select {
			case err := <-served:
				return false, fmt.Errorf("serve ended (%v) without the warning %q:\n%s", err, want, logs.String())
			default:
			}
			return warned(), nil
		})
		if !strings.Contains(logs.String(), `"msg":"redfence serving"`) {
			t.Errorf("serve on a newer database did not serve:\n%s", logs.String())
		}
		stop()
		select {
		case err := <-served:
			if err != nil {
				t.Errorf("serve on a newer database = %v; want nil after the context ends", err)
			}
		case <-time.After(waitTimeout):
			t.Fatalf("serve still running %v after its context ended", waitTimeout)
		}
	})
}

// buildBinary builds the redfence command into a temporary directory.
func buildBinary(t testing.TB) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "redfence")
	cmd := exec.Command("go", "build", "-o", bin, ".")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// logLine is the part of a JSON log record the tests look at.
type logLine struct {
	Msg  string `json:"msg"`
	Addr string `json:"addr"`
}

// serveProc is a `redfence serve` child process.
type serveProc struct {
	cmd    *exec.Cmd
	addr   string
	logs   *testutil.Buffer
	exited chan error
	done   bool
}

// startServe runs `redfence serve` on 3 fresh Redis nodes and a fresh
// database, with env added to its settings, and waits until it serves.
func startServe(t *testing.T, env ...string) *serveProc {
	t.Helper()
	bin := buildBinary(t)
	nodes := clustertest.Redis(t, 3, cluster.RedisOptions{})
	url := clustertest.Database(t)

	cmd := exec.Command(bin, "serve")
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "REDFENCE_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env,
		"REDFENCE_LISTEN_ADDR=127.0.0.1:0",
		"REDFENCE_REDIS_ADDRS="+strings.Join(addrs(nodes), ","),
		"REDFENCE_DATABASE_URL="+url,
		"REDFENCE_NODE_TIMEOUT=2s",
		"REDFENCE_SHUTDOWN_TIMEOUT=10s",
		"REDFENCE_LOG_FORMAT=json",
		"REDFENCE_LOG_LEVEL=info",
		"REDFENCE_AUTH=false",
	)
	cmd.Env = append(cmd.Env, env...)
	// The kernel kills the server if the test binary dies.
	cmd.SysProcAttr = testutil.KillWithParent(nil)
	var stdout bytes.Buffer
	cmd.Stdout = &stdout
	stderrPipe, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}

	p := &serveProc{cmd: cmd, logs: &testutil.Buffer{}, exited: make(chan error, 1)}
	serving := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderrPipe)
		for sc.Scan() {
			fmt.Fprintln(p.logs, sc.Text())
			var l logLine
			if json.Unmarshal(sc.Bytes(), &l) == nil && l.Msg == "redfence serving" {
				select {
				case serving <- l.Addr:
				default:
				}
			}
		}
		p.exited <- cmd.Wait()
	}()
	t.Cleanup(func() {
		if !p.done {
			_ = cmd.Process.Kill()
			<-p.exited
		}
	})

	select {
	case p.addr = <-serving:
	case err := <-p.exited:
		p.done = true
		t.Fatalf("redfence serve exited before serving: %v\nstderr:\n%s", err, p.logs.String())
	case <-time.After(waitTimeout):
		t.Fatalf("no \"redfence serving\" log line after %v; stderr:\n%s", waitTimeout, p.logs.String())
	}
	if p.addr == "" {
		t.Fatalf("\"redfence serving\" log line has no addr; stderr:\n%s", p.logs.String())
	}
	return p
}

// wait returns the exit error of the process, failing t if it does not
// exit within waitTimeout.
func (p *serveProc) wait(t *testing.T, what string) error {
	t.Helper()
	select {
	case err := <-p.exited:
		p.done = true
		return err
	case <-time.After(waitTimeout):
		t.Fatalf("redfence serve still running %v after %s; stderr:\n%s", waitTimeout, what, p.logs.String())
	}
	return nil
}

// TestServe_Signals: SIGTERM, SIGINT and SIGHUP (a closed terminal) each
// shut serve down gracefully.
func TestServe_Signals(t *testing.T) {
	t.Parallel()
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP} {
		t.Run(sig.String(), func(t *testing.T) {
			t.Parallel()
			testServeStops(t, sig)
		})
	}
}

func testServeStops(t *testing.T, sig syscall.Signal) {
	p := startServe(t)
	expect(t, "GET /healthz", call(t, http.MethodGet, p.addr, "/healthz", ""), http.StatusOK, nil)
	acquire(t, p.addr, "before-shutdown")

	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
	if err := p.wait(t, sig.String()); err != nil {
		t.Errorf("redfence serve after %v: %v; want exit status 0\nstderr:\n%s", sig, err, p.logs.String())
	}

	var shutdown bool
	for line := range strings.Lines(p.logs.String()) {
		var l logLine
		if json.Unmarshal([]byte(line), &l) == nil && l.Msg == "shutting down" {
			shutdown = true
		}
	}
	if !shutdown {
		t.Errorf("no JSON log line \"shutting down\"; stderr:\n%s", p.logs.String())
	}
	if c, err := net.Dial("tcp", p.addr); err == nil {
		c.Close()
		t.Errorf("dial %s after exit succeeded; want connection refused", p.addr)
	}
}

// TestServe_ShutdownDelay: with REDFENCE_SHUTDOWN_DELAY, SIGTERM first
// makes /readyz answer 503 shutting-down while locks are still served (a
// load balancer drains the server), and a second signal ends the delay,
// not the grace period that follows.
func TestServe_ShutdownDelay(t *testing.T) {
	t.Parallel()
	p := startServe(t, "REDFENCE_SHUTDOWN_DELAY=1h")
	expect(t, "GET /readyz", call(t, http.MethodGet, p.addr, "/readyz", ""), http.StatusOK, nil)
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, waitTimeout, "/readyz to fail", func() (bool, error) {
		r := call(t, http.MethodGet, p.addr, "/readyz", "")
		return r.status == http.StatusServiceUnavailable && strings.Contains(string(r.body), `"status":"shutting-down"`), nil
	})
	acquire(t, p.addr, "during-delay") // still served
	expect(t, "GET /healthz", call(t, http.MethodGet, p.addr, "/healthz", ""), http.StatusOK, nil)
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// The second signal ends the delay only: the shutdown is graceful.
	if err := p.wait(t, "a second SIGTERM during the delay"); err != nil {
		t.Errorf("redfence serve after a second SIGTERM during the delay: %v; want exit status 0", err)
	}
	logs := p.logs.String()
	if !strings.Contains(logs, "not ready: serving on until the shutdown delay ends") || !strings.Contains(logs, `"msg":"shutting down"`) || strings.Contains(logs, "second signal: stopping now") {
		t.Errorf("want the delay and a graceful shutdown, not the grace period cut short, in:\n%s", logs)
	}
}

// TestServe_ShutdownEndsWaits checks the two ways a shutdown is not held
// up: a blocking acquire stops waiting at once, with 503 shutting-down, and
// a second SIGTERM ends the grace period while a request is still in flight.
func TestServe_ShutdownEndsWaits(t *testing.T) {
	t.Parallel()
	// Grace and header timeouts far beyond the test's: only the drain and
	// the second signal can end this shutdown in time.
	p := startServe(t, "REDFENCE_SHUTDOWN_TIMEOUT=1h", "REDFENCE_READ_HEADER_TIMEOUT=1h", "REDFENCE_READ_TIMEOUT=1h")
	acquire(t, p.addr, "held")

	type answer struct {
		status int
		header http.Header
		body   []byte
		err    error
	}
	waited := make(chan answer, 1)
	go func() {
		req, err := http.NewRequest(http.MethodPost, "http://"+p.addr+"/v1/locks/held", strings.NewReader(`{"wait_ms":55000}`))
		if err != nil {
			waited <- answer{err: err}
			return
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := httpClient.Do(req)
		if err != nil {
			waited <- answer{err: err}
			return
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		waited <- answer{resp.StatusCode, resp.Header, b, err}
	}()
	// The waiter is waiting once the blocked-waiters gauge says so.
	for !strings.Contains(string(call(t, http.MethodGet, p.addr, "/metrics", "").body), "\nredfence_blocked_waiters 1\n") {
		select {
		case a := <-waited:
			t.Fatalf("the blocking acquire answered before the shutdown: %d %s %v", a.status, a.body, a.err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	// A request whose body never comes keeps its handler running, so the
	// graceful shutdown cannot finish by itself. The server's 100 Continue
	// says the handler is reading the body.
	stuck, err := net.Dial("tcp", p.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer stuck.Close()
	if _, err := io.WriteString(stuck, "PUT /v1/resources/stuck HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"+
		"Content-Length: 40\r\nExpect: 100-continue\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	if line, err := bufio.NewReader(stuck).ReadString('\n'); err != nil || !strings.HasPrefix(line, "HTTP/1.1 100 ") {
		t.Fatalf("the stuck request: %q, %v; want 100 Continue", line, err)
	}

	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	var a answer
	select {
	case a = <-waited:
	case err := <-p.exited:
		p.done = true
		t.Fatalf("redfence serve exited (%v) before the waiter was answered; stderr:\n%s", err, p.logs.String())
	case <-time.After(waitTimeout):
		t.Fatalf("the blocking acquire still waits %v after SIGTERM", waitTimeout)
	}
	if a.err != nil {
		t.Fatalf("blocking acquire during shutdown: %v; want a 503 answer", a.err)
	}
	var prob api.Problem
	if err := json.Unmarshal(a.body, &prob); err != nil || a.status != http.StatusServiceUnavailable ||
		prob.Type != api.ProblemTypePrefix+"shutting-down" || a.header.Get("Retry-After") == "" {
		t.Errorf("blocking acquire during shutdown = %d %s (Retry-After %q); want 503 shutting-down with Retry-After",
			a.status, a.body, a.header.Get("Retry-After"))
	}

	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	err = p.wait(t, "a second SIGTERM")
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 || !strings.Contains(p.logs.String(), "second signal") {
		t.Errorf("redfence serve after a second SIGTERM: %v; want exit status 1, the grace period cut short\nstderr:\n%s", err, p.logs.String())
	}
}

func TestServer_NoSecretsInLogs(t *testing.T) {
	t.Parallel()
	nodes := clustertest.Redis(t, 3, cluster.RedisOptions{})
	var logs testutil.Buffer
	log := slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	s, closeFn := open(t, testConfig(t, addrs(nodes), clustertest.Database(t)), log)
	addr := s.Addr()

	var secrets []string
	var bodies []response // responses that must not carry a lock token either
	lockHdr := api.LockTokenHeader

	g := acquire(t, addr, "s")
	secrets = append(secrets, g.LockToken)
	r := call(t, http.MethodPost, addr, "/v1/locks/s/extend", `{"ttl_ms":20000}`, lockHdr, g.LockToken)
	expect(t, "extend", r, http.StatusOK, nil)
	bodies = append(bodies, r)
	r = call(t, http.MethodGet, addr, "/v1/locks/s", "")
	expect(t, "status", r, http.StatusOK, nil)
	bodies = append(bodies, r)
	r = call(t, http.MethodPut, addr, "/v1/resources/s", fmt.Sprintf(`{"fencing_token":%d,"data":{"v":1}}`, g.FencingToken))
	expect(t, "put", r, http.StatusOK, nil)
	bodies = append(bodies, r)
	r = call(t, http.MethodGet, addr, "/v1/resources/s", "")
	expect(t, "get resource", r, http.StatusOK, nil)
	bodies = append(bodies, r)
	r = call(t, http.MethodPost, addr, "/v1/locks/s", `{"ttl_ms":20000}`)
	expect(t, "acquire while held", r, http.StatusConflict, nil)
	bodies = append(bodies, r)
	expect(t, "release", call(t, http.MethodDelete, addr, "/v1/locks/s", "", lockHdr, g.LockToken), http.StatusNoContent, nil)
	// Error paths with the now-invalid token.
	r = call(t, http.MethodDelete, addr, "/v1/locks/s", "", lockHdr, g.LockToken)
	expect(t, "release again", r, http.StatusConflict, nil)
	bodies = append(bodies, r)
	r = call(t, http.MethodPost, addr, "/v1/locks/s/extend", `{"ttl_ms":20000}`, lockHdr, g.LockToken)
	expect(t, "extend after release", r, http.StatusConflict, nil)
	bodies = append(bodies, r)
	r = call(t, http.MethodPut, addr, "/v1/resources/s", fmt.Sprintf(`{"fencing_token":%d,"data":{"v":2}}`, g.FencingToken+5))
	expect(t, "put with a never-issued token", r, http.StatusConflict, nil)
	bodies = append(bodies, r)
	// A second grant, and a request with its token under the wrong name.
	g2 := acquire(t, addr, "s")
	secrets = append(secrets, g2.LockToken)
	r = call(t, http.MethodDelete, addr, "/v1/locks/other", "", lockHdr, g2.LockToken)
	expect(t, "release another name", r, http.StatusConflict, nil)
	bodies = append(bodies, r)
	expect(t, "release second grant", call(t, http.MethodDelete, addr, "/v1/locks/s", "", lockHdr, g2.LockToken), http.StatusNoContent, nil)

	// Close flushes: every handler, and so every access log line, is done.
	ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
	defer cancel()
	if err := closeFn(ctx); err != nil {
		t.Fatalf("Close: %v", err)
	}

	text := logs.String()
	if n := strings.Count(text, `"msg":"http request"`); n < 12 {
		t.Fatalf("captured %d access log lines; want at least 12 (is the logger wired?):\n%s", n, text)
	}
	for _, secret := range secrets {
		if strings.Contains(text, secret) {
			t.Errorf("log contains lock token %q:\n%s", secret, text)
		}
		for _, r := range bodies {
			if bytes.Contains(r.body, []byte(secret)) {
				t.Errorf("a %d response body contains lock token %q: %s", r.status, secret, r.body)
			}
		}
	}
}

func TestProbeAddr(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ listen, host, port string }{
		{"127.0.0.1:8080", "127.0.0.1", "8080"},
		{":8080", "127.0.0.1", "8080"},
		{"0.0.0.0:8080", "127.0.0.1", "8080"},
		{"[::]:8080", "::1", "8080"},
		{"[::1]:9090", "::1", "9090"},
		{"10.1.2.3:80", "10.1.2.3", "80"},
		{":http", "127.0.0.1", "80"},
	} {
		host, port, err := probeAddr(tc.listen)
		if err != nil || host != tc.host || port != tc.port {
			t.Errorf("probeAddr(%q) = %q, %q, %v; want %q, %q", tc.listen, host, port, err, tc.host, tc.port)
		}
	}
	for _, bad := range []string{"8080", "host:", "host:0"} {
		if _, _, err := probeAddr(bad); err == nil {
			t.Errorf("probeAddr(%q) succeeded; want an error", bad)
		}
	}
}

// TestSignalHelperProcess is not a test: TestSignals_ThirdEndsTheProcess
// runs the test binary through it, so that real signals reach a process
// that sets them up as main and serveUntilDone do, and whose shutdown then
// hangs.
func TestSignalHelperProcess(t *testing.T) {
	if os.Getenv("RF_SIGNAL_HELPER") != "1" {
		return
	}
	fmt.Println("signals:", shutdownSignals())
	ctx, cancel := signal.NotifyContext(context.Background(), shutdownSignals()...)
	defer cancel()
	fmt.Println("ready")
	<-ctx.Done()
	again, stop := lastSignal()
	defer stop()
	fmt.Println("first")
	<-again.Done()
	fmt.Println("second")
	time.Sleep(time.Hour) // a shutdown that hangs
}

// signalHelper starts TestSignalHelperProcess through sh -c script (which
// ends with exec "$0" "$@") and returns it with its stdout lines.
func signalHelper(t *testing.T, script string) (*exec.Cmd, <-chan string, <-chan error) {
	t.Helper()
	cmd := exec.Command("sh", "-c", script, os.Args[0], "-test.run=^TestSignalHelperProcess$")
	cmd.Env = append(os.Environ(), "RF_SIGNAL_HELPER=1")
	cmd.SysProcAttr = testutil.KillWithParent(nil)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan string, 10)
	exited := make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- sc.Text()
		}
		exited <- cmd.Wait()
	}()
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	return cmd, lines, exited
}

// nextLine returns the helper's next line of output.
func nextLine(t *testing.T, lines <-chan string, exited <-chan error) string {
	t.Helper()
	select {
	case l := <-lines:
		return l
	case err := <-exited:
		t.Fatalf("the helper exited: %v", err)
	case <-time.After(waitTimeout):
		t.Fatalf("no line from the helper after %v", waitTimeout)
	}
	return ""
}

// TestSignals_ThirdEndsTheProcess: SIGTERM and SIGHUP each start the
// shutdown, a second ends its grace period, and a third is not swallowed:
// it has its default action, ending a shutdown that hangs at once.
func TestSignals_ThirdEndsTheProcess(t *testing.T) {
	t.Parallel()
	if signal.Ignored(syscall.SIGHUP) {
		t.Skip("SIGHUP is ignored (nohup): so it is in the helper")
	}
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGHUP} {
		t.Run(sig.String(), func(t *testing.T) {
			t.Parallel()
			cmd, lines, exited := signalHelper(t, `exec "$0" "$@"`)
			if l := nextLine(t, lines, exited); l != "signals: [interrupt terminated hangup]" {
				t.Fatalf("helper: %q; want SIGINT, SIGTERM and SIGHUP as shutdown signals", l)
			}
			for _, want := range []string{"ready", "first", "second"} {
				if l := nextLine(t, lines, exited); l != want {
					t.Fatalf("helper: %q; want %q", l, want)
				}
				if err := cmd.Process.Signal(sig); err != nil {
					t.Fatal(err)
				}
			}
			select {
			case <-exited:
			case <-time.After(waitTimeout):
				t.Fatalf("the helper still runs %v after a third %v", waitTimeout, sig)
			}
			if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != sig {
				t.Errorf("the helper ended with %v; want killed by %v", cmd.ProcessState, sig)
			}
		})
	}
}

// TestShutdownSignals_Nohup: started with SIGHUP ignored (nohup), a
// process leaves it ignored: a closed terminal does not stop serve.
func TestShutdownSignals_Nohup(t *testing.T) {
	t.Parallel()
	cmd, lines, exited := signalHelper(t, `trap "" HUP; exec "$0" "$@"`)
	if l := nextLine(t, lines, exited); l != "signals: [interrupt terminated]" {
		t.Fatalf("helper started ignoring SIGHUP: %q; want SIGINT and SIGTERM only", l)
	}
	if l := nextLine(t, lines, exited); l != "ready" {
		t.Fatalf("helper: %q; want ready", l)
	}
	// Ignored, SIGHUP is dropped when sent: the SIGTERM after it is the
	// first signal the process gets.
	for _, sig := range []syscall.Signal{syscall.SIGHUP, syscall.SIGTERM} {
		if err := cmd.Process.Signal(sig); err != nil {
			t.Fatal(err)
		}
	}
	if l := nextLine(t, lines, exited); l != "first" {
		t.Fatalf("helper: %q; want first", l)
	}
}

// TestShutdownSignals_Shared: shutdownSignals' slice is shared (computed
// once), so appending to it, as runLocked does to add SIGQUIT, must copy
// it: two appends made by concurrent runLocked calls wrote into the same
// spare capacity (a data race go test -race reported from TestLock's
// parallel subtests), and one could change what the other registered.
func TestShutdownSignals_Shared(t *testing.T) {
	a := append(shutdownSignals(), syscall.SIGQUIT)
	b := append(shutdownSignals(), syscall.SIGUSR1)
	if got := a[len(a)-1]; got != syscall.SIGQUIT {
		t.Errorf("append(shutdownSignals(), SIGQUIT) ends with %v after another append; want SIGQUIT (shared backing array)", got)
	}
	if got := b[len(b)-1]; got != syscall.SIGUSR1 {
		t.Errorf("append(shutdownSignals(), SIGUSR1) ends with %v; want SIGUSR1", got)
	}
}
