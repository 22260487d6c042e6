package api_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redfence/redfence/internal/apikey"

	"github.com/redfence/redfence"
	"github.com/redfence/redfence/api"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/internal/openapitest"
	"github.com/redfence/redfence/internal/testutil"
	"github.com/redfence/redfence/service"
	"github.com/redfence/redfence/store"
)

// keys are the API keys of an authenticated env, by role.
type keys struct {
	a, b       string // tenants a and b, every scope
	aLocks     string // tenant a, locks only
	aResources string // tenant a, resources only
	revoked    string // tenant a, every scope, revoked
	unknown    string // well formed, never created
	wrong      string // a's id with another secret
}

// newAuthEnv is newEnv with access control: its server requires API keys
// (KeyAuth over the env's database, watching it for changes). opts may set
// rate limits.
func newAuthEnv(t *testing.T, o envOptions, opts api.Options) (*env, keys) {
	t.Helper()
	e := newEnv(t, o)
	ctx := t.Context()
	auth := api.NewKeyAuth(e.db, o.auth)
	// The notifications of the key changes made below reach auth some time
	// after they commit, and each one makes auth drop the key's cached
	// entry, and not cache what a lookup running meanwhile reads: a test
	// that relies on what auth cached (Postgres down) must not have that
	// happen behind its back. So the set-up waits for all of them.
	notified := make(chan struct{}, 64)
	w, err := e.db.WatchKeys(ctx, func(c apikey.Change) {
		auth.Changed(c)
		if c.ID != "" {
			select {
			case notified <- struct{}{}:
			default: // later changes, made by the tests, are not counted
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.Close)
	opts.Auth, opts.OpenAPI, opts.Logger = auth, redfence.OpenAPI, slog.New(slog.DiscardHandler)
	e.srv = httptest.NewServer(api.NewHandler(e.locker, e.db, opts))
	t.Cleanup(e.srv.Close)

	create := func(tenant string, scopes ...string) string {
		key, _, err := e.db.CreateKey(ctx, tenant, scopes)
		if err != nil {
			t.Fatal(err)
		}
		return key
	}
	var k keys
	k.a = create("a", apikey.AllScopes()...)
	k.b = create("b", apikey.AllScopes()...)
	k.aLocks = create("a", apikey.ScopeLocks)
	k.aResources = create("a", apikey.ScopeResources)
	k.revoked = create("a", apikey.AllScopes()...)
	id, _ := apikey.ParseID(k.revoked)
	if _, err := e.db.RevokeKey(ctx, id); err != nil {
		t.Fatal(err)
	}
	const changes = 6 // 5 keys made, 1 revoked
	for i := range changes {
		select {
		case <-notified:
		case <-time.After(30 * time.Second):
			t.Fatalf("%d of the %d key change notifications came in 30s", i, changes)
		}
	}
	k.unknown = apikey.Prefix + "0123456789abcdef_" + strings.Repeat("x", 43)
	k.wrong = k.a[:len(k.a)-43] + strings.Repeat("y", 43)
	return e, k
}

func bearerHdr(key string) []string {
	if key == "" {
		return nil
	}
	if strings.Contains(key, " ") { // a whole Authorization value: "Basic ..."
		return []string{"Authorization", key}
	}
	return []string{"Authorization", "Bearer " + key}
}

// authSnapshot is snapshot plus the API keys table.
func (e *env) authSnapshot() string {
	e.t.Helper()
	var s string
	if err := e.pg.QueryRow(context.Background(),
		`SELECT coalesce(string_agg(format('%s %s %s %s', id, tenant, scopes, revoked_at), E'\n' ORDER BY id), '') FROM redfence_api_keys`).Scan(&s); err != nil {
		e.t.Fatal(err)
	}
	return e.snapshot() + s
}

// normalized is a response body with the name and request id taken out, to
// compare answers about different names.
func normalized(t *testing.T, r *response, name string) string {
	t.Helper()
	if len(r.body) == 0 {
		return ""
	}
	var m map[string]any
	r.decode(t, &m)
	delete(m, "request_id")
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return strings.ReplaceAll(string(b), name, "NAME")
}

// TestAuth_Matrix sends every route with no key, a malformed, unknown,
// revoked or wrong key, another tenant's key, a key without the route's
// scope and the right key, and checks each answer exactly and that no
// refusal changed anything in Redis or Postgres.
func TestAuth_Matrix(t *testing.T) {
	t.Parallel()
	e, k := newAuthEnv(t, envOptions{nodes: 3}, api.Options{})

	// Tenant a holds "orders" with fencing token 2 and wrote its document.
	acq := func(key, name string) *api.LockResponse {
		r := e.do(e.client, http.MethodPost, "/v1/locks/"+name, map[string]any{"ttl_ms": 60000}, bearerHdr(key)...)
		if r.status != http.StatusCreated {
			t.Fatalf("acquire %s = %d %s", name, r.status, r.body)
		}
		var g api.LockResponse
		r.decode(t, &g)
		return &g
	}
	g := acq(k.a, "orders")
	if r := e.do(e.client, http.MethodDelete, "/v1/locks/orders", nil, append(bearerHdr(k.a), api.LockTokenHeader, g.LockToken)...); r.status != 204 {
		t.Fatalf("release = %d %s", r.status, r.body)
	}
	g = acq(k.a, "orders")
	if g.FencingToken != 2 {
		t.Fatalf("second grant of orders: fencing token %d; want 2", g.FencingToken)
	}
	put := map[string]any{"fencing_token": g.FencingToken, "data": map[string]any{"total": 42}}
	if r := e.do(e.client, http.MethodPut, "/v1/resources/orders", put, bearerHdr(k.a)...); r.status != 200 {
		t.Fatalf("seed PUT = %d %s", r.status, r.body)
	}

	type route struct {
		name, method, path string
		body               any
		lockToken          bool
		scopeless          string // a key of tenant a without the route's scope
		okPath             string // the path of the request that must succeed
		ok                 int
		other              int    // tenant b's status for a's name ("" path: n/a)
		otherSlug          string // and its problem type, if any
	}
	routes := []route{
		{"GetLock", "GET", "/v1/locks/orders", nil, false, k.aResources, "", 200, 200, ""},
		{"Extend", "POST", "/v1/locks/orders/extend", map[string]any{"ttl_ms": 60000}, true, k.aResources, "", 200, 409, "lock-lost"},
		{"PutResource", "PUT", "/v1/resources/orders", put, false, k.aLocks, "", 200, 409, "stale-token"},
		{"GetResource", "GET", "/v1/resources/orders", nil, false, k.aLocks, "", 200, 404, "resource-not-found"},
		{"Nodes", "GET", "/v1/nodes", nil, false, k.aLocks, "", 200, 0, ""},
		{"Metrics", "GET", "/metrics", nil, false, k.aResources, "", 200, 0, ""},
		{"Release", "DELETE", "/v1/locks/orders", nil, true, k.aResources, "", 204, 409, "not-holder"},
		// Last: tenant b's acquire of orders gives b a lock of its own.
		{"Acquire", "POST", "/v1/locks/orders", map[string]any{"ttl_ms": 30000}, false, k.aResources, "/v1/locks/fresh", 201, 201, ""},
	}
	var unauthorizedDetail string
	for _, rt := range routes {
		t.Run(rt.name, func(t *testing.T) {
			send := func(path, key string) *response {
				hdr := bearerHdr(key)
				if rt.lockToken {
					hdr = append(hdr, api.LockTokenHeader, g.LockToken)
				}
				return e.do(e.client, rt.method, path, rt.body, hdr...)
			}
			refused := func(who, key string, status int, slug, challenge string) {
				t.Helper()
				before := e.authSnapshot()
				r := send(rt.path, key)
				if after := e.authSnapshot(); after != before {
					t.Errorf("%s: the refusal changed the stored state:\nbefore:\n%s\nafter:\n%s", who, before, after)
				}
				if r.status != status {
					t.Fatalf("%s: status %d (%s); want %d", who, r.status, r.body, status)
				}
				p := r.problem(t)
				if p.Type != api.ProblemTypePrefix+slug {
					t.Errorf("%s: problem %s; want %s", who, p.Type, slug)
				}
				if got := r.header.Get("WWW-Authenticate"); got != challenge {
					t.Errorf("%s: WWW-Authenticate %q; want %q", who, got, challenge)
				}
				if slug == "unauthorized" {
					if unauthorizedDetail == "" {
						unauthorizedDetail = p.Detail
					} else if p.Detail != unauthorizedDetail {
						t.Errorf("%s: detail %q differs from another 401's %q: the answers must not tell keys apart", who, p.Detail, unauthorizedDetail)
					}
				}
			}
			const realm = `Bearer realm="redfence"`
			invalid := realm + `, error="invalid_token"`
			refused("NoKey", "", 401, "unauthorized", realm)
			// RFC 6750 §3.1: no error code for a request without Bearer credentials.
			refused("BasicScheme", "Basic YWxpY2U6c2VjcmV0", 401, "unauthorized", realm)
			refused("Malformed", "not-a-key", 401, "unauthorized", invalid)
			refused("Unknown", k.unknown, 401, "unauthorized", invalid)
			refused("Revoked", k.revoked, 401, "unauthorized", invalid)
			refused("WrongSecret", k.wrong, 401, "unauthorized", invalid)
			scope := map[string]string{"/v1/locks": "locks", "/v1/resources": "resources", "/v1/nodes": "admin", "/metrics": "admin"}
			for prefix, s := range scope {
				if strings.HasPrefix(rt.path, prefix) {
					refused("MissingScope", rt.scopeless, 403, "forbidden", fmt.Sprintf(`%s, error="insufficient_scope", scope=%q`, realm, s))
				}
			}

			if rt.other != 0 {
				// Tenant b sees a's "orders" exactly as a name nobody used.
				before := e.authSnapshot()
				r := send(rt.path, k.b)
				after := e.authSnapshot()
				if r.status != rt.other {
					t.Fatalf("OtherTenant: status %d (%s); want %d", r.status, r.body, rt.other)
				}
				if rt.otherSlug != "" {
					if p := r.problem(t); p.Type != api.ProblemTypePrefix+rt.otherSlug {
						t.Errorf("OtherTenant: problem %s; want %s", p.Type, rt.otherSlug)
					}
				}
				if rt.method == "POST" && rt.name == "Acquire" {
					// b got a lock of its own, with its own counter.
					var bg api.LockResponse
					r.decode(t, &bg)
					if bg.FencingToken != 1 {
						t.Errorf("OtherTenant: b's grant of orders has fencing token %d; want 1 (counters are per tenant)", bg.FencingToken)
					}
					var kept []string
					for line := range strings.Lines(after) {
						if !strings.Contains(line, "b/orders") {
							kept = append(kept, line)
						}
					}
					if strings.Join(kept, "") != before {
						t.Errorf("OtherTenant: acquiring changed more than b/orders:\nbefore:\n%s\nafter:\n%s", before, after)
					}
				} else {
					if after != before {
						t.Errorf("OtherTenant: the request changed the stored state:\nbefore:\n%s\nafter:\n%s", before, after)
					}
					absent := send(strings.Replace(rt.path, "orders", "never-used", 1), k.b)
					if absent.status != r.status || normalized(t, absent, "never-used") != normalized(t, r, "orders") {
						t.Errorf("OtherTenant: a's orders answers %d %s; a name nobody used answers %d %s: they must be the same",
							r.status, r.body, absent.status, absent.body)
					}
				}
			}

			path := rt.path
			if rt.okPath != "" {
				path = rt.okPath
			}
			if r := send(path, k.a); r.status != rt.ok {
				t.Fatalf("RightKey: status %d (%s); want %d", r.status, r.body, rt.ok)
			}
			if rt.method == http.MethodDelete {
				// A release may answer before every node's delete has
				// landed (it does not wait for stragglers); a late one
				// must not be taken for a change made by the next
				// route's refusals (the fresh-clone CI saw node 0's).
				testutil.WaitFor(t, 30*time.Second, "every node to drop the released lock", func() (bool, error) {
					return !strings.Contains(e.snapshot(), "redfence:lock:a/orders="), nil
				})
			}
		})
	}
}

func TestAuth_RateLimit(t *testing.T) {
	t.Parallel()
	// One request per 1000 s on average, bursts of 3: nothing refills
	// during the test.
	e, k := newAuthEnv(t, envOptions{nodes: 1}, api.Options{RateLimit: 0.001, RateBurst: 3})
	get := func(key string) *response {
		return e.do(e.client, http.MethodGet, "/v1/locks/x", nil, bearerHdr(key)...)
	}
	for i := range 3 {
		if r := get(k.a); r.status != 200 {
			t.Fatalf("a's request %d = %d %s; want 200 (within the burst)", i+1, r.status, r.body)
		}
	}
	before := e.authSnapshot()
	r := e.do(e.client, http.MethodPost, "/v1/locks/x", nil, bearerHdr(k.a)...)
	if r.status != http.StatusTooManyRequests {
		t.Fatalf("a's 4th request = %d %s; want 429", r.status, r.body)
	}
	if after := e.authSnapshot(); after != before {
		t.Errorf("a rate-limited acquire changed the stored state:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	p := r.problem(t)
	if p.Type != api.ProblemTypePrefix+"rate-limited" || p.RetryAfterMS == nil || *p.RetryAfterMS <= 0 {
		t.Errorf("429 problem = %+v; want rate-limited with a positive retry_after_ms", p)
	}
	if ra, err := strconv.Atoi(r.header.Get("Retry-After")); err != nil || ra < 1 {
		t.Errorf("429 Retry-After = %q; want a number of seconds >= 1", r.header.Get("Retry-After"))
	}
	// Tenant b's key has its own bucket: a's burst does not touch it.
	for i := range 3 {
		if r := get(k.b); r.status != 200 {
			t.Errorf("b's request %d while a is limited = %d %s; want 200", i+1, r.status, r.body)
		}
	}
	if r := get(k.a); r.status != http.StatusTooManyRequests {
		t.Errorf("a's request after b's = %d; want 429 still", r.status)
	}
}

// testKeyStore is a migrated store.DB on a fresh database.
func testKeyStore(t *testing.T) *store.DB {
	t.Helper()
	db, err := store.Open(t.Context(), clustertest.Database(t), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	if _, err := db.Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}
	return db
}

// clock is a settable clock.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

func TestKeyAuth_Cache(t *testing.T) {
	t.Parallel()
	db := testKeyStore(t)
	ctx := t.Context()
	clk := &clock{now: time.Unix(1_000_000, 0)}
	a := api.NewKeyAuth(db, api.KeyAuthOptions{CacheTTL: time.Second, Now: clk.Now})
	newKey := func() (string, string) {
		key, k, err := db.CreateKey(ctx, "acme", apikey.DefaultScopes())
		if err != nil {
			t.Fatal(err)
		}
		return key, k.ID
	}
	wantOK := func(what, key string) {
		t.Helper()
		if p, err := a.Authenticate(ctx, key); err != nil || p.Tenant != "acme" {
			t.Errorf("%s: Authenticate = %+v, %v; want tenant acme", what, p, err)
		}
	}
	wantRefused := func(what, key string) {
		t.Helper()
		if p, err := a.Authenticate(ctx, key); !errors.Is(err, api.ErrUnauthorized) {
			t.Errorf("%s: Authenticate = %+v, %v; want ErrUnauthorized", what, p, err)
		} else if strings.Contains(err.Error(), key[len(key)-43:]) {
			t.Errorf("%s: the error %q contains the key's secret", what, err)
		}
	}

	t.Run("TTL", func(t *testing.T) {
		key, id := newKey()
		wantOK("first use", key)
		if _, err := db.RevokeKey(ctx, id); err != nil {
			t.Fatal(err)
		}
		// Nothing tells a about the revocation: it trusts its copy for the
		// TTL and not a moment longer.
		clk.Add(time.Second - time.Nanosecond)
		wantOK("revoked, within the TTL", key)
		wrong := key[:len(key)-1] + map[bool]string{true: "B", false: "A"}[key[len(key)-1] == 'A']
		wantRefused("a wrong secret for a cached key", wrong)
		clk.Add(time.Nanosecond)
		wantRefused("revoked, TTL over", key)
	})

	t.Run("Changed", func(t *testing.T) {
		key, id := newKey()
		wantOK("first use", key)
		if _, err := db.RevokeKey(ctx, id); err != nil {
			t.Fatal(err)
		}
		a.Changed(apikey.Change{ID: id})
		wantRefused("revoked, notified", key)

		key2, id2 := newKey()
		wantOK("first use", key2)
		if _, err := db.RevokeKey(ctx, id2); err != nil {
			t.Fatal(err)
		}
		a.Changed(apikey.Change{})
		wantRefused("revoked, everything flushed", key2)
	})

	t.Run("Unknown", func(t *testing.T) {
		wantRefused("malformed", "rf_nope_"+strings.Repeat("x", 43))
		wantRefused("unknown id", apikey.Prefix+"fedcba9876543210_"+strings.Repeat("x", 43))
	})
}

// TestKeyAuth_FloodKeepsKeys: made-up key ids, however many, never evict a
// valid key's entry: its next request within the TTL asks Postgres nothing.
func TestKeyAuth_FloodKeepsKeys(t *testing.T) {
	t.Parallel()
	db := testKeyStore(t)
	ctx := t.Context()
	gs := &gatedStore{KeyStore: db}
	clk := &clock{now: time.Unix(1_000_000, 0)}
	a := api.NewKeyAuth(gs, api.KeyAuthOptions{CacheTTL: time.Hour, MaxCached: 4, Now: clk.Now})
	key, _, err := db.CreateKey(ctx, "acme", apikey.DefaultScopes())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Authenticate(ctx, key); err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		made := fmt.Sprintf("%s%016x_%s", apikey.Prefix, i, strings.Repeat("x", 43))
		if _, err := a.Authenticate(ctx, made); !errors.Is(err, api.ErrUnauthorized) {
			t.Fatalf("made-up key %d: %v; want ErrUnauthorized", i, err)
		}
	}
	before := gs.count()
	if _, err := a.Authenticate(ctx, key); err != nil {
		t.Fatal(err)
	}
	if n := gs.count() - before; n != 0 {
		t.Errorf("the valid key was looked up %d more times after a flood of 10 made-up ids (MaxCached 4); want it still cached", n)
	}
}

// gatedStore is a KeyStore over a real one that counts its lookups and,
// while armed, holds each one (after it read the key) until it is let go.
type gatedStore struct {
	api.KeyStore
	mu      sync.Mutex
	lookups int
	entered chan struct{} // nil: not armed
	letGo   chan struct{}
}

// arm makes the next lookup signal entered and wait for letGo to close.
func (g *gatedStore) arm() (entered, letGo chan struct{}) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.entered, g.letGo = make(chan struct{}, 1), make(chan struct{})
	return g.entered, g.letGo
}

func (g *gatedStore) count() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.lookups
}

func (g *gatedStore) Key(ctx context.Context, id string) (*apikey.Key, error) {
	k, err := g.KeyStore.Key(ctx, id)
	g.mu.Lock()
	g.lookups++
	entered, letGo := g.entered, g.letGo
	g.entered = nil
	g.mu.Unlock()
	if entered != nil {
		entered <- struct{}{}
		<-letGo
	}
	return k, err
}

// TestKeyAuth_ChangedDuringLookup: a lookup that read a key before the
// key's change was notified does not cache what it read; one that ran
// while another key changed does.
func TestKeyAuth_ChangedDuringLookup(t *testing.T) {
	t.Parallel()
	db := testKeyStore(t)
	ctx := t.Context()
	gs := &gatedStore{KeyStore: db}
	a := api.NewKeyAuth(gs, api.KeyAuthOptions{CacheTTL: time.Hour})
	newKey := func() (string, string) {
		key, k, err := db.CreateKey(ctx, "acme", apikey.DefaultScopes())
		if err != nil {
			t.Fatal(err)
		}
		return key, k.ID
	}
	// authenticateWhile authenticates key with its lookup held while during
	// runs, and reports whether a second Authenticate then asked the store.
	authenticateWhile := func(key string, during func()) (looked bool) {
		t.Helper()
		entered, letGo := gs.arm()
		done := make(chan error, 1)
		go func() { _, err := a.Authenticate(ctx, key); done <- err }()
		<-entered
		during()
		close(letGo)
		if err := <-done; err != nil {
			t.Fatalf("Authenticate during the change: %v", err)
		}
		before := gs.count()
		_, _ = a.Authenticate(ctx, key)
		return gs.count() > before
	}

	key, _ := newKey()
	_, other := newKey()
	if looked := authenticateWhile(key, func() { a.Changed(apikey.Change{ID: other}) }); looked {
		t.Error("another key's change during the lookup: the key was not cached")
	}

	key, id := newKey()
	if looked := authenticateWhile(key, func() {
		if _, err := db.RevokeKey(ctx, id); err != nil {
			t.Fatal(err)
		}
		a.Changed(apikey.Change{ID: id})
	}); !looked {
		t.Error("the key's own change during the lookup: what the lookup read was cached")
	}
	if _, err := a.Authenticate(ctx, key); !errors.Is(err, api.ErrUnauthorized) {
		t.Errorf("the key revoked during its lookup = %v; want ErrUnauthorized", err)
	}

	key, _ = newKey()
	if looked := authenticateWhile(key, func() { a.Changed(apikey.Change{}) }); !looked {
		t.Error("every key's change during the lookup: what the lookup read was cached")
	}
}

// outage is a KeyStore over a real one that can be made to fail at once, as
// when Postgres refuses connections, or to hang, as when it is stopped, until
// the mode changes (the connection is then reset) or the lookup times out.
type outage struct {
	api.KeyStore
	mu      sync.Mutex
	mode    string        // "", "fail" or "hang"
	unhang  chan struct{} // closed when the mode changes from "hang"
	hanging int           // lookups hanging now
}

func (o *outage) set(mode string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.mode == "hang" {
		close(o.unhang)
	}
	if mode == "hang" {
		o.unhang = make(chan struct{})
	}
	o.mode = mode
}

func (o *outage) nowHanging() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.hanging
}

func (o *outage) Key(ctx context.Context, id string) (*apikey.Key, error) {
	o.mu.Lock()
	mode, unhang := o.mode, o.unhang
	if mode == "hang" {
		o.hanging++
	}
	o.mu.Unlock()
	switch mode {
	case "fail":
		return nil, errors.New("dial tcp 127.0.0.1:5432: connect: connection refused")
	case "hang":
		defer func() {
			o.mu.Lock()
			o.hanging--
			o.mu.Unlock()
		}()
		select {
		case <-unhang:
			return nil, errors.New("read tcp 127.0.0.1:5432: connection reset by peer")
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return o.KeyStore.Key(ctx, id)
}

// TestKeyAuth_Down: while Postgres cannot answer, a key seen valid keeps
// working past the cache TTL (so its client can still release), without a
// request waiting for the lookups that retry in the background; a key not
// seen, or dropped by a notification, is not let through; once Postgres
// answers again, what it says applies.
func TestKeyAuth_Down(t *testing.T) {
	t.Parallel()
	db := testKeyStore(t)
	ctx := t.Context()
	clk := &clock{now: time.Unix(1_000_000, 0)}
	ks := &outage{KeyStore: db}
	// A lookup that hangs would hang the test: a request must not wait for it.
	a := api.NewKeyAuth(ks, api.KeyAuthOptions{CacheTTL: time.Second, LookupTimeout: time.Hour, Now: clk.Now})
	create := func() (string, string) {
		key, k, err := db.CreateKey(ctx, "acme", apikey.DefaultScopes())
		if err != nil {
			t.Fatal(err)
		}
		return key, k.ID
	}
	key, id := create()
	dropped, droppedID := create()
	unseen, _ := create()
	revoked, revokedID := create()
	if _, err := db.RevokeKey(ctx, revokedID); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{key, dropped} {
		if _, err := a.Authenticate(ctx, k); err != nil {
			t.Fatalf("before the outage: %v", err)
		}
	}
	if _, err := a.Authenticate(ctx, revoked); !errors.Is(err, api.ErrUnauthorized) {
		t.Fatalf("revoked key before the outage: %v; want ErrUnauthorized", err)
	}

	ks.set("fail")
	clk.Add(2 * time.Second)
	if p, err := a.Authenticate(ctx, key); err != nil || p.Tenant != "acme" {
		t.Errorf("key seen valid, Postgres down: %+v, %v; want it accepted", p, err)
	}
	if _, err := a.Authenticate(ctx, revoked); !errors.Is(err, api.ErrUnauthorized) {
		t.Errorf("revoked key, Postgres down: %v; want ErrUnauthorized", err)
	}
	for what, k := range map[string]string{"a key never looked up": unseen, "an unknown id": apikey.Prefix + "fedcba9876543210_" + strings.Repeat("x", 43)} {
		if p, err := a.Authenticate(ctx, k); err == nil || errors.Is(err, api.ErrUnauthorized) {
			t.Errorf("%s, Postgres down: %+v, %v; want an error other than ErrUnauthorized (503)", what, p, err)
		}
	}
	a.Changed(apikey.Change{ID: droppedID})
	if p, err := a.Authenticate(ctx, dropped); err == nil {
		t.Errorf("key dropped by a notification, Postgres down: %+v; want an error", p)
	}
	// Notifications lost (everything to be looked up again): the keys seen
	// valid still work while Postgres cannot answer.
	a.Changed(apikey.Change{})
	if p, err := a.Authenticate(ctx, key); err != nil || p.Tenant != "acme" {
		t.Errorf("key seen valid, notifications lost, Postgres down: %+v, %v; want it accepted", p, err)
	}

	// Postgres stopped: lookups hang (for an hour here). Requests with the
	// key still answer at once, with one lookup at a time behind them.
	ks.set("hang")
	clk.Add(2 * time.Second)
	// (A bound, not a timing assertion: without it a regression would hang
	// the test for an hour.)
	hctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for range 3 {
		if _, err := a.Authenticate(hctx, key); err != nil {
			t.Fatalf("key seen valid, lookups hanging: %v", err)
		}
	}
	testutil.WaitFor(t, 30*time.Second, "the background lookup to start", func() (bool, error) {
		return ks.nowHanging() > 0, nil
	})
	for range 3 {
		if _, err := a.Authenticate(hctx, key); err != nil {
			t.Fatalf("key seen valid, lookups hanging: %v", err)
		}
	}
	if n := ks.nowHanging(); n != 1 {
		t.Errorf("%d lookups of one key hang at once; want 1", n)
	}

	// Postgres back; the key was revoked meanwhile, and a was not told.
	// The lookups behind the requests find it out.
	if _, err := db.RevokeKey(ctx, id); err != nil {
		t.Fatal(err)
	}
	ks.set("")
	testutil.WaitFor(t, 30*time.Second, "the revocation to apply once Postgres answers", func() (bool, error) {
		_, err := a.Authenticate(ctx, key)
		return errors.Is(err, api.ErrUnauthorized), nil
	})
	if p, err := a.Authenticate(ctx, unseen); err != nil || p.Tenant != "acme" {
		t.Errorf("a key never looked up, Postgres back: %+v, %v; want it accepted", p, err)
	}

	// Down again, then back with the key revoked meanwhile: the flush the
	// key listener sends when it reconnects makes the next request wait
	// for Postgres' answer instead of being served the old entry.
	ks.set("fail")
	clk.Add(2 * time.Second)
	if _, err := a.Authenticate(ctx, unseen); err != nil {
		t.Fatalf("key seen valid, Postgres down again: %v", err)
	}
	ks.set("")
	id2, _ := apikey.ParseID(unseen)
	if _, err := db.RevokeKey(ctx, id2); err != nil {
		t.Fatal(err)
	}
	a.Changed(apikey.Change{})
	if _, err := a.Authenticate(ctx, unseen); !errors.Is(err, api.ErrUnauthorized) {
		t.Errorf("key revoked while Postgres was down, after the reconnect flush: %v; want ErrUnauthorized", err)
	}
}

// TestAuth_PostgresDown: with Postgres stopped, a client whose key this
// server has seen can still release its lock (release needs only Redis); a
// key it has not seen gets 503 auth-unavailable, and an acquire 503
// fencing-unavailable.
func TestAuth_PostgresDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg, url := ownPostgres(t)
	// Every request asks Postgres: the key's cached entry has always
	// expired by the time Postgres is stopped.
	e, k := newAuthEnv(t, envOptions{databaseURL: url, auth: api.KeyAuthOptions{CacheTTL: time.Nanosecond}}, api.Options{})
	r := e.do(e.client, http.MethodPost, "/v1/locks/held", map[string]any{"ttl_ms": 60000}, bearerHdr(k.a)...)
	if r.status != 201 {
		t.Fatalf("acquire = %d %s", r.status, r.body)
	}
	var g api.LockResponse
	r.decode(t, &g)
	if err := pg.Stop(ctx, true); err != nil {
		t.Fatal(err)
	}
	r = e.do(e.client, http.MethodPost, "/v1/locks/other", nil, bearerHdr(k.a)...)
	if p := r.problem(t); r.status != 503 || p.Type != api.ProblemTypePrefix+"fencing-unavailable" {
		t.Errorf("acquire with Postgres down = %d %s; want 503 fencing-unavailable", r.status, r.body)
	}
	r = e.do(e.client, http.MethodDelete, "/v1/locks/held", nil, append(bearerHdr(k.a), api.LockTokenHeader, g.LockToken)...)
	if r.status != 204 {
		t.Errorf("release with Postgres down = %d %s; want 204", r.status, r.body)
	}
	e.waitReleased("every node to drop the released lock", nil)
	r = e.do(e.client, http.MethodGet, "/v1/locks/held", nil, bearerHdr(k.b)...)
	if p := r.problem(t); r.status != 503 || p.Type != api.ProblemTypePrefix+"auth-unavailable" || r.header.Get("Retry-After") == "" {
		t.Errorf("a key not seen before, Postgres down = %d %s; want 503 auth-unavailable with Retry-After", r.status, r.body)
	}
}

// TestAuth_Unavailable: when Postgres cannot answer, keys are refused with
// 503 auth-unavailable, never let through.
func TestAuth_Unavailable(t *testing.T) {
	t.Parallel()
	db := testKeyStore(t)
	key, _, err := db.CreateKey(t.Context(), "acme", apikey.AllScopes())
	if err != nil {
		t.Fatal(err)
	}
	db.Close()
	h := api.NewHandler(nil, nil, api.Options{OpenAPI: redfence.OpenAPI, Auth: api.NewKeyAuth(db, api.KeyAuthOptions{})})
	srv := httptest.NewServer(h)
	defer srv.Close()
	c := openapitest.New(t, redfence.OpenAPI).Client(t)
	for _, path := range []string{"/v1/nodes", "/metrics"} {
		req, _ := http.NewRequest(http.MethodGet, srv.URL+path, nil)
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" {
			t.Errorf("GET %s with Postgres closed = %d (Retry-After %q); want 503 with Retry-After", path, resp.StatusCode, resp.Header.Get("Retry-After"))
		}
	}
}

// TestAuth_Header checks how the Authorization header is read, on /metrics
// (which needs no Locker or Store).
func TestAuth_Header(t *testing.T) {
	t.Parallel()
	db := testKeyStore(t)
	admin, _, err := db.CreateKey(t.Context(), "ops", []string{apikey.ScopeAdmin})
	if err != nil {
		t.Fatal(err)
	}
	h := api.NewHandler(nil, nil, api.Options{OpenAPI: redfence.OpenAPI, Auth: api.NewKeyAuth(db, api.KeyAuthOptions{})})
	srv := httptest.NewServer(h)
	defer srv.Close()
	c := openapitest.New(t, redfence.OpenAPI).Client(t)
	for _, tc := range []struct {
		name   string
		values []string
		want   int
	}{
		{"Bearer", []string{"Bearer " + admin}, 200},
		{"LowerCaseScheme", []string{"bearer " + admin}, 200},
		{"ExtraSpaces", []string{"Bearer   " + admin + " "}, 200},
		{"Basic", []string{"Basic " + admin}, 401},
		{"NoCredentials", []string{"Bearer"}, 401},
		{"EmptyCredentials", []string{"Bearer "}, 401},
		{"TwoHeaders", []string{"Bearer " + admin, "Bearer " + admin}, 401},
		{"KeyOnly", []string{admin}, 401},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, _ := http.NewRequest(http.MethodGet, srv.URL+"/metrics", nil)
			for _, v := range tc.values {
				req.Header.Add("Authorization", v)
			}
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != tc.want {
				t.Errorf("GET /metrics with Authorization %q = %d; want %d", tc.values, resp.StatusCode, tc.want)
			}
		})
	}
	// The open endpoints stay open.
	for _, path := range []string{"/healthz", "/openapi.yaml"} {
		resp, err := c.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Errorf("GET %s without a key = %d; want 200", path, resp.StatusCode)
		}
	}
}

// waitObserver signals when a blocking acquire pauses (it may pause many
// times; the signal is dropped when nobody takes it).
type waitObserver struct{ waiting chan struct{} }

func (o waitObserver) NodeOp(string, string, service.Outcome, time.Duration) {}
func (o waitObserver) Quarantine(string, time.Time)                          {}
func (o waitObserver) Waiting(delta int) {
	if delta > 0 {
		select {
		case o.waiting <- struct{}{}:
		default:
		}
	}
}

// TestAuth_RevokedWhileWaiting: a key revoked while its acquire waits gets
// 401 (at its next retry, at the latest when the lock comes free) and never
// the lock.
func TestAuth_RevokedWhileWaiting(t *testing.T) {
	t.Parallel()
	obs := waitObserver{waiting: make(chan struct{}, 1)}
	e, k := newAuthEnv(t, envOptions{service: service.Options{Observer: obs}}, api.Options{})
	ctx := t.Context()
	r := e.do(e.client, http.MethodPost, "/v1/locks/w", map[string]any{"ttl_ms": 60000}, bearerHdr(k.a)...)
	var g api.LockResponse
	r.decode(t, &g)
	if r.status != http.StatusCreated {
		t.Fatalf("holder: %d %s", r.status, r.body)
	}
	waiterKey, _, err := e.db.CreateKey(ctx, "a", []string{apikey.ScopeLocks})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan *response, 1)
	go func() {
		done <- e.do(e.client, http.MethodPost, "/v1/locks/w", map[string]any{"ttl_ms": 10000, "wait_ms": 30000},
			bearerHdr(waiterKey)...)
	}()
	<-obs.waiting // authenticated, and waiting for the holder
	id, _ := apikey.ParseID(waiterKey)
	if _, err := e.db.RevokeKey(ctx, id); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "the revocation to reach the server", func() (bool, error) {
		return e.do(e.client, http.MethodGet, "/v1/locks/w", nil, bearerHdr(waiterKey)...).status == http.StatusUnauthorized, nil
	})
	if r := e.do(e.client, http.MethodDelete, "/v1/locks/w", nil, append(bearerHdr(k.a), api.LockTokenHeader, g.LockToken)...); r.status != http.StatusNoContent {
		t.Fatalf("holder's release = %d %s", r.status, r.body)
	}
	w := <-done
	if p := w.problem(t); w.status != http.StatusUnauthorized || p.Type != api.ProblemTypePrefix+"unauthorized" {
		t.Fatalf("waiter with a revoked key = %d %s; want 401 unauthorized", w.status, w.body)
	}
	var st api.LockStatus
	r = e.do(e.client, http.MethodGet, "/v1/locks/w", nil, bearerHdr(k.a)...)
	r.decode(t, &st)
	if st.Held {
		t.Errorf("the lock is held after the revoked waiter was refused: %s", r.body)
	}
}
