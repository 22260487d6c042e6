package api_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/redfence/redfence"
	"github.com/redfence/redfence/api"
	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/internal/keyspace"
	"github.com/redfence/redfence/internal/openapitest"
	"github.com/redfence/redfence/internal/testutil"
	"github.com/redfence/redfence/service"
	"github.com/redfence/redfence/store"
)

// env is a Redfence API on real redis-server nodes and a real Postgres,
// behind an httptest server, with a client that validates every request and
// response against openapi.yaml.
type env struct {
	t      *testing.T
	nodes  []*cluster.Redis
	rdb    []*redis.Client
	db     *store.DB
	pg     *pgxpool.Pool // direct access for inspection
	locker *service.Locker
	srv    *httptest.Server
	// client validates requests and responses; loose validates responses only.
	client, loose *http.Client
}

type envOptions struct {
	nodes int
	// databaseURL defaults to a fresh database on the shared Postgres.
	databaseURL string
	service     service.Options
	// auth tunes the KeyAuth of newAuthEnv.
	auth api.KeyAuthOptions
	// registry records the nodes' epochs in the env's store, as a server
	// does, so that a node that loses its memory is found out.
	registry bool
	// writeTimeout is the test server's http.Server.WriteTimeout, and the
	// handler's (0: none).
	writeTimeout time.Duration
	// h2c has the test server speak HTTP/2 cleartext too.
	h2c bool
}

func newEnv(t *testing.T, o envOptions) *env {
	t.Helper()
	if o.nodes == 0 {
		o.nodes = 5
	}
	if o.databaseURL == "" {
		o.databaseURL = clustertest.Database(t)
	}
	// Generous per-node timeout: tests run in parallel under -race on 2 cores,
	// and a slow answer must not turn into a spurious 503.
	if o.service.NodeTimeout == 0 {
		o.service.NodeTimeout = time.Second
	}
	ctx := context.Background()
	e := &env{t: t, nodes: clustertest.Redis(t, o.nodes, cluster.RedisOptions{})}
	db, err := store.Open(ctx, o.databaseURL, store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	if _, err := db.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	e.db = db
	e.pg, err = pgxpool.New(ctx, o.databaseURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.pg.Close)
	var ns []service.Node
	for _, r := range e.nodes {
		n := service.NewRedisNode(r.Addr(), service.RedisOptions{})
		t.Cleanup(func() { n.Close() })
		ns = append(ns, n)
		c := redis.NewClient(&redis.Options{Addr: r.Addr(), MaxRetries: -1})
		t.Cleanup(func() { c.Close() })
		e.rdb = append(e.rdb, c)
	}
	if o.registry {
		o.service.Registry = db
	}
	e.locker, err = service.New(ns, db, o.service)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.locker.Close)
	if o.registry {
		if err := e.locker.Init(ctx); err != nil {
			t.Fatal(err)
		}
	}
	h := api.NewHandler(e.locker, db, api.Options{OpenAPI: redfence.OpenAPI, Logger: slog.New(slog.DiscardHandler), WriteTimeout: o.writeTimeout})
	e.srv = httptest.NewUnstartedServer(h)
	e.srv.Config.WriteTimeout = o.writeTimeout
	if o.h2c {
		var p http.Protocols
		p.SetHTTP1(true)
		p.SetUnencryptedHTTP2(true)
		e.srv.Config.Protocols = &p
	}
	e.srv.Start()
	t.Cleanup(e.srv.Close)
	v := openapitest.New(t, redfence.OpenAPI)
	e.client = v.Client(t)
	e.loose = v.Client(t, openapitest.SkipRequests())
	return e
}

// response is a finished HTTP exchange.
type response struct {
	status int
	header http.Header
	body   []byte
}

func (r *response) decode(t *testing.T, v any) {
	t.Helper()
	if err := json.Unmarshal(r.body, v); err != nil {
		t.Fatalf("decode %s: %v", r.body, err)
	}
}

func (r *response) problem(t *testing.T) *api.Problem {
	t.Helper()
	if ct := r.header.Get("Content-Type"); ct != "application/problem+json" {
		t.Fatalf("Content-Type = %q; want application/problem+json (status %d, body %s)", ct, r.status, r.body)
	}
	var p api.Problem
	r.decode(t, &p)
	return &p
}

// do sends a request; body is JSON-encoded unless it is a string (sent as is)
// or nil. hdr are header name/value pairs.
func (e *env) do(c *http.Client, method, path string, body any, hdr ...string) *response {
	e.t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		rd = strings.NewReader(b)
	default:
		buf, err := json.Marshal(b)
		if err != nil {
			e.t.Fatal(err)
		}
		rd = bytes.NewReader(buf)
	}
	req, err := http.NewRequest(method, e.srv.URL+path, rd)
	if err != nil {
		e.t.Fatal(err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		if hdr[i+1] == "" {
			req.Header.Del(hdr[i])
			continue
		}
		req.Header.Add(hdr[i], hdr[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		e.t.Fatalf("%s %s: %v", method, path, err)
	}
	return readResponse(e.t, resp)
}

// readResponse reads and closes resp's body: the finished exchange.
func readResponse(t testing.TB, resp *http.Response) *response {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return &response{status: resp.StatusCode, header: resp.Header, body: b}
}

func (e *env) acquire(name string, body map[string]any) (*api.LockResponse, *response) {
	e.t.Helper()
	var in any
	if body != nil {
		in = body
	}
	r := e.do(e.client, http.MethodPost, "/v1/locks/"+name, in)
	if r.status != http.StatusCreated {
		return nil, r
	}
	var g api.LockResponse
	r.decode(e.t, &g)
	return &g, r
}

func (e *env) mustAcquire(name string, body map[string]any) *api.LockResponse {
	e.t.Helper()
	g, r := e.acquire(name, body)
	if g == nil {
		e.t.Fatalf("acquire %s = %d %s; want 201", name, r.status, r.body)
	}
	return g
}

// mustAcquireShort is mustAcquire for a lease short enough that, on a
// loaded machine, it can run out before its grant is made: that attempt is
// refused with 503 lease-expired and grants nothing, and it tries again,
// as a client would, waiting for the keys of the refused try to go.
func (e *env) mustAcquireShort(name string, body map[string]any) *api.LockResponse {
	e.t.Helper()
	for try := 1; ; try++ {
		g, r := e.acquire(name, body)
		if g != nil {
			return g
		}
		if p := r.problem(e.t); r.status != http.StatusServiceUnavailable || p.Type != api.ProblemTypePrefix+"lease-expired" || try == 20 {
			e.t.Fatalf("acquire %s, try %d = %d %s; want 201 (or 503 lease-expired, tried again)", name, try, r.status, r.body)
		}
		body = maps.Clone(body)
		body["wait_ms"] = 10000
	}
}

func (e *env) put(name string, token int64, data any) *response {
	e.t.Helper()
	return e.do(e.client, http.MethodPut, "/v1/resources/"+name, map[string]any{"fencing_token": token, "data": data})
}

func (e *env) release(name, lockToken string) *response {
	e.t.Helper()
	return e.do(e.client, http.MethodDelete, "/v1/locks/"+name, nil, api.LockTokenHeader, lockToken)
}

// lockKeys returns, per running node, the lock keys it holds.
func (e *env) lockKeys() [][]string {
	e.t.Helper()
	out := make([][]string, len(e.rdb))
	for i, c := range e.rdb {
		if !e.nodes[i].Running() {
			continue
		}
		keys, err := c.Keys(context.Background(), "redfence:lock:*").Result()
		if err != nil {
			e.t.Fatalf("node %d: %v", i, err)
		}
		slices.Sort(keys)
		out[i] = keys
	}
	return out
}

// waitReleased waits until no running node holds a lock key that keep
// does not keep (nil: any key): a release answers once a majority deleted
// the key, and the other nodes' deletions finish in the background.
func (e *env) waitReleased(what string, keep func(key string) bool) {
	e.t.Helper()
	testutil.WaitFor(e.t, 30*time.Second, what, func() (bool, error) {
		for _, keys := range e.lockKeys() {
			for _, k := range keys {
				if keep == nil || !keep(k) {
					return false, nil
				}
			}
		}
		return true, nil
	})
}

// snapshot renders everything Redfence stores (keys with values on every
// node, and every row in Postgres) so tests can show a request changed nothing.
func (e *env) snapshot() string {
	e.t.Helper()
	ctx := context.Background()
	var b strings.Builder
	for i, c := range e.rdb {
		if !e.nodes[i].Running() {
			continue
		}
		keys, err := c.Keys(ctx, "*").Result()
		if err != nil {
			e.t.Fatalf("node %d: %v", i, err)
		}
		slices.Sort(keys)
		for _, k := range keys {
			if strings.HasPrefix(k, keyspace.ProbePrefix) {
				// A write probe's key (readyz, /v1/nodes, the health
				// checker) lives 1 ms: not state a request leaves.
				continue
			}
			v, _ := c.Get(ctx, k).Result()
			fmt.Fprintf(&b, "node%d %s=%s\n", i, k, v)
		}
	}
	for _, q := range []string{
		`SELECT coalesce(string_agg(format('%s %s %s %s', key, token, owner, holder), E'\n' ORDER BY key), '') FROM redfence_fencing`,
		`SELECT coalesce(string_agg(format('%s %s %s %s', key, data, fencing_token, version), E'\n' ORDER BY key), '') FROM redfence_resources`,
	} {
		var s string
		if err := e.pg.QueryRow(ctx, q).Scan(&s); err != nil {
			e.t.Fatal(err)
		}
		b.WriteString(s + "\n")
	}
	return b.String()
}

// ownPostgres starts a Postgres of the test's own, which it may stop, and
// returns it with the URL of a database on it.
func ownPostgres(t *testing.T) (*cluster.Postgres, string) {
	t.Helper()
	pg := clustertest.Postgres(t)
	url, err := pg.CreateDatabase(context.Background(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	return pg, url
}
