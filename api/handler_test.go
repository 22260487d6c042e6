package api

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/iotest"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/redfence/redfence/internal/apikey"
	"github.com/redfence/redfence/internal/testutil"
	"github.com/redfence/redfence/service"
)

// These tests run the HTTP layer over the in-memory fakes of
// handler_bench_test.go; the integration tests run it over Redis and
// Postgres.

// fakeEnv is a Handler over the fakes, logging JSON at Info to a buffer.
type fakeEnv struct {
	h    *Handler
	l    *benchFakeLocker
	logs *testutil.Buffer
	reg  *prometheus.Registry
	now  time.Time
}

func newFakeEnv(t *testing.T, auth bool) *fakeEnv {
	t.Helper()
	e := &fakeEnv{l: newBenchFakeLocker(), logs: &testutil.Buffer{}, reg: prometheus.NewRegistry(),
		now: time.Date(2026, 5, 4, 3, 2, 1, 0, time.UTC)}
	e.l.now = func() time.Time { return e.now }
	opts := Options{Logger: slog.New(slog.NewJSONHandler(e.logs, &slog.HandlerOptions{Level: slog.LevelInfo})),
		Registry: e.reg, Now: func() time.Time { return e.now }}
	if auth {
		id, _ := apikey.ParseID(benchAPIKey)
		keys := benchFakeKeys{id: {ID: id, Tenant: "bench", Scopes: apikey.AllScopes(), Hash: apikey.Hash(benchAPIKey)}}
		opts.Auth = NewKeyAuth(keys, KeyAuthOptions{CacheTTL: time.Hour})
		opts.RateLimit = 1000
	}
	e.h = NewHandler(e.l, benchFakeStore{e.l}, opts)
	return e
}

// do sends a request; hdr are header name, value pairs.
func (e *fakeEnv) do(h http.Handler, method, target, body string, hdr ...string) *httptest.ResponseRecorder {
	r := httptest.NewRequest(method, target, strings.NewReader(body))
	if body != "" {
		r.Header.Set("Content-Type", "application/json")
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		r.Header.Add(hdr[i], hdr[i+1])
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	e.h.audits.Wait() // an audit line written after the answer (see auditGrant)
	return w
}

func (e *fakeEnv) acquire(t *testing.T, h http.Handler, name, body string) LockResponse {
	t.Helper()
	w := e.do(h, http.MethodPost, "/v1/locks/"+name, body)
	if w.Code != http.StatusCreated {
		t.Fatalf("acquire %s = %d %s", name, w.Code, w.Body)
	}
	var g LockResponse
	if err := json.Unmarshal(w.Body.Bytes(), &g); err != nil {
		t.Fatal(err)
	}
	return g
}

// lines returns the log lines with msg.
func (e *fakeEnv) lines(t *testing.T, msg string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for l := range strings.Lines(e.logs.String()) {
		if strings.TrimSpace(l) == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("log line %q: %v", l, err)
		}
		if m["msg"] == msg {
			out = append(out, m)
		}
	}
	return out
}

func (e *fakeEnv) lastCalls() int {
	e.l.mu.Lock()
	defer e.l.mu.Unlock()
	return e.l.lastCalls
}

// TestReleaseAudit checks that the release audit line names the owner and
// the fencing token of the grant: from the Handler's own cache for its
// grants, from the store for the others (another server's, an expired
// one), and names nobody for a token of another lock.
func TestReleaseAudit(t *testing.T) {
	e := newFakeEnv(t, false)
	release := func(name, token string) int {
		return e.do(e.h, http.MethodDelete, "/v1/locks/"+name, "", LockTokenHeader, token).Code
	}
	lastReleased := func() map[string]any {
		ls := e.lines(t, "lock released")
		return ls[len(ls)-1]
	}

	// Granted here: the cache answers.
	g := e.acquire(t, e.h, "orders", `{"ttl_ms":30000,"owner":"alice"}`)
	if code := release("orders", g.LockToken); code != http.StatusNoContent {
		t.Fatalf("release = %d", code)
	}
	if m := lastReleased(); m["owner"] != "alice" || m["fencing_token"] != float64(g.FencingToken) || m["outcome"] != "released" || m["audit"] != true {
		t.Errorf("release audit line = %v; want owner alice, fencing token %d", m, g.FencingToken)
	}
	if n := e.lastCalls(); n != 0 {
		t.Errorf("the store was asked %d times for a grant this Handler made", n)
	}
	if n := e.h.grants.len(); n != 0 {
		t.Errorf("the grant cache holds %d entries after the release", n)
	}

	// Granted by another server (another Handler on the same locks): the
	// store answers.
	other := NewHandler(e.l, benchFakeStore{e.l}, Options{Logger: slog.New(slog.DiscardHandler), Now: e.l.now})
	g = e.acquire(t, other, "orders", `{"owner":"bob"}`)
	if code := release("orders", g.LockToken); code != http.StatusNoContent {
		t.Fatalf("release = %d", code)
	}
	if m := lastReleased(); m["owner"] != "bob" || m["fencing_token"] != float64(g.FencingToken) {
		t.Errorf("release audit line = %v; want owner bob, fencing token %d", m, g.FencingToken)
	}
	if n := e.lastCalls(); n != 1 {
		t.Errorf("the store was asked %d times for another server's grant; want 1", n)
	}

	// Expired in the cache: the store answers.
	g = e.acquire(t, e.h, "orders", `{"ttl_ms":1000,"owner":"carol"}`)
	e.now = e.now.Add(2 * time.Second)
	if code := release("orders", g.LockToken); code != http.StatusNoContent {
		t.Fatalf("release = %d", code)
	}
	if m := lastReleased(); m["owner"] != "carol" || m["fencing_token"] != float64(g.FencingToken) {
		t.Errorf("release audit line = %v; want owner carol, fencing token %d", m, g.FencingToken)
	}
	if n := e.lastCalls(); n != 2 {
		t.Errorf("the store was asked %d times; want 2", n)
	}

	// A token of another lock: nobody.
	g = e.acquire(t, e.h, "a", `{"owner":"dave"}`)
	if code := release("b", g.LockToken); code != http.StatusConflict {
		t.Fatalf("release of b with a's token = %d", code)
	}
	ls := e.lines(t, "lock release refused")
	if m := ls[len(ls)-1]; m["owner"] != "" || m["fencing_token"] != nil || m["outcome"] != "not-holder" {
		t.Errorf("refused release audit line = %v; want no owner, no fencing token, not-holder", m)
	}

	// An extension keeps the cache's entry alive past the first expiry.
	e.acquire(t, e.h, "c", `{"ttl_ms":1000,"owner":"erin"}`)
	gc := e.lastGrantToken("c")
	before := e.lastCalls()
	if w := e.do(e.h, http.MethodPost, "/v1/locks/c/extend", `{"ttl_ms":5000}`, LockTokenHeader, gc); w.Code != http.StatusOK {
		t.Fatalf("extend = %d %s", w.Code, w.Body)
	}
	e.now = e.now.Add(2 * time.Second)
	if code := release("c", gc); code != http.StatusNoContent {
		t.Fatalf("release = %d", code)
	}
	if m := lastReleased(); m["owner"] != "erin" {
		t.Errorf("release audit line = %v; want owner erin", m)
	}
	if n := e.lastCalls(); n != before {
		t.Errorf("the store was asked for an extended grant")
	}

	for _, tok := range []string{g.LockToken, gc} {
		if strings.Contains(e.logs.String(), tok) {
			t.Fatal("the log contains a lock token")
		}
	}
}

// TestLockTokenInPath: a client that put the lock token in the path (its
// arguments swapped) gets a 400 that acts on nothing, and the token is kept
// out of the log and the problem (the path shows it redacted).
func TestLockTokenInPath(t *testing.T) {
	t.Parallel()
	e := newFakeEnv(t, false)
	g := e.acquire(t, e.h, "orders", `{"ttl_ms":30000}`)
	tok := g.LockToken
	for _, tc := range []struct {
		name, method, target, body string
		hdr                        []string
	}{
		{"ReleaseNoHeader", http.MethodDelete, "/v1/locks/" + tok, "", nil},
		{"ReleaseSwapped", http.MethodDelete, "/v1/locks/" + tok, "", []string{LockTokenHeader, "orders"}},
		{"ReleaseSame", http.MethodDelete, "/v1/locks/" + tok, "", []string{LockTokenHeader, tok}},
		{"ExtendSwapped", http.MethodPost, "/v1/locks/" + tok + "/extend", `{"ttl_ms":5000}`, []string{LockTokenHeader, "orders"}},
		{"ExtendSame", http.MethodPost, "/v1/locks/" + tok + "/extend", `{"ttl_ms":5000}`, []string{LockTokenHeader, tok}},
		{"ExtendEscaped", http.MethodPost, "/v1/locks/%" + fmt.Sprintf("%X", tok[0]) + tok[1:] + "/extend", `{}`, nil},
	} {
		w := e.do(e.h, tc.method, tc.target, tc.body, tc.hdr...)
		var p Problem
		if err := json.Unmarshal(w.Body.Bytes(), &p); err != nil || w.Code != http.StatusBadRequest {
			t.Errorf("%s: %d %s; want 400", tc.name, w.Code, w.Body)
			continue
		}
		if strings.Contains(w.Body.String(), tok) || !strings.Contains(p.Instance, "[redacted]") {
			t.Errorf("%s: the problem shows the lock token: %s", tc.name, w.Body)
		}
	}
	if strings.Contains(e.logs.String(), tok) {
		t.Errorf("the log contains the lock token:\n%s", e.logs.String())
	}
	if !strings.Contains(e.logs.String(), `"path":"/v1/locks/[redacted]"`) {
		t.Errorf("no access line with the path redacted in:\n%s", e.logs.String())
	}
	// Nothing was released or extended: the holder still releases it.
	if w := e.do(e.h, http.MethodDelete, "/v1/locks/orders", "", LockTokenHeader, tok); w.Code != http.StatusNoContent {
		t.Errorf("release by the holder = %d %s; want 204", w.Code, w.Body)
	}
	// A name shaped like a token, with a token of its own, is a name.
	other := strings.Repeat("n", 27)
	g2 := e.acquire(t, e.h, other, `{}`)
	if w := e.do(e.h, http.MethodDelete, "/v1/locks/"+other, "", LockTokenHeader, g2.LockToken); w.Code != http.StatusNoContent {
		t.Errorf("release of a 27-character name = %d %s; want 204", w.Code, w.Body)
	}
	if !strings.Contains(e.logs.String(), `"path":"/v1/locks/`+other+`"`) {
		t.Errorf("the 27-character name was redacted from the access line")
	}
}

// TestOwnLockTokenNotQuoted: a request's own lock token (its Lock-Token
// header) pasted anywhere else in it, as a field name, in any path or as
// the method, is quoted by neither the problem nor the log, and the
// request changes nothing.
func TestOwnLockTokenNotQuoted(t *testing.T) {
	t.Parallel()
	e := newFakeEnv(t, false)
	g := e.acquire(t, e.h, "orders", `{"ttl_ms":30000}`)
	tok := g.LockToken
	hdr := []string{LockTokenHeader, tok}
	key, _ := apikey.New()
	for _, tc := range []struct{ method, target, body string }{
		{http.MethodPost, "/v1/locks/orders/extend", `{"` + tok + `":1}`},
		{http.MethodPost, "/v1/locks/orders", `{"` + tok + `":1}`},
		{http.MethodPut, "/v1/locks/" + tok, ""},
		{http.MethodPatch, "/v1/locks/" + tok, ""},
		{http.MethodGet, "/v1/locks/" + tok + "/extend", ""},
		{http.MethodDelete, "/v1/locks/" + tok + "/", ""},
		{http.MethodDelete, "/v1/locks/orders/" + tok, ""},
		{http.MethodDelete, "/v1/locks/orders/" + tok + "/" + key, ""}, // and an API key
		{http.MethodGet, "/v1/nope/%" + fmt.Sprintf("%X", tok[0]) + tok[1:], ""},
		{tok, "/v1/locks/orders", ""},
		// Names that hold it are names, refused as not held: their
		// audit lines quote them too.
		{http.MethodDelete, "/v1/locks/x" + tok, ""},
		{http.MethodPost, "/v1/locks/a." + tok + "/extend", `{}`},
	} {
		w := e.do(e.h, tc.method, tc.target, tc.body, hdr...)
		if w.Code < 400 {
			t.Errorf("%.10s %s: %d; want an error", tc.method, tc.target, w.Code)
		}
		if strings.Contains(w.Body.String(), tok) {
			t.Errorf("%.10s %s %s: the problem quotes the lock token: %s", tc.method, tc.target, tc.body, w.Body)
		}
		if tc.method != tok && !strings.Contains(w.Body.String(), "[redacted]") {
			t.Errorf("%.10s %s %s: the problem does not show where the token was: %s", tc.method, tc.target, tc.body, w.Body)
		}
	}
	if strings.Contains(e.logs.String(), tok) {
		t.Errorf("the log contains the lock token:\n%s", e.logs.String())
	}
	// Nothing was released or extended: the holder still releases it.
	if w := e.do(e.h, http.MethodDelete, "/v1/locks/orders", "", hdr...); w.Code != http.StatusNoContent {
		t.Errorf("release by the holder = %d %s; want 204", w.Code, w.Body)
	}
}

// TestLockTokenPastName: a client that put the lock token in the path past
// the lock's name, as a sub-resource, or in the name's place of a path no
// route takes, and sent no Lock-Token header, gets a 404 that acts on
// nothing; the token is in neither the problem nor the log. A name shaped
// like a token on a route is still shown.
func TestLockTokenPastName(t *testing.T) {
	t.Parallel()
	e := newFakeEnv(t, false)
	g := e.acquire(t, e.h, "orders", `{"ttl_ms":30000}`)
	tok := g.LockToken
	tok2 := e.acquire(t, e.h, "other", `{"ttl_ms":30000}`).LockToken
	key, _ := apikey.New()
	for _, tc := range []struct{ method, target, body string }{
		{http.MethodDelete, "/v1/locks/orders/" + tok, ""},
		{http.MethodPost, "/v1/locks/orders/" + tok + "/extend", `{"ttl_ms":5000}`},
		{http.MethodPost, "/v1/locks/orders/extend/" + tok, `{"ttl_ms":5000}`},
		{http.MethodGet, "/v1/locks/orders/" + tok, ""},
		{http.MethodDelete, "/v1/locks/orders/%" + fmt.Sprintf("%X", tok[0]) + tok[1:], ""},
		// In the name's place, on a path no route takes.
		{http.MethodDelete, "/v1/locks/" + tok + "/", ""},
		{http.MethodPost, "/v1/locks/" + tok + "/extend/", `{}`},
		// With another token spelt partly percent-encoded, or an API key.
		{http.MethodDelete, "/v1/locks/orders/" + tok + "/%" + fmt.Sprintf("%X", tok2[0]) + tok2[1:], ""},
		{http.MethodDelete, "/v1/locks/orders/" + tok + "/" + key[:20] + "%" + fmt.Sprintf("%X", key[20]) + key[21:], ""},
		{http.MethodDelete, "/v1/locks/orders/" + tok + "/" + key, ""},
	} {
		w := e.do(e.h, tc.method, tc.target, tc.body)
		if w.Code != http.StatusNotFound {
			t.Errorf("%s %s: %d %s; want 404", tc.method, tc.target, w.Code, w.Body)
		}
		if strings.Contains(w.Body.String(), tok) || strings.Contains(w.Body.String(), tok2) ||
			strings.Contains(w.Body.String(), key[20:]) || !strings.Contains(w.Body.String(), "[redacted]") {
			t.Errorf("%s %s: the problem shows a lock token or the key, or not where it was: %s", tc.method, tc.target, w.Body)
		}
	}
	for _, secret := range []string{tok, tok2, key[20:]} {
		if strings.Contains(e.logs.String(), secret) {
			t.Errorf("the log contains %q:\n%s", secret, e.logs.String())
		}
	}
	// Nothing was released or extended: the holder still releases it.
	if w := e.do(e.h, http.MethodDelete, "/v1/locks/orders", "", LockTokenHeader, tok); w.Code != http.StatusNoContent {
		t.Errorf("release by the holder = %d %s; want 204", w.Code, w.Body)
	}
	other := strings.Repeat("n", 27)
	g2 := e.acquire(t, e.h, other, `{}`)
	if w := e.do(e.h, http.MethodPost, "/v1/locks/"+other+"/extend", `{}`, LockTokenHeader, g2.LockToken); w.Code != http.StatusOK {
		t.Errorf("extend of a 27-character name = %d %s; want 200", w.Code, w.Body)
	}
	if !strings.Contains(e.logs.String(), `"path":"/v1/locks/`+other+`/extend"`) {
		t.Errorf("the 27-character name was redacted from the access line of its extend")
	}
}

// TestReleaseAnswersBeforeAudit checks that a release, or a refused release
// or extend, whose audit line waits for Postgres (another server's grant)
// answers the client first, and that the next request on the connection
// does not wait either: none of them needs Postgres.
func TestReleaseAnswersBeforeAudit(t *testing.T) {
	for _, tc := range []struct {
		name, method, path string
		wrongToken         bool
		status             int
		line               string
	}{
		{"Released", http.MethodDelete, "/v1/locks/orders", false, http.StatusNoContent, "lock released"},
		{"ReleaseRefused", http.MethodDelete, "/v1/locks/orders", true, http.StatusConflict, "lock release refused"},
		{"ExtendRefused", http.MethodPost, "/v1/locks/orders/extend", true, http.StatusConflict, "lock extend refused"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newFakeEnv(t, false)
			other := NewHandler(e.l, benchFakeStore{e.l}, Options{Logger: slog.New(slog.DiscardHandler), Now: e.l.now})
			g := e.acquire(t, other, "orders", `{"owner":"bob"}`)
			gate := make(chan struct{})
			e.l.mu.Lock()
			e.l.lastGate = gate
			e.l.mu.Unlock()
			srv := httptest.NewServer(e.h)
			// One connection: the next request goes on the same one.
			srv.Client().Transport.(*http.Transport).MaxConnsPerHost = 1
			req, err := http.NewRequest(tc.method, srv.URL+tc.path, nil)
			if err != nil {
				t.Fatal(err)
			}
			token := g.LockToken
			if tc.wrongToken {
				token = strings.Repeat("A", 27) // well-formed, not the holder's
			}
			req.Header.Set(LockTokenHeader, token)
			got := make(chan int, 1)
			go func() {
				resp, err := srv.Client().Do(req)
				if err != nil {
					got <- 0
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				got <- resp.StatusCode
			}()
			select {
			case code := <-got:
				if code != tc.status {
					t.Errorf("%s %s = %d; want %d", tc.method, tc.path, code, tc.status)
				}
			case <-time.After(time.Minute): // a hang, not a speed limit: the lookup never ends while gated
				t.Errorf("the answer (%d) waited for the audit line's Postgres lookup", tc.status)
			}
			next := make(chan error, 1)
			go func() {
				resp, err := srv.Client().Get(srv.URL + "/healthz")
				if err == nil {
					resp.Body.Close()
				}
				next <- err
			}()
			select {
			case err := <-next:
				if err != nil {
					t.Error(err)
				}
			case <-time.After(time.Minute):
				t.Error("the next request on the connection waited for the audit line's Postgres lookup")
			}
			close(gate)
			srv.Close()
			e.h.Wait() // the audit line, written once the lookup ends
			ls := e.lines(t, tc.line)
			switch {
			case len(ls) != 1:
				t.Errorf("%q audit lines = %v; want one", tc.line, ls)
			case !tc.wrongToken && (ls[0]["owner"] != "bob" || ls[0]["fencing_token"] != float64(g.FencingToken)):
				t.Errorf("%q audit line = %v; want it naming bob and fencing token %d", tc.line, ls[0], g.FencingToken)
			}
		})
	}
}

func (e *fakeEnv) lastGrantToken(key string) string {
	e.l.mu.Lock()
	defer e.l.mu.Unlock()
	return e.l.held[key]
}

func TestGrantCacheBounded(t *testing.T) {
	c := newGrantCache()
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	tok := func(i int) string {
		return strings.Repeat(string(rune('A'+i%26)), 3) + strings.Repeat("x", i%7) + string(rune('a'+i%23)) + itoa(i)
	}

	c.put(tok(1), grantEntry{key: "k", owner: "o", fencing: 7, expires: now.Add(time.Second)}, now)
	if e, ok := c.get("k", tok(1), now); !ok || e.owner != "o" || e.fencing != 7 {
		t.Fatalf("get = %+v %v", e, ok)
	}
	if _, ok := c.get("other", tok(1), now); ok {
		t.Fatal("a token sent for another lock hit the cache")
	}
	if _, ok := c.get("k", tok(1), now.Add(time.Second)); ok {
		t.Fatal("an expired grant hit the cache")
	}
	if c.len() != 0 {
		t.Fatalf("the expired entry is still there")
	}

	// Live grants that are released leave nothing behind.
	for i := range 10000 {
		c.put(tok(i), grantEntry{key: "k", expires: now.Add(time.Hour)}, now)
	}
	if c.len() != 10000 {
		t.Fatalf("len = %d; want 10000", c.len())
	}
	for i := range 10000 {
		c.drop(tok(i))
	}
	if c.len() != 0 {
		t.Fatalf("len = %d after every release", c.len())
	}

	// Grants never released stay at most about twice the live ones.
	for round := range 20 {
		now = now.Add(time.Minute)
		for i := range 5000 {
			c.put(tok(round*5000+i), grantEntry{key: "k", expires: now.Add(30 * time.Second)}, now)
		}
		if n := c.len(); n > 2*5000+2*grantShards*minGrantLimit {
			t.Fatalf("round %d: %d entries for 5000 live grants", round, n)
		}
	}
}

func itoa(i int) string {
	b, _ := json.Marshal(i)
	return string(b)
}

func TestRequestIDs(t *testing.T) {
	e := newFakeEnv(t, false)
	hex16 := regexp.MustCompile(`^[0-9a-f]{16}$`)
	seen := map[string]bool{}
	for range 1000 {
		id := e.do(e.h, http.MethodGet, "/healthz", "").Header().Get(RequestIDHeader)
		if !hex16.MatchString(id) || seen[id] {
			t.Fatalf("request id %q: want 16 hex digits, unique", id)
		}
		seen[id] = true
	}
	for _, path := range []string{"/healthz", "/v1/nope"} {
		if got := e.do(e.h, http.MethodGet, path, "").Header().Get("X-Content-Type-Options"); got != "nosniff" {
			t.Errorf("GET %s: X-Content-Type-Options %q; want nosniff", path, got)
		}
	}
	other := NewHandler(e.l, benchFakeStore{e.l}, Options{}).ids.next()
	if other[:8] == e.h.ids.next()[:8] {
		t.Errorf("two Handlers share the request id prefix %s", other[:8])
	}
	for _, tc := range []struct{ sent, want string }{
		{"client-id_1.2", "client-id_1.2"},
		{strings.Repeat("a", 64), strings.Repeat("a", 64)},
		{strings.Repeat("a", 65), ""},
		{"has space", ""},
		{"ünïcode", ""},
		{benchAPIKey, ""},                   // an API key: a secret, never logged
		{"x" + benchAPIKey, ""},             // one inside the ID
		{"id." + benchAPIKey[:25], ""},      // one cut short
		{"perf_1", "perf_1"},                // "rf_" without a key id is no key
		{"rf_x", ""},                        // but an ID starting with it is refused
		{"rf_0123456789abcde", ""},          // (a key id cut short)
		{"XO-BHVUBfJCMQRnPhNlbb6nNeSU", ""}, // a lock token's shape
		{"XO-BHVUBfJCMQRnPhNlbb6nNeS", "XO-BHVUBfJCMQRnPhNlbb6nNeS"}, // 26 characters: a plain ID
		// Without the Authorization header that would give it away: an
		// API key with its prefix cut off (the id is public), and a
		// secret alone (its id is logged with every action).
		{benchAPIKey[len(apikey.Prefix):], ""},
		{"x." + benchAPIKey[len(apikey.Prefix):], ""},
		{benchAPIKey[len(benchAPIKey)-43:], ""},
		{"0123456789abcdef_retry-1", "0123456789abcdef_retry-1"}, // a span id and more: plain
	} {
		w := e.do(e.h, http.MethodPost, "/v1/locks/"+itoa(len(tc.sent))+"x", `{}`, RequestIDHeader, tc.sent)
		got := w.Header().Get(RequestIDHeader)
		if tc.want != "" && got != tc.want || tc.want == "" && !hex16.MatchString(got) {
			t.Errorf("X-Request-Id %q answered with %q", tc.sent, got)
		}
	}
	// A secret of the request inside its ID, whole or in part, is not
	// echoed (nor logged): the ID is replaced.
	token := "XO-BHVUBfJCMQRnPhNlbb6nNeSU"
	secret := benchAPIKey[len(benchAPIKey)-43:]
	for _, tc := range []struct {
		sent string
		hdr  []string
	}{
		{"x" + token, []string{LockTokenHeader, token}},
		{"req-" + token[3:12], []string{LockTokenHeader, token}},
		{"x" + secret, []string{"Authorization", "Bearer " + benchAPIKey}},
		{"id." + secret[20:30], []string{"Authorization", "Bearer " + benchAPIKey}},
	} {
		w := e.do(e.h, http.MethodDelete, "/v1/locks/rid", "", append([]string{RequestIDHeader, tc.sent}, tc.hdr...)...)
		if got := w.Header().Get(RequestIDHeader); !hex16.MatchString(got) {
			t.Errorf("X-Request-Id %q with %s %q answered with %q; want a generated ID", tc.sent, tc.hdr[0], tc.hdr[1], got)
		}
	}
	// Seven characters in common are chance, not a leak.
	w := e.do(e.h, http.MethodDelete, "/v1/locks/rid", "", RequestIDHeader, "rid-"+token[:7], LockTokenHeader, token)
	if got := w.Header().Get(RequestIDHeader); got != "rid-"+token[:7] {
		t.Errorf("X-Request-Id sharing 7 characters with the lock token answered with %q; want it kept", got)
	}
}

// TestAccessLog checks the access line: one per request, with exactly the
// fields it always had, never the principal or headers.
func TestAccessLog(t *testing.T) {
	e := newFakeEnv(t, true)
	e.do(e.h, http.MethodPost, "/v1/locks/orders", `{"owner":"w"}`, "Authorization", "Bearer "+benchAPIKey)
	e.logs = &testutil.Buffer{}
	e.h.raw = slog.NewJSONHandler(e.logs, nil)
	e.h.log = slog.New(principalLog{e.h.raw})
	w := e.do(e.h, http.MethodPost, "/v1/locks/orders", `{"owner":"w"}`, "Authorization", "Bearer "+benchAPIKey, RequestIDHeader, "rid-1")
	if w.Code != http.StatusConflict {
		t.Fatalf("acquire of a held lock = %d %s", w.Code, w.Body)
	}
	ls := e.lines(t, "http request")
	if len(ls) != 1 {
		t.Fatalf("%d access lines; want 1:\n%s", len(ls), e.logs)
	}
	m := ls[0]
	for _, k := range []string{"time", "level", "msg", "request_id", "method", "path", "route", "status", "bytes", "duration_ms", "remote"} {
		if _, ok := m[k]; !ok {
			t.Errorf("the access line lacks %s: %v", k, m)
		}
	}
	if len(m) != 11 {
		t.Errorf("the access line has %d fields; want 11: %v", len(m), m)
	}
	if m["request_id"] != "rid-1" || m["method"] != "POST" || m["path"] != "/v1/locks/orders" || m["route"] != "/v1/locks/{name}" ||
		m["status"] != float64(409) || m["bytes"] != float64(w.Body.Len()) || m["remote"] != "192.0.2.1:1234" {
		t.Errorf("access line = %v", m)
	}
	// The refusal's lines carry the principal, as before.
	for _, msg := range []string{"lock refused", "request failed"} {
		if ls := e.lines(t, msg); len(ls) != 1 || ls[0]["tenant"] != "bench" || ls[0]["key_id"] == nil {
			t.Errorf("%q lines = %v; want one, with tenant and key id", msg, ls)
		}
	}
	// Field order, as the JSON handler wrote it.
	wantOrder := `"msg":"lock refused","audit":true,"request_id":"rid-1","name":"orders","owner":"w","outcome":"lock-held","tenant":"bench","key_id":"0123456789abcdef"}`
	if !strings.Contains(e.logs.String(), wantOrder) {
		t.Errorf("no line ends %s:\n%s", wantOrder, e.logs)
	}

	// Probes that succeed are logged at debug only; a failing one at info.
	e.logs.Reset()
	for _, path := range []string{"/healthz", "/metrics"} {
		e.do(e.h, http.MethodGet, path, "", "Authorization", "Bearer "+benchAPIKey)
	}
	if ls := e.lines(t, "http request"); len(ls) != 0 {
		t.Errorf("access lines at info for successful probes: %v", ls)
	}
	if w := e.do(e.h, http.MethodGet, "/readyz", ""); w.Code != http.StatusServiceUnavailable {
		t.Fatalf("/readyz on the fake env = %d; want 503", w.Code)
	}
	if ls := e.lines(t, "http request"); len(ls) != 1 || ls[0]["route"] != "/readyz" {
		t.Errorf("access lines after a failing probe = %v; want it at info", ls)
	}
	e.logs.Reset()
	e.h.raw = slog.NewJSONHandler(e.logs, &slog.HandlerOptions{Level: slog.LevelDebug})
	e.do(e.h, http.MethodGet, "/healthz", "")
	if ls := e.lines(t, "http request"); len(ls) != 1 || ls[0]["level"] != "DEBUG" {
		t.Errorf("access lines of a probe with debug on = %v; want one at DEBUG", ls)
	}

	// QuietAccessLog: no access line at info, the audit lines stay.
	e.logs.Reset()
	e.h.raw = slog.NewJSONHandler(e.logs, nil)
	e.h.log = slog.New(principalLog{e.h.raw})
	e.h.opts.QuietAccessLog = true
	e.do(e.h, http.MethodPost, "/v1/locks/orders", `{"owner":"w"}`, "Authorization", "Bearer "+benchAPIKey)
	if ls := e.lines(t, "http request"); len(ls) != 0 {
		t.Errorf("access lines with QuietAccessLog = %v; want none at info", ls)
	}
	if ls := e.lines(t, "lock refused"); len(ls) != 1 {
		t.Errorf("audit lines with QuietAccessLog = %v; want the refusal", ls)
	}
}

// TestRefusedInputNotLogged: what a refused acquire sent in its body that
// failed validation (a long or unprintable owner, a long unknown field name)
// is not copied into the log or the answer in full, and the audit line names
// neither an owner nor a name that failed validation.
func TestRefusedInputNotLogged(t *testing.T) {
	e := newFakeEnv(t, true)
	e.logs = &testutil.Buffer{}
	e.h.raw = slog.NewJSONHandler(e.logs, nil)
	e.h.log = slog.New(principalLog{e.h.raw})
	long := strings.Repeat("s3cr3t", 100)
	for _, tc := range []struct{ path, body string }{
		{"/v1/locks/orders", `{"owner":"` + long + `"}`},
		{"/v1/locks/orders", `{"owner":"a\u0000b"}`},
		{"/v1/locks/orders", `{"` + long + `":1}`},
		{"/v1/locks/" + strings.Repeat("n", 300), `{"owner":"w"}`},
	} {
		w := e.do(e.h, http.MethodPost, tc.path, tc.body, "Authorization", "Bearer "+benchAPIKey)
		if w.Code != http.StatusBadRequest {
			t.Errorf("POST %.40s… %.40s… = %d; want 400", tc.path, tc.body, w.Code)
		}
		if strings.Contains(w.Body.String(), long) {
			t.Errorf("the answer quotes the body at length: %.200s…", w.Body)
		}
	}
	if strings.Contains(e.logs.String(), long) {
		t.Errorf("the log holds a body that failed validation:\n%.2000s", e.logs)
	}
	ls := e.lines(t, "lock refused")
	if len(ls) != 4 {
		t.Fatalf("%d lock refused lines; want 4", len(ls))
	}
	for i, l := range ls {
		// The last one's owner passed validation (its name did not: the
		// body is judged with the name), and is named.
		if want := map[bool]string{true: "w", false: ""}[i == 3]; l["owner"] != want {
			t.Errorf("audit line %d names owner %q; want %q", i, l["owner"], want)
		}
		if want := map[bool]string{true: "", false: "orders"}[i == 3]; l["name"] != want {
			t.Errorf("audit line %d names %q; want %q", i, l["name"], want)
		}
	}
}

// TestPastedKeyNotLogged: an API key pasted by mistake into a path, a field
// name, an owner or a method reaches neither the log nor an error's detail,
// invalid_params or instance with its secret, even spelt partly
// percent-encoded; the key's id, which is not secret, stays.
func TestPastedKeyNotLogged(t *testing.T) {
	e := newFakeEnv(t, true)
	e.logs = &testutil.Buffer{}
	e.h.raw = slog.NewJSONHandler(e.logs, nil)
	e.h.log = slog.New(principalLog{e.h.raw})
	key, id := apikey.New()
	secret := key[len(key)-20:]
	auth := []string{"Authorization", "Bearer " + benchAPIKey}
	for _, tc := range []struct{ method, path, body string }{
		{http.MethodPost, "/v1/locks/orders", `{"` + key + `":1}`},
		{http.MethodPut, "/v1/resources/orders", `{"fencing_token":1,"data":1,"` + key + `":1}`},
		{http.MethodPost, "/v1/locks/" + key, `{"owner":"w"}`},
		{http.MethodPost, "/v1/locks/orders", `{"owner":"` + key + `"}`},
		{http.MethodGet, "/v1/locks/" + key, ""},
		{http.MethodGet, "/v1/nope/" + key, ""},
		{http.MethodGet, "/v1/nonexistent/" + key, ""},
		{http.MethodPost, "/v1/locks/t1%20" + key, ""},
		{http.MethodPost, "/v1/locks/" + key, `{"owner":"w"}`}, // held: 409, and an error logged
		{http.MethodPut, "/v1/resources/" + key, `{"fencing_token":1,"data":1}`},
		{http.MethodPatch, "/v1/locks/" + key, ""},
		{key, "/v1/locks/x", ""},
		{http.MethodGet, "/v1/nope/" + key[:25] + "%" + fmt.Sprintf("%02X", key[25]) + key[26:], ""},
		{http.MethodGet, "/v1/nope/%72" + key[1:], ""},
	} {
		w := e.do(e.h, tc.method, tc.path, tc.body, auth...)
		var p struct {
			Detail        string         `json:"detail"`
			Instance      string         `json:"instance"`
			InvalidParams []InvalidParam `json:"invalid_params"`
		}
		if err := json.Unmarshal(w.Body.Bytes(), &p); err != nil && w.Code >= 400 {
			t.Errorf("%s %.30s…: %d %s", tc.method, tc.path, w.Code, w.Body)
		}
		if strings.Contains(p.Detail, secret) || strings.Contains(fmt.Sprint(p.InvalidParams), secret) || w.Code >= 400 && strings.Contains(w.Body.String(), secret) {
			t.Errorf("%s %.30s… %.30s…: the error quotes the key's secret: %s", tc.method, tc.path, tc.body, w.Body)
		}
		// (A prefix spelt percent-encoded, %72f_, may stay so.)
		if w.Code >= 400 && strings.Contains(tc.path, id[1:]) && !strings.Contains(p.Instance, id+"_[redacted]") {
			t.Errorf("%s %.30s…: instance %q; want the path with the key as %s_[redacted]", tc.method, tc.path, p.Instance, apikey.Prefix+id)
		}
	}
	if strings.Contains(e.logs.String(), secret) {
		t.Errorf("the log holds a pasted API key's secret:\n%s", e.logs)
	}
	if !strings.Contains(e.logs.String(), apikey.Prefix+id+"_[redacted]") {
		t.Errorf("the log does not name the pasted key by its id:\n%s", e.logs)
	}
	// A name holding a key is refused, as an owner holding one is: every
	// reader of the lock is shown its name.
	for _, tc := range []struct{ method, path, body string }{
		{http.MethodPost, "/v1/locks/" + key, `{"owner":"w"}`},
		{http.MethodPost, "/v1/locks/jobs:" + key + ":x", ""},
		{http.MethodGet, "/v1/locks/" + key, ""},
		{http.MethodPost, "/v1/locks/" + key + "/extend", `{"ttl_ms":1000}`},
		{http.MethodPut, "/v1/resources/" + key, `{"fencing_token":1,"data":1}`},
		{http.MethodGet, "/v1/resources/" + key, ""},
	} {
		hdr := append([]string{LockTokenHeader, "XO-BHVUBfJCMQRnPhNlbb6nNeSU"}, auth...)
		w := e.do(e.h, tc.method, tc.path, tc.body, hdr...)
		if w.Code != http.StatusBadRequest || !strings.Contains(w.Body.String(), "must not hold an API key") {
			t.Errorf("%s %.40s…: %d %s; want 400: the name must not hold an API key", tc.method, tc.path, w.Code, w.Body)
		}
	}

	// A key cut short is most of a secret all the same: refused as an
	// owner or a name, and redacted wherever it is quoted or logged.
	e.logs.Reset()
	cut := key[:len(key)-1] // 16 keys it can be
	cutSecret := cut[len(cut)-20:]
	for _, tc := range []struct{ method, path, body string }{
		{http.MethodPost, "/v1/locks/orders-cut", `{"owner":"` + cut + `"}`},
		{http.MethodPost, "/v1/locks/orders-cut", `{"owner":"by ` + apikey.Prefix + id + `_x"}`},
		{http.MethodPost, "/v1/locks/" + cut, ""},
		{http.MethodGet, "/v1/locks/" + key[:len(key)-10], ""},
		{http.MethodGet, "/v1/resources/x" + apikey.Prefix + id + "_a", ""},
	} {
		w := e.do(e.h, tc.method, tc.path, tc.body, auth...)
		if w.Code != http.StatusBadRequest || !strings.Contains(w.Body.String(), "must not hold an API key") {
			t.Errorf("%s %.40s… %.40s…: %d %s; want 400: must not hold an API key", tc.method, tc.path, tc.body, w.Code, w.Body)
		}
		if strings.Contains(w.Body.String(), cutSecret[:10]) {
			t.Errorf("%s %.40s…: the answer quotes the cut key's secret: %s", tc.method, tc.path, w.Body)
		}
	}
	if l := e.logs.String(); strings.Contains(l, cutSecret[:10]) || strings.Contains(l, key[len(key)-20:len(key)-10]) {
		t.Errorf("the log holds a cut-short key's secret:\n%s", l)
	}
	// A key's id alone is public, and rf_ and 16 hex digits are common
	// enough in names (perf_<commit>): accepted.
	sha := "perf_a94a8fe5ccb19ba61c4c0873d391e987982fbbd3"
	if w := e.do(e.h, http.MethodPost, "/v1/locks/"+sha, `{"owner":"`+sha+` `+apikey.Prefix+id+`"}`, auth...); w.Code != http.StatusCreated {
		t.Errorf("POST /v1/locks/%s with that owner = %d %s; want 201", sha, w.Code, w.Body)
	}
	// Spelt partly percent-encoded, a cut key is redacted whole too.
	e.logs.Reset()
	enc := cut[:25] + "%" + fmt.Sprintf("%02X", cut[25]) + cut[26:]
	w := e.do(e.h, http.MethodGet, "/v1/nope/"+enc, "", auth...)
	if strings.Contains(w.Body.String(), cut[26:36]) || strings.Contains(e.logs.String(), cut[26:36]) {
		t.Errorf("GET /v1/nope/<cut key, partly encoded>: the answer or the log quotes its secret: %s\n%s", w.Body, e.logs)
	}

	// Without its prefix (a key id, _ and a whole secret) it is the key
	// all the same, the id being public: refused as an owner or a name,
	// and redacted wherever it is quoted or logged.
	e.logs.Reset()
	bare := key[len(apikey.Prefix):]
	for _, tc := range []struct{ method, path, body string }{
		{http.MethodPost, "/v1/locks/orders-bare", `{"owner":"` + bare + `"}`},
		{http.MethodPost, "/v1/locks/orders-bare", `{"owner":"by ` + bare + `!"}`},
		{http.MethodPost, "/v1/locks/" + bare, ""},
		{http.MethodGet, "/v1/locks/jobs:" + bare, ""},
		{http.MethodPut, "/v1/resources/" + bare, `{"fencing_token":1,"data":1}`},
	} {
		w := e.do(e.h, tc.method, tc.path, tc.body, auth...)
		if w.Code != http.StatusBadRequest || !strings.Contains(w.Body.String(), "must not hold an API key") {
			t.Errorf("%s %.40s… %.40s…: %d %s; want 400: must not hold an API key", tc.method, tc.path, tc.body, w.Code, w.Body)
		}
		if strings.Contains(w.Body.String(), secret) {
			t.Errorf("%s %.40s…: the answer quotes the key's secret: %s", tc.method, tc.path, w.Body)
		}
	}
	e.do(e.h, http.MethodGet, "/v1/nope/"+bare, "", auth...)
	if l := e.logs.String(); strings.Contains(l, secret) || !strings.Contains(l, id+"_[redacted]") {
		t.Errorf("the log holds a key's secret without its prefix, or does not name it by its id:\n%s", l)
	}
}

// TestUnreadableBody: a body that cannot be read in full is refused in the
// API's words, never Go's (which name the connection's addresses): 408
// request-timeout when the server's read deadline passed, 503
// shutting-down when the server closed the connection, else a 400 that
// names the body in invalid_params, as every other 400 names what it
// refuses. The cause is logged. Nothing is acquired.
func TestUnreadableBody(t *testing.T) {
	addr := &net.TCPAddr{IP: net.IPv4(192, 0, 2, 7), Port: 18480}
	for _, tc := range []struct {
		name   string
		err    error
		status int
		slug   string
	}{
		{"EndedEarly", io.ErrUnexpectedEOF, http.StatusBadRequest, "invalid-request"},
		{"Timeout", &net.OpError{Op: "read", Net: "tcp", Source: addr, Addr: addr, Err: os.ErrDeadlineExceeded}, http.StatusRequestTimeout, "request-timeout"},
		{"Reset", &net.OpError{Op: "read", Net: "tcp", Source: addr, Addr: addr, Err: syscall.ECONNRESET}, http.StatusBadRequest, "invalid-request"},
		// The server closed the connection (its shutdown's grace ran out).
		{"ClosedByShutdown", &net.OpError{Op: "read", Net: "tcp", Source: addr, Addr: addr, Err: net.ErrClosed}, http.StatusServiceUnavailable, "shutting-down"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newFakeEnv(t, true)
			r := httptest.NewRequest(http.MethodPost, "/v1/locks/orders", io.MultiReader(strings.NewReader("{"), iotest.ErrReader(tc.err)))
			r.Header.Set("Content-Type", "application/json")
			r.Header.Set("Authorization", "Bearer "+benchAPIKey)
			w := httptest.NewRecorder()
			e.h.ServeHTTP(w, r)
			var p struct {
				Type          string         `json:"type"`
				Detail        string         `json:"detail"`
				InvalidParams []InvalidParam `json:"invalid_params"`
			}
			if err := json.Unmarshal(w.Body.Bytes(), &p); err != nil || w.Code != tc.status || p.Type != ProblemTypePrefix+tc.slug || p.Detail == "" {
				t.Fatalf("= %d %s; want %d %s", w.Code, w.Body, tc.status, tc.slug)
			}
			if tc.status == http.StatusBadRequest && (len(p.InvalidParams) != 1 || p.InvalidParams[0].Name != "body") {
				t.Errorf("= %s; want invalid_params naming body", w.Body)
			}
			if strings.Contains(w.Body.String(), addr.String()) || strings.Contains(w.Body.String(), tc.err.Error()) {
				t.Errorf("the answer quotes Go's error %q: %s", tc.err, w.Body)
			}
			if !strings.Contains(e.logs.String(), tc.err.Error()) {
				t.Errorf("the log lacks the cause %q:\n%s", tc.err, e.logs)
			}
			if g := e.do(e.h, http.MethodGet, "/v1/locks/orders", "", "Authorization", "Bearer "+benchAPIKey); g.Code != http.StatusOK || !strings.Contains(g.Body.String(), `"held":false`) {
				t.Errorf("GET after the refused acquire = %d %s; want not held", g.Code, g.Body)
			}
		})
	}
}

// TestFastRoute sends the same requests to a Handler as they come (acquire
// and release skip the router) and through the router (forced by a route
// context in the request's context, as when the Handler is mounted in
// another chi router), and compares the answers, the log and the metrics.
func TestFastRoute(t *testing.T) {
	paths := []string{
		"/v1/locks/x", "/v1/locks/orders:invoice-7", "/v1/locks/", "/v1/locks", "/v1/locks/x/", "/v1/locks/x/extend",
		"/v1/locks//x", "/v1/locks/a%2Fb", "/v1/locks/100%25", "/v1/locks/%C3%A9t%C3%A9", "/v1/locks/a%20b", "/v1/locks/%41", "/v1/locks/a%2541",
		"/v1/locks/..", "/v1/locks/.", "/v1/lockss/x", "/V1/locks/x", "/v1/locks/x?ttl=1", "/v1/locks/x?", "/v1/locks/" + strings.Repeat("n", 201),
		"/v1/locks/bad!name", "/v1/resources/x", "/healthz", "/nope", "/v1/locks/x#f",
	}
	methods := []string{http.MethodPost, http.MethodDelete, http.MethodGet, http.MethodPut, http.MethodPatch, "post", "delete", "FOO"}
	for _, auth := range []bool{false, true} {
		fast, routed := newFakeEnv(t, auth), newFakeEnv(t, auth)
		forced := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			routed.h.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), chi.RouteCtxKey, chi.NewRouteContext())))
		})
		var hdr []string
		if auth {
			hdr = []string{"Authorization", "Bearer " + benchAPIKey}
		}
		token := "AAAAAAAAAAAAAAAAAAAAAAAAAAA"
		n := 0
		for _, p := range paths {
			for _, m := range methods {
				for _, body := range []string{"", `{"ttl_ms":30000,"owner":"w"}`, `{"ttl_ms":"x"}`} {
					n++
					h := append([]string{RequestIDHeader, "req-" + itoa(n), LockTokenHeader, token}, hdr...)
					a := fast.do(fast.h, m, p, body, h...)
					want := routed.do(forced, m, p, body, h...)
					if a.Code != want.Code || !bytes.Equal(a.Body.Bytes(), want.Body.Bytes()) || !sameHeaders(a.Header(), want.Header()) {
						t.Fatalf("%s %s %q (auth %v):\nfast   %d %v %s\nrouted %d %v %s", m, p, body, auth,
							a.Code, a.Header(), a.Body, want.Code, want.Header(), want.Body)
					}
					if a.Code == http.StatusCreated {
						var g LockResponse
						_ = json.Unmarshal(a.Body.Bytes(), &g)
						token = g.LockToken
					}
				}
			}
			// Refused before routing (431): "unmatched" either way.
			big := []string{RequestIDHeader, "big", "X-Big", strings.Repeat("b", 70<<10)}
			if a, want := fast.do(fast.h, http.MethodPost, p, "", big...), routed.do(forced, http.MethodPost, p, "", big...); a.Code != http.StatusRequestHeaderFieldsTooLarge || a.Body.String() != want.Body.String() {
				t.Fatalf("POST %s with big headers: %d %s; routed %d %s", p, a.Code, a.Body, want.Code, want.Body)
			}
			if routeDecision(t, fast.h, p) && !strings.HasPrefix(p, "/v1/locks/") {
				t.Fatalf("%s skipped the router", p)
			}
		}
		// The same lines; an audit line that waited for its grant's lookup
		// may come after its request's access line.
		if la, lb := sortedLines(stripTimes(fast.logs.String())), sortedLines(stripTimes(routed.logs.String())); la == "" || la != lb {
			t.Errorf("auth %v: the logs differ:\nfast:\n%s\nrouted:\n%s", auth, la, lb)
		}
		if ma, mb := metricsText(t, fast.reg), metricsText(t, routed.reg); ma != mb {
			t.Errorf("auth %v: the metrics differ:\nfast:\n%s\nrouted:\n%s", auth, ma, mb)
		}
	}
}

// routeDecision reports whether a POST to p skips the router, and checks the
// router would have sent it to the same handler with the same name.
func routeDecision(t *testing.T, h *Handler, p string) bool {
	t.Helper()
	r := httptest.NewRequest(http.MethodPost, p, nil)
	next, name := h.fastRoute(r)
	rctx := chi.NewRouteContext()
	path := r.URL.RawPath
	if path == "" {
		path = r.URL.Path
	}
	matched := h.router.Match(rctx, http.MethodPost, path)
	if next != nil && (!matched || rctx.RoutePattern() != lockRoute || rctx.URLParam("name") != name) {
		t.Fatalf("%s skips the router as {name} %q; the router: matched %v, %s, name %q", p, name, matched, rctx.RoutePattern(), rctx.URLParam("name"))
	}
	return next != nil
}

func sameHeaders(a, b http.Header) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if strings.Join(v, "\x00") != strings.Join(b[k], "\x00") {
			return false
		}
	}
	return true
}

var timesRE = regexp.MustCompile(`"time":"[^"]*",|"duration_ms":[0-9.e-]+,`)

func stripTimes(s string) string { return timesRE.ReplaceAllString(s, "") }

// sortedLines returns s's lines in sorted order.
func sortedLines(s string) string {
	ls := strings.SplitAfter(s, "\n")
	slices.Sort(ls)
	return strings.Join(ls, "")
}

func metricsText(t *testing.T, reg *prometheus.Registry) string {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, f := range fams {
		if !strings.HasPrefix(f.GetName(), "redfence_") {
			continue
		}
		for _, m := range f.GetMetric() {
			b.WriteString(f.GetName())
			for _, l := range m.GetLabel() {
				b.WriteString(" " + l.GetName() + "=" + l.GetValue())
			}
			if c := m.GetCounter(); c != nil {
				b.WriteString(" " + itoa(int(c.GetValue())))
			}
			if h := m.GetHistogram(); h != nil {
				b.WriteString(" count " + itoa(int(h.GetSampleCount())))
			}
			b.WriteString("\n")
		}
	}
	return b.String()
}

// TestMetricsCached checks that the cached series count what
// WithLabelValues would, and that made-up methods, which anyone can send
// without a key, share the method label "other" instead of adding series.
func TestMetricsCached(t *testing.T) {
	e := newFakeEnv(t, false)
	for range 5 {
		g := e.acquire(t, e.h, "orders", `{}`)
		e.do(e.h, http.MethodDelete, "/v1/locks/orders", "", LockTokenHeader, g.LockToken)
	}
	e.do(e.h, http.MethodDelete, "/v1/locks/orders", "", LockTokenHeader, "AAAAAAAAAAAAAAAAAAAAAAAAAAA")
	for i := range 20 {
		e.do(e.h, "M"+itoa(i), "/nowhere", "")
	}
	m := e.h.m
	for _, tc := range []struct {
		c    prometheus.Collector
		want float64
	}{
		{m.requests.WithLabelValues(lockRoute, "POST", "201"), 5},
		{m.requests.WithLabelValues(lockRoute, "DELETE", "204"), 5},
		{m.requests.WithLabelValues(lockRoute, "DELETE", "409"), 1},
		{m.requests.WithLabelValues("unmatched", "other", "404"), 20},
		{m.acquisitions.WithLabelValues("granted"), 5},
		{m.releases.WithLabelValues("released"), 5},
		{m.releases.WithLabelValues("not-holder"), 1},
	} {
		if got := promtest.ToFloat64(tc.c); got != tc.want {
			t.Errorf("%v = %v; want %v", tc.c, got, tc.want)
		}
	}
	if got := promtest.CollectAndCount(m.requestSeconds); got != 2+1 {
		t.Errorf("%d latency series; want 3 (POST and DELETE on the lock route, other on none)", got)
	}
	if got := promtest.CollectAndCount(m.requests); got != 4 {
		t.Errorf("%d request series; want 4", got)
	}
	if mp := m.http.m.Load(); mp == nil || len(*mp) != 4 {
		t.Errorf("the request series cache holds %v; want the 4 series", mp)
	}
}

// panicLocker panics in Acquire, with v.
type panicLocker struct {
	*benchFakeLocker
	v any
}

func (p panicLocker) Acquire(context.Context, string, service.Request) (*service.Grant, error) {
	panic(p.v)
}

// TestPanic checks that a panic in a handler becomes a logged 500 problem
// (without an access line), on both ways to the handler, and that
// http.ErrAbortHandler goes through.
func TestPanic(t *testing.T) {
	logs := &testutil.Buffer{}
	h := NewHandler(panicLocker{newBenchFakeLocker(), "boom"}, nil, Options{Logger: slog.New(slog.NewJSONHandler(logs, nil))})
	for _, route := range []string{"fast", "router"} {
		r := httptest.NewRequest(http.MethodPost, "/v1/locks/x", nil)
		if route == "router" {
			r = r.WithContext(context.WithValue(r.Context(), chi.RouteCtxKey, chi.NewRouteContext()))
		}
		r.Header.Set(RequestIDHeader, "p-"+route)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != http.StatusInternalServerError || w.Header().Get("Content-Type") != "application/problem+json" ||
			!strings.Contains(w.Body.String(), `"type":"urn:redfence:problem:internal-error"`) || !strings.Contains(w.Body.String(), `"request_id":"p-`+route+`"`) {
			t.Errorf("%s: panic answered %d %v %s", route, w.Code, w.Header(), w.Body)
		}
	}
	if n := strings.Count(logs.String(), `"msg":"panic"`); n != 2 || !strings.Contains(logs.String(), `"panic":"boom"`) {
		t.Errorf("%d panic lines:\n%s", n, logs)
	}
	if strings.Contains(logs.String(), `"msg":"http request"`) {
		t.Errorf("an access line for a panic:\n%s", logs)
	}

	h = NewHandler(panicLocker{newBenchFakeLocker(), http.ErrAbortHandler}, nil, Options{})
	defer func() {
		if v := recover(); v != http.ErrAbortHandler {
			t.Errorf("recovered %v; want http.ErrAbortHandler", v)
		}
	}()
	h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodPost, "/v1/locks/x", nil))
	t.Error("http.ErrAbortHandler did not go through")
}

// TestValidity_CountsFromArrival: a grant that took long to come (a wait)
// reports its lease as the client counts it, from its send time: validity_ms
// runs from when the request arrived, not from when the answer left, so a
// client following the contract does not find the lease already over.
func TestValidity_CountsFromArrival(t *testing.T) {
	t.Parallel()
	e := newFakeEnv(t, false)
	const took = 5 * time.Second
	e.l.taking = func() { e.now = e.now.Add(took) }
	g := e.acquire(t, e.h, "slow", `{"ttl_ms":10000,"wait_ms":30000}`)
	// The fake's lease: from the end of the wait, ttl minus 2 ms of drift.
	if want := (took + 10*time.Second - 2*time.Millisecond).Milliseconds(); g.ValidityMS != want {
		t.Errorf("acquire after a %v wait: validity_ms %d; want %d (counted from the request's arrival)", took, g.ValidityMS, want)
	}
	w := e.do(e.h, http.MethodPost, "/v1/locks/slow/extend", `{"ttl_ms":10000}`, LockTokenHeader, g.LockToken)
	var x LockResponse
	if err := json.Unmarshal(w.Body.Bytes(), &x); err != nil || w.Code != http.StatusOK {
		t.Fatalf("extend = %d %s", w.Code, w.Body)
	}
	if want := (took + 10*time.Second - 2*time.Millisecond).Milliseconds(); x.ValidityMS != want {
		t.Errorf("extend that took %v: validity_ms %d; want %d", took, x.ValidityMS, want)
	}
}

// TestHead: HEAD is answered wherever GET is, with GET's status and
// headers and no body (RFC 9110 §9.3.2); elsewhere it is 405.
func TestHead(t *testing.T) {
	t.Parallel()
	e := newFakeEnv(t, false)
	e.acquire(t, e.h, "x", `{"ttl_ms":30000}`)
	for _, p := range []string{"/healthz", "/readyz", "/openapi.yaml", "/metrics", "/v1/locks/x", "/v1/locks/bad!", "/v1/resources/x", "/v1/nodes"} {
		// Through a real server: net/http drops a HEAD answer's body there.
		srv := httptest.NewServer(e.h)
		get, err := http.Get(srv.URL + p)
		if err != nil {
			t.Fatal(err)
		}
		get.Body.Close()
		head, err := http.Head(srv.URL + p)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(head.Body)
		head.Body.Close()
		srv.Close()
		if head.StatusCode != get.StatusCode || len(body) != 0 || head.Header.Get("Content-Type") != get.Header.Get("Content-Type") {
			t.Errorf("HEAD %s = %d %q (%d body bytes); GET = %d %q; want the same, without a body",
				p, head.StatusCode, head.Header.Get("Content-Type"), len(body), get.StatusCode, get.Header.Get("Content-Type"))
		}
	}
	if !strings.Contains(e.logs.String(), `"method":"HEAD","path":"/v1/locks/x","route":"/v1/locks/{name}","status":200,"bytes":0,`) {
		t.Errorf("no access line for HEAD /v1/locks/x with bytes 0 in:\n%s", e.logs.String())
	}
	w := e.do(e.h, http.MethodHead, "/v1/locks/x/extend", "")
	if w.Code != http.StatusMethodNotAllowed || w.Header().Get("Allow") != "POST" {
		t.Errorf("HEAD /v1/locks/x/extend = %d, Allow %q; want 405, Allow POST", w.Code, w.Header().Get("Allow"))
	}
	// A HEAD answer's Content-Length is the GET's (RFC 9110 §8.6), even
	// where both are refused: the problem a HEAD is not sent is the GET's.
	hdr := []string{"X-Request-Id", "same-id"}
	get, head := e.do(e.h, http.MethodGet, "/v1/locks/x/extend", "", hdr...), e.do(e.h, http.MethodHead, "/v1/locks/x/extend", "", hdr...)
	if get.Header().Get("Content-Length") == "" || head.Header().Get("Content-Length") != get.Header().Get("Content-Length") {
		t.Errorf("HEAD /v1/locks/x/extend: Content-Length %q; GET's %q (%s); want the same",
			head.Header().Get("Content-Length"), get.Header().Get("Content-Length"), get.Body)
	}
	if w := e.do(e.h, http.MethodPut, "/v1/locks/x", ""); w.Header().Get("Allow") != "GET, HEAD, POST, DELETE" {
		t.Errorf("PUT /v1/locks/x: Allow %q; want GET, HEAD, POST, DELETE", w.Header().Get("Allow"))
	}
}

// TestMethodNotAllowed: a method a route does not serve answers 405 with
// the route's methods in Allow; a path that serves no method (whatever the
// method, even one chi does not know) answers 404.
func TestMethodNotAllowed(t *testing.T) {
	t.Parallel()
	e := newFakeEnv(t, false)
	for _, tc := range []struct {
		method, path string
		status       int
		allow        string
	}{
		{"FOO", "/v1/locks/x", 405, "GET, HEAD, POST, DELETE"},
		{"PROPFIND", "/v1/locks/x/extend", 405, "POST"},
		{http.MethodPost, "/v1/nodes", 405, "GET, HEAD"},
		{http.MethodDelete, "/v1/resources/x", 405, "GET, HEAD, PUT"},
		{"FOO", "/healthz", 405, "GET, HEAD"},
		{"FOO", "/nope", 404, ""},
		{"FOO", "/", 404, ""},
		{"FOO", "/v1", 404, ""},
		{"FOO", "/v1/", 404, ""},
		{http.MethodPut, "/v1", 404, ""},
		{http.MethodGet, "/v1", 404, ""},
		{"FOO", "/v1/locks", 404, ""},
		{"PROPFIND", "/v1/locks/x/y/z", 404, ""},
	} {
		w := e.do(e.h, tc.method, tc.path, "")
		if w.Code != tc.status || w.Header().Get("Allow") != tc.allow || w.Header().Get("Content-Type") != "application/problem+json" {
			t.Errorf("%s %s = %d, Allow %q, %s; want %d, Allow %q, a problem", tc.method, tc.path, w.Code, w.Header().Get("Allow"), w.Header().Get("Content-Type"), tc.status, tc.allow)
		}
	}
}

// TestBodyTooLarge checks both ways a body can exceed the limit: a declared
// Content-Length is refused before a byte of the body is read (a client
// that asked Expect: 100-continue is not told to upload), a chunked body
// once the limit is passed.
func TestBodyTooLarge(t *testing.T) {
	const limit = 1 << 20 // the default MaxBodyBytes
	e := newFakeEnv(t, false)
	srv := httptest.NewServer(e.h)
	t.Cleanup(srv.Close)

	conn, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST /v1/locks/big HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"+
		"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n", limit+1)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Errorf("POST declaring %d bytes with Expect: 100-continue = %d; want 413 at once, before any upload",
			limit+1, resp.StatusCode)
	}

	body := `{"owner":"` + strings.Repeat("x", limit) + `"}`
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/locks/big", io.MultiReader(strings.NewReader(body))) // no length: chunked
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err = srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Errorf("chunked POST of %d bytes = %d; want 413", len(body), resp.StatusCode)
	}
	if w := e.do(e.h, http.MethodGet, "/v1/locks/big", ""); !strings.Contains(w.Body.String(), `"held":false`) {
		t.Errorf("GET /v1/locks/big after the refusals = %d %s; want not held", w.Code, w.Body)
	}
}

// TestMediaTypeRefusedUnread: a body declared non-empty (Content-Length)
// whose Content-Encoding or Content-Type the server refuses is refused
// before a byte of it is read, as one above the size limit is: a client
// that sent Expect: 100-continue gets the 415 instead of being told to
// upload it. Nothing is taken or written.
func TestMediaTypeRefusedUnread(t *testing.T) {
	e := newFakeEnv(t, false)
	srv := httptest.NewServer(e.h)
	t.Cleanup(srv.Close)
	for _, tc := range []struct {
		method, path, body, hdr string
		identity                bool
	}{
		{http.MethodPost, "/v1/locks/mt", `{"ttl_ms":1000}`, "Content-Type: text/plain", false},
		{http.MethodPost, "/v1/locks/mt", `{"ttl_ms":1000}`, "Content-Type: application/json\r\nContent-Encoding: gzip", true},
		{http.MethodPost, "/v1/locks/mt/extend", `{"ttl_ms":1000}`, "Content-Type: application/json; charset=latin1\r\nLock-Token: " + strings.Repeat("A", lockTokenLen), false},
		{http.MethodPut, "/v1/resources/mt", `{"fencing_token":1,"data":1}`, "Content-Type: application/xml", false},
	} {
		conn, err := net.Dial("tcp", srv.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(conn, "%s %s HTTP/1.1\r\nHost: x\r\n%s\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n",
			tc.method, tc.path, tc.hdr, len(tc.body))
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		conn.Close()
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnsupportedMediaType || (resp.Header.Get("Accept-Encoding") == "identity") != tc.identity {
			t.Errorf("%s %s (%q) with Expect: 100-continue = %d, Accept-Encoding %q; want 415 at once, before any upload",
				tc.method, tc.path, tc.hdr, resp.StatusCode, resp.Header.Get("Accept-Encoding"))
		}
	}
	if w := e.do(e.h, http.MethodGet, "/v1/locks/mt", ""); !strings.Contains(w.Body.String(), `"held":false`) {
		t.Errorf("GET /v1/locks/mt after the refusals = %d %s; want not held", w.Code, w.Body)
	}
	if w := e.do(e.h, http.MethodGet, "/v1/resources/mt", ""); w.Code != http.StatusNotFound {
		t.Errorf("GET /v1/resources/mt after the refusals = %d %s; want 404", w.Code, w.Body)
	}
}

// TestLongPathCut: a problem and the access line quote a path over
// maxShownPath cut there, never through a %XX escape, whatever the status.
func TestLongPathCut(t *testing.T) {
	e := newFakeEnv(t, false)
	big := []string{"X-Big", strings.Repeat("b", 70<<10)}
	for _, tc := range []struct {
		path   string
		status int
		hdr    []string
	}{
		{"/v1/locks/" + strings.Repeat("a", 3000), http.StatusBadRequest, nil},     // name too long
		{"/nowhere/" + strings.Repeat("a", 3000), http.StatusNotFound, nil},        // no route
		{"/v1/locks/" + strings.Repeat("%41", 1000), http.StatusBadRequest, nil},   // cut before an escape
		{"/v1/locks/x" + strings.Repeat("%41", 1000), http.StatusBadRequest, nil},  // the other offset
		{"/v1/locks/xy" + strings.Repeat("%41", 1000), http.StatusBadRequest, nil}, // and the third
		{"/v1/locks/" + strings.Repeat("c", 3000), http.StatusRequestHeaderFieldsTooLarge, big},
		{"/v1/locks/" + strings.Repeat("d", maxShownPath-10), http.StatusBadRequest, nil}, // short enough: whole
	} {
		e.logs.Reset()
		w := e.do(e.h, http.MethodPost, tc.path, "", tc.hdr...)
		var p Problem
		if err := json.Unmarshal(w.Body.Bytes(), &p); err != nil || w.Code != tc.status {
			t.Fatalf("POST %.40s... = %d %.200s; want %d problem", tc.path, w.Code, w.Body, tc.status)
		}
		lines := e.lines(t, "http request")
		if len(lines) != 1 {
			t.Fatalf("%d access lines; want 1", len(lines))
		}
		for what, got := range map[string]string{"instance": p.Instance, "access line's path": fmt.Sprint(lines[0]["path"])} {
			if len(tc.path) <= maxShownPath {
				if got != tc.path {
					t.Errorf("%s %q; want the whole path", what, got)
				}
				continue
			}
			cut, ok := strings.CutSuffix(got, "...")
			if !ok || len(cut) > maxShownPath || len(cut) < maxShownPath-2 || !strings.HasPrefix(tc.path, cut) {
				t.Errorf("%s %.60s... (%d bytes); want the path's first %d bytes or fewer, then ...", what, got, len(got), maxShownPath)
			}
			if i := strings.LastIndexByte(cut, '%'); i >= 0 && i > len(cut)-3 {
				t.Errorf("%s ends in a split escape: ...%s", what, cut[i:])
			}
		}
	}
}

// TestLongMethodCut: a 405's detail and the access line quote a method
// over maxShownPath cut there, as a path is, not whole (up to the header
// limit).
func TestLongMethodCut(t *testing.T) {
	e := newFakeEnv(t, false)
	for _, method := range []string{strings.Repeat("M", 3000), strings.Repeat("N", maxShownPath)} {
		e.logs.Reset()
		w := e.do(e.h, method, "/healthz", "")
		var p Problem
		if err := json.Unmarshal(w.Body.Bytes(), &p); err != nil || w.Code != http.StatusMethodNotAllowed {
			t.Fatalf("%.20s... /healthz = %d %.200s; want a 405 problem", method, w.Code, w.Body)
		}
		lines := e.lines(t, "http request")
		if len(lines) != 1 {
			t.Fatalf("%d access lines; want 1", len(lines))
		}
		shown, _, _ := strings.Cut(p.Detail, " is not allowed here")
		want := method
		if len(method) > maxShownPath {
			want = method[:maxShownPath] + "..."
		}
		for what, got := range map[string]string{"detail": shown, "access line's method": fmt.Sprint(lines[0]["method"])} {
			if got != want {
				t.Errorf("%s quotes the %d-byte method as %.30s... (%d bytes); want %d bytes", what, len(method), got, len(got), len(want))
			}
		}
	}
}

// TestAcceptNotNegotiated: an answer is JSON, or a problem, whatever
// Accept lists (no 406), as README and openapi.yaml say; only /metrics
// picks its format by Accept.
func TestAcceptNotNegotiated(t *testing.T) {
	e := newFakeEnv(t, false)
	for _, accept := range []string{"text/html", "application/xml", "application/json;q=0", "*/*;q=0"} {
		for _, tc := range []struct {
			path, ct string
			status   int
		}{
			{"/v1/locks/x", "application/json", http.StatusOK},
			{"/v1/locks/bad!", "application/problem+json", http.StatusBadRequest},
			{"/nope", "application/problem+json", http.StatusNotFound},
		} {
			w := e.do(e.h, http.MethodGet, tc.path, "", "Accept", accept)
			if w.Code != tc.status || w.Header().Get("Content-Type") != tc.ct {
				t.Errorf("GET %s, Accept %q = %d %q; want %d %q", tc.path, accept, w.Code, w.Header().Get("Content-Type"), tc.status, tc.ct)
			}
		}
	}
	w := e.do(e.h, http.MethodGet, "/metrics", "", "Accept", "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited")
	if !strings.HasPrefix(w.Header().Get("Content-Type"), "application/vnd.google.protobuf") {
		t.Errorf("GET /metrics asking for protobuf: Content-Type %q; want protobuf", w.Header().Get("Content-Type"))
	}
}

// TestEmptyNameNotFound: a {name} route with an empty name is a path no
// operation serves: 404 not-found, before authorization and before the
// body is looked at, labelled unmatched in the log.
func TestEmptyNameNotFound(t *testing.T) {
	e := newFakeEnv(t, true)
	for _, tc := range []struct{ method, path, body string }{
		{http.MethodPost, "/v1/locks//extend", ""},
		{http.MethodPost, "/v1/locks//extend", `{"ttl_ms":"x"}`},
		{http.MethodGet, "/v1/locks/", ""},
		{http.MethodPut, "/v1/resources/", `{}`},
		// Other methods too: not a 405 whose Allow names a method that
		// would be answered 404.
		{http.MethodGet, "/v1/locks//extend", ""},
		{http.MethodPut, "/v1/locks//extend", `{}`},
		{http.MethodPatch, "/v1/locks/", `{}`},
		{http.MethodPost, "/v1/resources/", `{}`},
	} {
		e.logs.Reset()
		w := e.do(e.h, tc.method, tc.path, tc.body) // no API key
		if w.Code != http.StatusNotFound || !strings.Contains(w.Body.String(), "not-found") {
			t.Errorf("%s %s = %d %s; want 404 not-found", tc.method, tc.path, w.Code, w.Body)
		}
		if ls := e.lines(t, "http request"); len(ls) != 1 || ls[0]["route"] != "unmatched" {
			t.Errorf("%s %s: access lines %v; want one, route unmatched", tc.method, tc.path, ls)
		}
	}
}

// TestUnready: after Unready, /readyz answers 503 shutting-down (with
// Retry-After) while every other request is served as before.
func TestUnready(t *testing.T) {
	t.Parallel()
	e := newFakeEnv(t, false)
	e.h.Unready()
	w := e.do(e.h, http.MethodGet, "/readyz", "")
	if w.Code != http.StatusServiceUnavailable || !strings.Contains(w.Body.String(), `"status":"shutting-down"`) || w.Header().Get("Retry-After") == "" {
		t.Errorf("/readyz after Unready = %d %s (Retry-After %q); want 503 shutting-down with Retry-After", w.Code, w.Body, w.Header().Get("Retry-After"))
	}
	if w := e.do(e.h, http.MethodGet, "/healthz", ""); w.Code != http.StatusOK {
		t.Errorf("/healthz after Unready = %d", w.Code)
	}
	e.acquire(t, e.h, "still-served", `{}`)
}

// gatedNodes is a Locker whose Nodes counts its calls and waits for gate or
// for its context to end, as a real one's would. A check cut short reports
// the node down, and sends its context's error to ended if that is set.
type gatedNodes struct {
	*benchFakeLocker
	calls   atomic.Int32
	entered chan struct{}
	gate    chan struct{}
	ended   chan error
}

func (g *gatedNodes) Nodes(ctx context.Context) []service.NodeStatus {
	g.calls.Add(1)
	g.entered <- struct{}{}
	select {
	case <-g.gate:
	case <-ctx.Done():
	}
	if g.ended != nil {
		g.ended <- ctx.Err()
	}
	return []service.NodeStatus{{Addr: "a", Up: ctx.Err() == nil}}
}

// pingCtxStore is a store whose Ping fails once its context ended, as
// pgxpool's does.
type pingCtxStore struct{ benchFakeStore }

func (pingCtxStore) Ping(ctx context.Context) error { return ctx.Err() }

func (g *gatedNodes) Quorum() int { return 1 }

// TestReadyzShared: concurrent /readyz requests share one check of the
// backends (a flood of unauthenticated probes asks them one at a time),
// and a client that leaves does not cut short the check others wait for.
func TestReadyzShared(t *testing.T) {
	g := &gatedNodes{benchFakeLocker: newBenchFakeLocker(), entered: make(chan struct{}, 8), gate: make(chan struct{})}
	h := NewHandler(g, benchFakeStore{g.benchFakeLocker}, Options{Registry: prometheus.NewRegistry()})
	const n = 5
	joined := make(chan struct{}, n)
	h.readyJoined = func() { joined <- struct{}{} }

	leaving, leave := context.WithCancel(t.Context())
	first := make(chan int, 1)
	go func() {
		r := httptest.NewRequest(http.MethodGet, "/readyz", nil).WithContext(leaving)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		first <- w.Code
	}()
	<-g.entered // the first request's check is running
	<-joined
	codes := make(chan *httptest.ResponseRecorder, n)
	for range n - 1 {
		go func() {
			w := httptest.NewRecorder()
			h.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/readyz", nil))
			codes <- w
		}()
	}
	for range n - 1 {
		<-joined
	}
	leave() // the client that started the check leaves
	if code := <-first; code == http.StatusOK {
		t.Errorf("the client that left got %d; want a problem", code)
	}
	close(g.gate)
	for range n - 1 {
		if w := <-codes; w.Code != http.StatusOK || !strings.Contains(w.Body.String(), `"status":"ready"`) {
			t.Errorf("/readyz = %d %s; want 200 ready", w.Code, w.Body)
		}
	}
	if c := g.calls.Load(); c != 1 {
		t.Errorf("%d checks of the nodes for %d concurrent /readyz; want 1", c, n)
	}
	// A later request runs a check of its own.
	g.entered = make(chan struct{}, 8)
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/readyz", nil))
	if w.Code != http.StatusOK || g.calls.Load() != 2 {
		t.Errorf("a later /readyz = %d after %d checks; want 200 after 2", w.Code, g.calls.Load())
	}
}

// TestReadyzAbandoned: a check every waiter of which left (a probe that
// timed out) is ended, without logging Postgres down for the ping it cut
// short, and not joined by the next request, whose answer must come from a
// check that began after it was sent.
func TestReadyzAbandoned(t *testing.T) {
	g := &gatedNodes{benchFakeLocker: newBenchFakeLocker(), entered: make(chan struct{}, 8), gate: make(chan struct{}),
		ended: make(chan error, 2)}
	var logs testutil.Buffer
	h := NewHandler(g, pingCtxStore{benchFakeStore{g.benchFakeLocker}}, Options{Registry: prometheus.NewRegistry(),
		Logger: slog.New(slog.NewJSONHandler(&logs, nil))})
	joined := make(chan struct{}, 2)
	h.readyJoined = func() { joined <- struct{}{} }
	leaving, leave := context.WithCancel(t.Context())
	first := make(chan int, 1)
	go func() {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/readyz", nil).WithContext(leaving))
		first <- w.Code
	}()
	<-g.entered // its check is running
	h.ready.mu.Lock()
	run := h.ready.run
	h.ready.mu.Unlock()
	leave()
	if code := <-first; code == http.StatusOK {
		t.Fatalf("the probe that left got %d; want a problem", code)
	}
	select { // before the gate opens: only the end of its context ends the check
	case err := <-g.ended:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("the abandoned check's context: %v; want it cancelled", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the abandoned check was not ended after 30s")
	}
	<-run.done
	if l := logs.String(); strings.Contains(l, "postgres down") || !strings.Contains(l, "every probe left before postgres answered") {
		t.Errorf("the abandoned check logged Postgres down, or not that its probes left:\n%s", l)
	}
	second := make(chan *httptest.ResponseRecorder, 1)
	go func() {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/readyz", nil))
		second <- w
	}()
	<-joined // the first
	<-joined // the second, which joined or started a check
	close(g.gate)
	if w := <-second; w.Code != http.StatusOK {
		t.Errorf("the next probe = %d %s; want 200", w.Code, w.Body)
	}
	if c := g.calls.Load(); c != 2 {
		t.Errorf("%d checks; want 2", c)
	}
	if err := <-g.ended; err != nil {
		t.Errorf("the second check's context: %v; want it live", err)
	}
}

// panickyNodes is a Locker whose Nodes panics.
type panickyNodes struct{ *benchFakeLocker }

func (panickyNodes) Nodes(context.Context) []service.NodeStatus { panic("nodes exploded") }

// TestReadyzPanic: a panic in /readyz's shared check (which runs on a
// goroutine of its own) is answered as any handler's: a 500, and the server
// lives on.
func TestReadyzPanic(t *testing.T) {
	l := panickyNodes{newBenchFakeLocker()}
	h := NewHandler(l, benchFakeStore{l.benchFakeLocker}, Options{Registry: prometheus.NewRegistry(),
		Logger: slog.New(slog.NewJSONHandler(io.Discard, nil))})
	for range 2 {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/readyz", nil))
		if w.Code != http.StatusInternalServerError || !strings.Contains(w.Body.String(), "internal-error") {
			t.Errorf("/readyz with a panicking check = %d %s; want 500 internal-error", w.Code, w.Body)
		}
	}
}

// TestHandlers_FailClosedWithoutPrincipal: with access control on, every lock
// and document operation whose API key was not checked (a route that
// skipped authorize) answers 500 and acts on nothing, never on the default
// namespace or on an empty key.
func TestHandlers_FailClosedWithoutPrincipal(t *testing.T) {
	t.Parallel()
	e := newFakeEnv(t, true)
	token := strings.Repeat("A", lockTokenLen)
	for _, tc := range []struct {
		name, method, body string
		serve              http.HandlerFunc
		hdr                []string
	}{
		{"acquire", "POST", `{"ttl_ms":1000}`, e.h.acquire, nil},
		{"extend", "POST", `{"ttl_ms":1000}`, e.h.extend, []string{LockTokenHeader, token}},
		{"release", "DELETE", "", e.h.release, []string{LockTokenHeader, token}},
		{"status", "GET", "", e.h.status, nil},
		{"putResource", "PUT", `{"fencing_token":1,"data":1}`, e.h.putResource, nil},
		{"getResource", "GET", "", e.h.getResource, nil},
	} {
		r := httptest.NewRequest(tc.method, "/v1/locks/x", strings.NewReader(tc.body))
		if tc.body != "" {
			r.Header.Set("Content-Type", "application/json")
		}
		for i := 0; i+1 < len(tc.hdr); i += 2 {
			r.Header.Set(tc.hdr[i], tc.hdr[i+1])
		}
		rc := chi.NewRouteContext()
		rc.URLParams.Add("name", "x")
		r = r.WithContext(context.WithValue(r.Context(), chi.RouteCtxKey, rc))
		w := httptest.NewRecorder()
		tc.serve(w, r)
		if w.Code != http.StatusInternalServerError || !strings.Contains(w.Body.String(), "internal-error") {
			t.Errorf("%s without a principal = %d %s; want 500 internal-error", tc.name, w.Code, w.Body)
		}
	}
	e.l.mu.Lock()
	defer e.l.mu.Unlock()
	if len(e.l.held) != 0 || e.l.fencing != 0 || e.l.lastCalls != 0 {
		t.Errorf("the locker holds %v, issued up to %d and was asked for %d records; want nothing done", e.l.held, e.l.fencing, e.l.lastCalls)
	}
}

// stallingLog is a log handler that runs stall when it handles a record
// with a given message: a log destination that held the request up.
type stallingLog struct {
	slog.Handler
	on    string
	stall func()
}

func (s stallingLog) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == s.on {
		s.stall()
	}
	return s.Handler.Handle(ctx, r)
}

// TestAnswer_NotAfterTheLease: a grant or an extension whose lease ended
// while the process stalled after it (here in its audit line: a stuck log
// destination; a pause does the same) is not answered as a success: an
// acquire gets 503 lease-expired and its keys are deleted, an extend 409
// lock-lost. Another client may hold the name by then.
func TestAnswer_NotAfterTheLease(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ on, path, body, want string }{
		{"lock granted", "/v1/locks/x", `{"ttl_ms":10000}`, "lease-expired"},
		{"lock extended", "/v1/locks/x/extend", `{"ttl_ms":10000}`, "lock-lost"},
	} {
		t.Run(c.want, func(t *testing.T) {
			t.Parallel()
			e := newFakeEnv(t, false)
			stalling := false
			log := slog.New(stallingLog{Handler: slog.NewJSONHandler(e.logs, &slog.HandlerOptions{Level: slog.LevelDebug}), on: c.on,
				stall: func() {
					if stalling {
						e.now = e.now.Add(11 * time.Second)
					}
				}})
			e.h = NewHandler(e.l, benchFakeStore{e.l}, Options{Logger: log, Registry: prometheus.NewRegistry(), Now: func() time.Time { return e.now }})
			var hdr []string
			if c.want == "lock-lost" {
				g := e.acquire(t, e.h, "x", `{"ttl_ms":10000}`)
				hdr = []string{LockTokenHeader, g.LockToken}
			}
			stalling = true
			w := e.do(e.h, http.MethodPost, c.path, c.body, hdr...)
			var p Problem
			if err := json.Unmarshal(w.Body.Bytes(), &p); err != nil || p.Type != ProblemTypePrefix+c.want || !strings.Contains(p.Detail, "stalled") {
				t.Fatalf("%s with a stall past the lease = %d %s; want %s", c.on, w.Code, w.Body, c.want)
			}
			e.l.mu.Lock()
			_, held := e.l.held["x"]
			e.l.mu.Unlock()
			if held {
				t.Error("the lease not answered was not released")
			}
			// One audit line says why, and one metric counts the request.
			line, vec, ok := "lock grant withdrawn", e.h.m.acquisitions, "granted"
			if c.want == "lock-lost" {
				line, vec, ok = "lock extend refused", e.h.m.extensions, "extended"
			}
			if n := strings.Count(e.logs.String(), line); n != 1 || strings.Contains(e.logs.String(), "lock refused") {
				t.Errorf("%d audit lines %q (want 1), and no \"lock refused\":\n%s", n, line, e.logs)
			}
			if got, late := promtest.ToFloat64(vec.WithLabelValues(c.want)), promtest.ToFloat64(vec.WithLabelValues(ok)); got != 1 || late != 0 {
				t.Errorf("counted %v times as %s and %v as %s; want the late one as %s only", got, c.want, late, ok, c.want)
			}
		})
	}
}
