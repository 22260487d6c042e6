package api_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/redfence/redfence/api"
	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/refstore"
	"github.com/redfence/redfence/internal/testutil"
	"github.com/redfence/redfence/service"
)

func TestAPI_RoundTrip(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	g := e.mustAcquire("orders", map[string]any{"ttl_ms": 30000, "owner": "alice"})
	if g.FencingToken != 1 || g.Owner != "alice" || g.TTLMS != 30000 || len(g.LockToken) != 27 {
		t.Fatalf("acquire = %+v; want token 1, owner alice, ttl 30000, a 27-char lock token", g)
	}
	if g.ValidityMS <= 0 || g.ValidityMS > 30000 {
		t.Errorf("validity_ms = %d; want in (0, 30000]", g.ValidityMS)
	}

	r := e.do(e.client, http.MethodGet, "/v1/locks/orders", nil)
	var st api.LockStatus
	r.decode(t, &st)
	if r.status != 200 || !st.Held || st.Owner != "alice" || st.LastFencingToken != 1 || st.RemainingMS <= 0 {
		t.Errorf("GET = %d %+v; want held by alice, token 1", r.status, st)
	}
	if strings.Contains(string(r.body), g.LockToken) {
		t.Error("GET response contains the lock token")
	}

	r = e.do(e.client, http.MethodPost, "/v1/locks/orders/extend", map[string]any{"ttl_ms": 50000}, api.LockTokenHeader, g.LockToken)
	var ext api.LockResponse
	r.decode(t, &ext)
	if r.status != 200 || ext.FencingToken != 1 || ext.TTLMS != 50000 || ext.LockToken != "" {
		t.Errorf("extend = %d %+v; want 200, same fencing token, no lock token", r.status, ext)
	}
	// A majority holds the lock with the new TTL (above the 30s it had,
	// within 50s).
	renewed := 0
	for _, c := range e.rdb {
		if d := c.PTTL(context.Background(), "redfence:lock:orders").Val(); d > 30*time.Second && d <= 50*time.Second {
			renewed++
		}
	}
	if renewed < 3 {
		t.Errorf("%d nodes hold the lock with the new TTL; want at least 3", renewed)
	}

	if r := e.put("orders", 1, map[string]any{"total": 42}); r.status != 200 {
		t.Fatalf("PUT = %d %s; want 200", r.status, r.body)
	}
	var res api.Resource
	r = e.do(e.client, http.MethodGet, "/v1/resources/orders", nil)
	r.decode(t, &res)
	if r.status != 200 || string(res.Data) != `{"total":42}` || res.FencingToken != 1 || res.Version != 1 {
		t.Errorf("GET resource = %d %+v; want the written data, token 1, version 1", r.status, res)
	}

	if r := e.release("orders", g.LockToken); r.status != http.StatusNoContent {
		t.Fatalf("release = %d %s; want 204", r.status, r.body)
	}
	r = e.release("orders", g.LockToken)
	if p := r.problem(t); r.status != 409 || p.Type != api.ProblemTypePrefix+"not-holder" {
		t.Errorf("second release = %d %s; want 409 not-holder", r.status, p.Type)
	}
	r = e.do(e.client, http.MethodPost, "/v1/locks/orders/extend", nil, api.LockTokenHeader, g.LockToken)
	if p := r.problem(t); r.status != 409 || p.Type != api.ProblemTypePrefix+"lock-lost" {
		t.Errorf("extend after release = %d %s; want 409 lock-lost", r.status, p.Type)
	}
	r = e.do(e.client, http.MethodGet, "/v1/locks/orders", nil)
	st = api.LockStatus{}
	r.decode(t, &st)
	if st.Held || st.Owner != "" || st.LastFencingToken != 1 {
		t.Errorf("GET after release = %+v; want free, last token 1, no owner", st)
	}
	e.waitReleased("every node to drop the released lock", nil)
	if r := e.do(e.client, http.MethodGet, "/v1/resources/nothing-here", nil); r.status != 404 || r.problem(t).Type != api.ProblemTypePrefix+"resource-not-found" {
		t.Errorf("GET missing resource = %d %s; want 404 resource-not-found", r.status, r.body)
	}
}

// TestAPI_EncodedNames: SDKs percent-encode path segments (":" becomes
// "%3A"); the name is the decoded segment either way.
func TestAPI_EncodedNames(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	// The validator matches the raw path and would check "%3A" against the
	// name pattern, so only the response is validated here.
	r := e.do(e.loose, http.MethodPost, "/v1/locks/orders%3Ainvoice-7", nil)
	var g api.LockResponse
	r.decode(t, &g)
	if r.status != 201 || g.Name != "orders:invoice-7" {
		t.Errorf("acquire orders%%3Ainvoice-7 = %d %s; want 201 for orders:invoice-7", r.status, r.body)
	}
	var st api.LockStatus
	e.do(e.client, http.MethodGet, "/v1/locks/orders:invoice-7", nil).decode(t, &st)
	if !st.Held {
		t.Error("the lock taken through the encoded name is not held under the plain one")
	}
	// Data its readers cannot read (Postgres's JSON functions, Unicode text,
	// a double, deep nesting) is refused with the reason, and the field,
	// named.
	for _, tc := range []struct{ body, reason string }{
		{fmt.Sprintf(`{"fencing_token":%d,"data":"nul \u0000 inside"}`, g.FencingToken), `\u0000`},
		{fmt.Sprintf("{\"fencing_token\":%d,\"data\":\"\xff\xfe\"}", g.FencingToken), "UTF-8"},
		{fmt.Sprintf(`{"fencing_token":%d,"data":["\ud800"]}`, g.FencingToken), "surrogate"},
		{fmt.Sprintf(`{"fencing_token":%d,"data":{"n":1e309}}`, g.FencingToken), "double"},
		{fmt.Sprintf(`{"fencing_token":%d,"data":[1.7976931348623158079372897140530341507999e308]}`, g.FencingToken), "double"},
		{fmt.Sprintf(`{"fencing_token":%d,"data":%s1%s}`, g.FencingToken, strings.Repeat("[", refstore.MaxDepth+1), strings.Repeat("]", refstore.MaxDepth+1)), "levels deep"},
		// Deeper than encoding/json reads (10,000 levels): still data's
		// problem, with its own limit, not the body's.
		{fmt.Sprintf(`{"fencing_token":%d,"data":%s1%s}`, g.FencingToken, strings.Repeat("[", 10001), strings.Repeat("]", 10001)),
			fmt.Sprintf("more than %d levels deep", refstore.MaxDepth)},
	} {
		r := e.do(e.loose, http.MethodPut, "/v1/resources/orders:invoice-7", tc.body)
		p := r.problem(t)
		if r.status != 400 || p.Type != api.ProblemTypePrefix+"invalid-request" || !strings.Contains(p.Detail, tc.reason) ||
			len(p.InvalidParams) != 1 || p.InvalidParams[0].Name != "data" {
			t.Errorf("PUT %q = %d %s; want 400 invalid-request naming data and %q", tc.body, r.status, r.body, tc.reason)
		}
	}
	if r := e.do(e.client, http.MethodGet, "/v1/resources/orders:invoice-7", nil); r.status != 404 {
		t.Errorf("GET after the refused writes = %d %s; want 404", r.status, r.body)
	}
	// A document reads back as written, without its whitespace: a number
	// that takes 16 KiB written out in full (jsonb's form) stays 8 bytes.
	body := fmt.Sprintf(`{"fencing_token":%d,"data":{"tiny": 1e-16383, "z": -0, "a": 1.50}}`, g.FencingToken)
	const want = `"data":{"tiny":1e-16383,"z":-0,"a":1.50}`
	if r := e.do(e.client, http.MethodPut, "/v1/resources/orders:invoice-7", body); r.status != 200 || !strings.Contains(string(r.body), want) {
		t.Errorf("PUT %s = %d %s; want 200 with %s", body, r.status, r.body, want)
	}
	if r := e.do(e.client, http.MethodGet, "/v1/resources/orders:invoice-7", nil); r.status != 200 || !strings.Contains(string(r.body), want) {
		t.Errorf("GET = %d %.300s; want 200 with %s", r.status, r.body, want)
	}
}

func TestAPI_TokensIncreasePerName(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	for want := int64(1); want <= 3; want++ {
		for _, name := range []string{"a", "b:c"} {
			g := e.mustAcquire(name, nil)
			if g.FencingToken != want {
				t.Errorf("acquire %s #%d: fencing token %d; want %d", name, want, g.FencingToken, want)
			}
			if r := e.release(name, g.LockToken); r.status != 204 {
				t.Fatalf("release = %d %s", r.status, r.body)
			}
		}
	}
}

// TestAPI_Contention has 64 clients contend for one name. Each holder does a
// read-modify-write of one document with its token and checks nobody else
// wrote in between; the document's history must show every grant once, in
// token order, with no lost update.
func TestAPI_Contention(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{service: service.Options{RetryDelayMin: 5 * time.Millisecond, RetryDelayMax: 20 * time.Millisecond}})
	const clients = 64
	type doc struct {
		Count  int    `json:"count"`
		Holder string `json:"holder"`
		Prev   int64  `json:"prev"` // fencing token of the previous writer
	}
	var mu sync.Mutex
	tokens := map[int64]string{}
	var wg sync.WaitGroup
	for i := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			me := fmt.Sprintf("client-%d", i)
			g, r := e.acquire("hot", map[string]any{"ttl_ms": 10000, "wait_ms": 60000, "owner": me})
			if g == nil {
				t.Errorf("%s: acquire = %d %s", me, r.status, r.body)
				return
			}
			mu.Lock()
			if other, dup := tokens[g.FencingToken]; dup {
				t.Errorf("fencing token %d granted to %s and %s", g.FencingToken, other, me)
			}
			tokens[g.FencingToken] = me
			mu.Unlock()

			var cur doc
			var prevToken int64
			if r := e.do(e.client, http.MethodGet, "/v1/resources/hot", nil); r.status == 200 {
				var res api.Resource
				r.decode(t, &res)
				r.decode(t, &struct{ Data *doc }{&cur})
				prevToken = res.FencingToken
			}
			if prevToken >= g.FencingToken {
				t.Errorf("%s holds token %d but the document was last written with %d", me, g.FencingToken, prevToken)
			}
			next := doc{Count: cur.Count + 1, Holder: me, Prev: prevToken}
			if r := e.put("hot", g.FencingToken, next); r.status != 200 {
				t.Errorf("%s: PUT with a live grant = %d %s", me, r.status, r.body)
			}
			var after doc
			r = e.do(e.client, http.MethodGet, "/v1/resources/hot", nil)
			r.decode(t, &struct{ Data *doc }{&after})
			if after != next {
				t.Errorf("%s: document changed under a live holder: %+v; want %+v", me, after, next)
			}
			if r := e.release("hot", g.LockToken); r.status != 204 {
				t.Errorf("%s: release = %d %s", me, r.status, r.body)
			}
		}()
	}
	wg.Wait()
	if len(tokens) != clients {
		t.Fatalf("%d grants; want %d", len(tokens), clients)
	}
	for tok := int64(1); tok <= clients; tok++ {
		if _, ok := tokens[tok]; !ok {
			t.Errorf("token %d never granted; want exactly 1..%d", tok, clients)
		}
	}
	var res api.Resource
	var final doc
	r := e.do(e.client, http.MethodGet, "/v1/resources/hot", nil)
	r.decode(t, &res)
	r.decode(t, &struct{ Data *doc }{&final})
	if final.Count != clients || res.Version != clients {
		t.Errorf("final count %d, version %d; want %d (no lost update)", final.Count, res.Version, clients)
	}
}

// TestAPI_GCPause is the story the fencing token exists for: A's lease runs
// out while it is paused; B is granted the next token and writes; A wakes up
// and writes with its old token, and the store refuses it.
func TestAPI_GCPause(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	a := e.mustAcquireShort("account", map[string]any{"ttl_ms": 300, "owner": "A"})
	// B waits for A's lease to run out (A is "paused" and never releases).
	b := e.mustAcquire("account", map[string]any{"ttl_ms": 10000, "wait_ms": 10000, "owner": "B"})
	if b.FencingToken != a.FencingToken+1 {
		t.Fatalf("B's token = %d; want A's + 1 = %d", b.FencingToken, a.FencingToken+1)
	}
	if r := e.put("account", b.FencingToken, "written by B"); r.status != 200 {
		t.Fatalf("B's PUT = %d %s", r.status, r.body)
	}
	r := e.put("account", a.FencingToken, "written by A after its pause")
	p := r.problem(t)
	if r.status != 409 || p.Type != api.ProblemTypePrefix+"stale-token" || p.CurrentFencingToken == nil || *p.CurrentFencingToken != b.FencingToken {
		t.Fatalf("A's late PUT = %d %s; want 409 stale-token with current %d", r.status, r.body, b.FencingToken)
	}
	var res api.Resource
	e.do(e.client, http.MethodGet, "/v1/resources/account", nil).decode(t, &res)
	if string(res.Data) != `"written by B"` || res.FencingToken != b.FencingToken {
		t.Errorf("stored = %s (token %d); want B's write", res.Data, res.FencingToken)
	}
	// A's lock token no longer does anything either, once its lease has
	// run out on every node (B was granted as soon as it had on a majority;
	// a release then still deletes A's key where it lingers, rightly).
	testutil.WaitFor(t, 30*time.Second, "A's key to expire on every node", func() (bool, error) {
		for _, c := range e.rdb {
			v, err := c.Get(context.Background(), "redfence:lock:account").Result()
			if err != nil && !errors.Is(err, redis.Nil) {
				return false, err
			}
			if v == a.LockToken {
				return false, nil
			}
		}
		return true, nil
	})
	if r := e.do(e.client, http.MethodPost, "/v1/locks/account/extend", nil, api.LockTokenHeader, a.LockToken); r.status != 409 {
		t.Errorf("A's extend = %d; want 409", r.status)
	}
	if r := e.release("account", a.LockToken); r.status != 409 {
		t.Errorf("A's release = %d; want 409", r.status)
	}
	var st api.LockStatus
	e.do(e.client, http.MethodGet, "/v1/locks/account", nil).decode(t, &st)
	if !st.Held || st.Owner != "B" {
		t.Errorf("after A's attempts: %+v; want still held by B", st)
	}
}

// TestAPI_StallBeforeIssuance stalls a grant between winning the quorum and
// issuing its token for longer than the TTL: the grant must be refused and
// leave nothing behind (DESIGN step 3).
func TestAPI_StallBeforeIssuance(t *testing.T) {
	t.Parallel()
	for _, spec := range []bool{false, true} {
		t.Run(map[bool]string{false: "NoSpeculation", true: "Speculation"}[spec], func(t *testing.T) {
			t.Parallel()
			testStallBeforeIssuance(t, spec)
		})
	}
}

func testStallBeforeIssuance(t *testing.T, spec bool) {
	// The injected fault: a pause longer than the lease, made by moving the
	// Locker's clock on. The keys' real TTL is long, so they are still on
	// the nodes unless the refused grant deletes them.
	const ttl = 10 * time.Second
	var offset atomic.Int64
	var stalled atomic.Bool
	e := newEnv(t, envOptions{service: service.Options{
		NoSpeculation: !spec,
		Now:           func() time.Time { return time.Now().Add(time.Duration(offset.Load())) },
		AfterQuorum: func(ctx context.Context, key string) {
			if key == "stalled" && !stalled.Swap(true) { // the first grant only
				offset.Add(int64(ttl + time.Second))
			}
		},
	}})
	r := e.do(e.client, http.MethodPost, "/v1/locks/stalled", map[string]any{"ttl_ms": ttl.Milliseconds()})
	if p := r.problem(t); r.status != 503 || p.Type != api.ProblemTypePrefix+"lease-expired" {
		t.Fatalf("stalled acquire = %d %s; want 503 lease-expired", r.status, r.body)
	}
	if r.header.Get("Retry-After") == "" {
		t.Error("503 without Retry-After")
	}
	for i, keys := range e.lockKeys() {
		if len(keys) != 0 {
			t.Errorf("node %d keeps %v after a refused grant", i, keys)
		}
	}
	// The stall was found before issuance: no token was issued without
	// speculation (with it, the speculated one stays unused), so none fences
	// out a grant made meanwhile: the next grant's token is the next one.
	// (A try speculates only with an idle pooled connection: 0 or 1 then.)
	var st api.LockStatus
	e.do(e.client, http.MethodGet, "/v1/locks/stalled", nil).decode(t, &st)
	if st.LastFencingToken != 0 && !(spec && st.LastFencingToken == 1) {
		t.Errorf("last_fencing_token after the stalled grant = %d; want 0 (or 1, an unused speculated token)", st.LastFencingToken)
	}
	if g := e.mustAcquire("stalled", map[string]any{"ttl_ms": ttl.Milliseconds()}); g.FencingToken != st.LastFencingToken+1 {
		t.Errorf("the grant after the stalled one has fencing token %d; want %d", g.FencingToken, st.LastFencingToken+1)
	}
	// Other names are unaffected.
	e.mustAcquire("not-stalled", map[string]any{"ttl_ms": ttl.Milliseconds()})
}

func TestAPI_NodeFailures(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	ctx := context.Background()
	for _, n := range e.nodes[:2] {
		if err := n.Kill(); err != nil {
			t.Fatal(err)
		}
	}
	g := e.mustAcquire("n1", nil) // 3 of 5 up: still a majority
	if r := e.release("n1", g.LockToken); r.status != 204 {
		t.Errorf("release with 2 nodes down = %d %s", r.status, r.body)
	}
	var nodes api.NodeList
	e.do(e.client, http.MethodGet, "/v1/nodes", nil).decode(t, &nodes)
	if nodes.Up != 3 || nodes.Quorum != 3 || nodes.Nodes[0].Up || nodes.Nodes[0].Error == "" {
		t.Errorf("nodes = %+v; want 3 up of 5, node 0 down with an error", nodes)
	}
	if r := e.do(e.client, http.MethodGet, "/readyz", nil); r.status != 200 {
		t.Errorf("readyz with 3 of 5 = %d; want 200", r.status)
	}

	if err := e.nodes[2].Kill(); err != nil {
		t.Fatal(err)
	}
	before := e.snapshot()
	start := time.Now()
	r := e.do(e.client, http.MethodPost, "/v1/locks/n2", map[string]any{"wait_ms": 300})
	t.Logf("3 of 5 down: answered %d after %v (wait 300ms, node timeout 1s)", r.status, time.Since(start))
	p := r.problem(t)
	if r.status != 503 || p.Type != api.ProblemTypePrefix+"quorum-unavailable" || r.header.Get("Retry-After") == "" {
		t.Fatalf("acquire with 3 of 5 down = %d %s; want 503 quorum-unavailable with Retry-After", r.status, r.body)
	}
	failed := 0
	for _, n := range p.Nodes {
		if n.Outcome == "error" || n.Outcome == "timeout" {
			failed++
		}
	}
	if len(p.Nodes) != 5 || failed != 3 {
		t.Errorf("problem nodes = %+v; want 5 outcomes, 3 failed", p.Nodes)
	}
	if after := e.snapshot(); after != before {
		t.Errorf("a refused acquire changed state:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	if r := e.do(e.client, http.MethodGet, "/readyz", nil); r.status != 503 {
		t.Errorf("readyz with 2 of 5 = %d; want 503", r.status)
	}

	for _, n := range e.nodes[:3] {
		if err := n.Start(ctx); err != nil {
			t.Fatal(err)
		}
	}
	g = e.mustAcquire("n2", map[string]any{"wait_ms": 5000})
	if g.FencingToken != 1 {
		t.Errorf("first grant of n2 after recovery has token %d; want 1 (nothing was issued while down)", g.FencingToken)
	}
}

// TestAPI_NodeLostMemory checks the outcome a problem reports for a node
// found without its data: quarantined, with a reason fit for a client.
func TestAPI_NodeLostMemory(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{registry: true})
	e.mustAcquire("qr", map[string]any{"ttl_ms": 60000})
	if err := e.rdb[0].FlushAll(context.Background()).Err(); err != nil { // as a restart without persistence would
		t.Fatal(err)
	}
	r := e.do(e.client, http.MethodPost, "/v1/locks/qr", nil)
	p := r.problem(t)
	if r.status != 409 || p.Type != api.ProblemTypePrefix+"lock-held" || len(p.Nodes) != 5 {
		t.Fatalf("acquire of a held lock = %d %s; want 409 lock-held with 5 nodes", r.status, r.body)
	}
	// A refusal does not wait for the nodes still to answer once enough
	// said no: those are pending (on a crowded host, any of them).
	if n := p.Nodes[0]; n.Outcome != "pending" && (n.Outcome != "quarantined" || !strings.Contains(n.Error, "restarted without its data") || strings.Contains(n.Error, "service:")) {
		t.Errorf("the flushed node's outcome = %+v; want quarantined, with the reason and no Go package prefix (or pending)", n)
	}
	for _, n := range p.Nodes[1:] {
		if n.Outcome != "pending" && (n.Outcome != "no" || n.Error != "") {
			t.Errorf("a node holding the lock: %+v; want outcome no without an error (or pending)", n)
		}
	}
	// /v1/nodes says until when and why; the others are not quarantined.
	var nodes api.NodeList
	e.do(e.client, http.MethodGet, "/v1/nodes", nil).decode(t, &nodes)
	if n := nodes.Nodes[0]; n.QuarantinedUntil == "" || n.QuarantineReason != service.QuarantineLostMemory {
		t.Errorf("the flushed node in /v1/nodes: %+v; want quarantined_until and quarantine_reason %q", n, service.QuarantineLostMemory)
	}
	for _, n := range nodes.Nodes[1:] {
		if n.QuarantinedUntil != "" || n.QuarantineReason != "" {
			t.Errorf("a node that kept its data in /v1/nodes: %+v; want no quarantine", n)
		}
	}
}

func TestAPI_PostgresDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg, url := ownPostgres(t)
	e := newEnv(t, envOptions{databaseURL: url})
	var last int64
	for range 3 {
		g := e.mustAcquire("pg", nil)
		last = g.FencingToken
		e.release("pg", g.LockToken)
	}
	held := e.mustAcquire("held", map[string]any{"ttl_ms": 60000})
	testutil.WaitFor(t, 30*time.Second, "every node to hold the lock", func() (bool, error) {
		for _, c := range e.rdb {
			if n, err := c.Exists(ctx, "redfence:lock:held").Result(); err != nil || n != 1 {
				return false, err
			}
		}
		return true, nil
	})
	if err := pg.Stop(ctx, true); err != nil {
		t.Fatal(err)
	}
	// A refused extend changes no lease: it would have shortened this one
	// to 1 s while its client still counts on the old deadline.
	r := e.do(e.client, http.MethodPost, "/v1/locks/held/extend", map[string]any{"ttl_ms": 1000}, api.LockTokenHeader, held.LockToken)
	if p := r.problem(t); r.status != 503 || p.Type != api.ProblemTypePrefix+"fencing-unavailable" || !strings.Contains(p.Detail, "not extended") {
		t.Errorf("extend with Postgres down = %d %s; want 503 fencing-unavailable saying the lease was not extended", r.status, r.body)
	}
	r = e.do(e.client, http.MethodGet, "/v1/locks/held", nil)
	if p := r.problem(t); r.status != 503 || p.Type != api.ProblemTypePrefix+"fencing-unavailable" || strings.Contains(p.Detail, "granted") {
		t.Errorf("lock status with Postgres down = %d %s; want 503 fencing-unavailable, not about a grant", r.status, r.body)
	}
	for i, c := range e.rdb {
		keys, err := c.Keys(ctx, "redfence:lock:*held").Result()
		if err != nil || len(keys) != 1 {
			t.Fatalf("node %d: held lock keys %v, %v", i, keys, err)
		}
		if d, err := c.PTTL(ctx, keys[0]).Result(); err != nil || d < 30*time.Second {
			t.Errorf("node %d: the lease has %v left (%v) after a refused extend; want about a minute", i, d, err)
		}
	}
	for _, r := range []*response{e.put("pg", last, 1), e.do(e.client, http.MethodGet, "/v1/resources/pg", nil)} {
		if p := r.problem(t); r.status != 503 || p.Type != api.ProblemTypePrefix+"store-unavailable" || r.header.Get("Retry-After") == "" {
			t.Errorf("reference store with Postgres down = %d %s; want 503 store-unavailable", r.status, r.body)
		}
	}
	if r := e.put("pg", last, 1); !strings.Contains(r.problem(t).Detail, "nothing was written") {
		t.Errorf("a write with Postgres down (nothing sent) says %q; want it to say nothing was written", r.problem(t).Detail)
	}
	if r := e.do(e.client, http.MethodGet, "/v1/resources/pg", nil); strings.Contains(r.problem(t).Detail, "written") {
		t.Errorf("a read with Postgres down says %q; it wrote nothing, it read nothing", r.problem(t).Detail)
	}
	r = e.do(e.client, http.MethodPost, "/v1/locks/pg", nil)
	if p := r.problem(t); r.status != 503 || p.Type != api.ProblemTypePrefix+"fencing-unavailable" {
		t.Fatalf("acquire with Postgres down = %d %s; want 503 fencing-unavailable", r.status, r.body)
	}
	for i, keys := range e.lockKeys() {
		keys = slices.DeleteFunc(keys, func(k string) bool { return strings.HasSuffix(k, "held") })
		if len(keys) != 0 {
			t.Errorf("node %d keeps %v after a grant refused for lack of a token", i, keys)
		}
	}
	if r := e.do(e.client, http.MethodGet, "/readyz", nil); r.status != 503 {
		t.Errorf("readyz with Postgres down = %d; want 503", r.status)
	}
	if err := pg.Start(ctx); err != nil {
		t.Fatal(err)
	}
	// The pool may hold connections broken by the restart: a waiting acquire
	// retries past them.
	g := e.mustAcquire("pg", map[string]any{"wait_ms": 10000})
	if g.FencingToken <= last {
		t.Errorf("token after Postgres restart = %d; want above %d", g.FencingToken, last)
	}
}

// TestAPI_NullDocument: null is a document like any other JSON value, in the
// request and in the answer (both validated against openapi.yaml).
func TestAPI_NullDocument(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	g := e.mustAcquire("null-doc", nil)
	if r := e.put("null-doc", g.FencingToken, nil); r.status != 200 {
		t.Fatalf("PUT null = %d %s", r.status, r.body)
	}
	r := e.do(e.client, http.MethodGet, "/v1/resources/null-doc", nil)
	var res struct {
		Data json.RawMessage `json:"data"`
	}
	r.decode(t, &res)
	if r.status != 200 || string(res.Data) != "null" {
		t.Errorf("GET = %d %s; want 200 with data null", r.status, r.body)
	}
}

// TestAPI_CallerLeft: a request whose client has left (its context ended)
// is answered 499 cancelled, never as an outage (503) or a report of nodes
// being down: the calls it cut short say nothing of Redis or Postgres.
func TestAPI_CallerLeft(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	g := e.mustAcquire("left", map[string]any{"ttl_ms": 30000})
	gone, leave := context.WithCancel(t.Context())
	leave()
	for _, tc := range []struct {
		method, path, body string
		hdr                []string
	}{
		{http.MethodGet, "/v1/locks/left", "", nil},
		{http.MethodPost, "/v1/locks/left/extend", `{"ttl_ms":30000}`, []string{"Lock-Token", g.LockToken, "Content-Type", "application/json"}},
		{http.MethodGet, "/v1/nodes", "", nil},
		{http.MethodGet, "/readyz", "", nil},
	} {
		req := httptest.NewRequestWithContext(gone, tc.method, tc.path, strings.NewReader(tc.body))
		for i := 0; i < len(tc.hdr); i += 2 {
			req.Header.Set(tc.hdr[i], tc.hdr[i+1])
		}
		rec := httptest.NewRecorder()
		e.srv.Config.Handler.ServeHTTP(rec, req)
		r := readResponse(t, rec.Result())
		if p := r.problem(t); r.status != 499 || p.Type != api.ProblemTypePrefix+"cancelled" {
			t.Errorf("%s %s of a client that left = %d %s; want 499 cancelled", tc.method, tc.path, r.status, p.Type)
		}
	}
	// Nothing was down, and the lease is as it was.
	if r := e.do(e.client, http.MethodGet, "/readyz", nil); r.status != 200 {
		t.Errorf("GET /readyz = %d; want 200", r.status)
	}
	if r := e.release("left", g.LockToken); r.status != 204 {
		t.Errorf("release = %d; want 204", r.status)
	}
}

// TestAPI_TokensExhausted: a name that was issued the last fencing token
// there is (fencing.MaxToken) is granted no more, and the 503 says so
// (Retry-After, which every 503 carries, cannot help it). The grant refused
// leaves no lock key behind.
func TestAPI_TokensExhausted(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	if _, err := e.pg.Exec(context.Background(), `INSERT INTO redfence_fencing (key, token) VALUES ('maxed', $1)`, int64(fencing.MaxToken)-1); err != nil {
		t.Fatal(err)
	}
	g := e.mustAcquire("maxed", nil)
	if g.FencingToken != int64(fencing.MaxToken) {
		t.Fatalf("token = %d; want the last one, %d", g.FencingToken, fencing.MaxToken)
	}
	e.release("maxed", g.LockToken)
	r := e.do(e.client, http.MethodPost, "/v1/locks/maxed", nil)
	p := r.problem(t)
	if r.status != 503 || p.Type != api.ProblemTypePrefix+"fencing-unavailable" || !strings.Contains(p.Detail, "no more") {
		t.Errorf("acquire past the last token = %d %s; want 503 fencing-unavailable saying the name is granted no more", r.status, r.body)
	}
	for i, keys := range e.lockKeys() {
		if len(keys) != 0 {
			t.Errorf("node %d keeps %v after a grant refused for lack of a token", i, keys)
		}
	}
	// Other names are granted as before.
	if g := e.mustAcquire("other", nil); g.FencingToken != 1 {
		t.Errorf("another name's token = %d; want 1", g.FencingToken)
	}
}

// TestAPI_QuarantineRetryAfter: an acquire refused only because quarantined
// nodes do not count (the others said yes) says when enough quarantines end
// for a majority to count, not "in a second": retry_after_ms, and
// Retry-After in seconds, rounded up. With a node down besides, it cannot
// tell: Retry-After 1 and no retry_after_ms.
func TestAPI_QuarantineRetryAfter(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{registry: true})
	ctx := context.Background()
	for _, c := range e.rdb[:3] { // as restarts without persistence would
		if err := c.FlushAll(ctx).Err(); err != nil {
			t.Fatal(err)
		}
	}
	// The acquire that finds them without their markers cannot tell yet
	// when the quarantines it starts will end.
	r := e.do(e.client, http.MethodPost, "/v1/locks/q", nil)
	if p := r.problem(t); r.status != 503 || p.RetryAfterMS != nil || r.header.Get("Retry-After") != "1" {
		t.Errorf("acquire finding 3 of 5 nodes without their data = %d %s, Retry-After %q; want 503 with Retry-After 1 and no retry_after_ms",
			r.status, r.body, r.header.Get("Retry-After"))
	}
	// Reading the nodes waits for their quarantines to be recorded.
	var nodes api.NodeList
	e.do(e.client, http.MethodGet, "/v1/nodes", nil).decode(t, &nodes)
	var ends []time.Time
	for i, n := range nodes.Nodes[:3] {
		until, err := time.Parse(time.RFC3339Nano, n.QuarantinedUntil)
		if err != nil {
			t.Fatalf("node %d: quarantined_until %q: %v", i, n.QuarantinedUntil, err)
		}
		ends = append(ends, until)
	}
	slices.SortFunc(ends, time.Time.Compare)
	sent := time.Now()
	r = e.do(e.client, http.MethodPost, "/v1/locks/q", nil)
	answered := time.Now()
	p := r.problem(t)
	if r.status != 503 || p.Type != api.ProblemTypePrefix+"quorum-unavailable" || p.RetryAfterMS == nil {
		t.Fatalf("acquire with 3 of 5 nodes quarantined = %d %s; want 503 quorum-unavailable with retry_after_ms", r.status, r.body)
	}
	ms := time.Duration(*p.RetryAfterMS) * time.Millisecond
	// One more node must count: the earliest quarantine's end.
	if lo, hi := ends[0].Sub(answered)-time.Millisecond, ends[0].Sub(sent)+time.Millisecond; ms < lo || ms > hi {
		t.Errorf("retry_after_ms = %v; want the first quarantine's end, between %v and %v from now", ms, lo, hi)
	}
	if want := strconv.FormatInt(int64(math.Ceil(ms.Seconds())), 10); r.header.Get("Retry-After") != want {
		t.Errorf("Retry-After %q; want retry_after_ms in seconds, rounded up: %s", r.header.Get("Retry-After"), want)
	}

	// Found without their data again while quarantined: the quarantine
	// running says nothing of the one this loss starts.
	for _, c := range e.rdb[:3] {
		if err := c.FlushAll(ctx).Err(); err != nil {
			t.Fatal(err)
		}
	}
	r = e.do(e.client, http.MethodPost, "/v1/locks/q", nil)
	if p := r.problem(t); r.status != 503 || p.RetryAfterMS != nil || r.header.Get("Retry-After") != "1" {
		t.Errorf("acquire finding quarantined nodes without their data again = %d %s, Retry-After %q; want 503 with Retry-After 1 and no retry_after_ms",
			r.status, r.body, r.header.Get("Retry-After"))
	}
	e.do(e.client, http.MethodGet, "/v1/nodes", nil).decode(t, &nodes) // the new quarantines recorded

	if err := e.nodes[4].Stop(ctx); err != nil { // a node down may be back at any moment
		t.Fatal(err)
	}
	r = e.do(e.client, http.MethodPost, "/v1/locks/q", nil)
	if p := r.problem(t); r.status != 503 || p.RetryAfterMS != nil || r.header.Get("Retry-After") != "1" {
		t.Errorf("acquire with 3 nodes quarantined and 1 down = %d %s, Retry-After %q; want 503 with Retry-After 1 and no retry_after_ms",
			r.status, r.body, r.header.Get("Retry-After"))
	}
}
