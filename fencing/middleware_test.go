package fencing

import (
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
)

func TestRequire(t *testing.T) {
	t.Parallel()
	last := func(r *http.Request) (Token, error) {
		switch r.URL.Path {
		case "/broken":
			return 0, errors.New("database down")
		case "/fresh":
			return 0, nil
		}
		return 5, nil
	}
	for _, tc := range []struct {
		name    string
		method  string
		path    string
		headers []string // Fencing-Token values
		last    bool     // use RequireOptions.Last
		status  int      // 200: the handler ran
		typ     string   // problem type slug when refused
		token   Token    // token the handler saw (0: none)
		current int64    // current_fencing_token in a 409
	}{
		{"Valid", http.MethodPut, "/x", []string{"7"}, false, 200, "", 7, 0},
		{"ValidPost", http.MethodPost, "/x", []string{" 12 "}, false, 200, "", 12, 0},
		{"Missing", http.MethodPut, "/x", nil, false, 400, "invalid-request", 0, 0},
		{"Empty", http.MethodDelete, "/x", []string{""}, false, 400, "invalid-request", 0, 0},
		{"Zero", http.MethodPut, "/x", []string{"0"}, false, 400, "invalid-request", 0, 0},
		{"Garbage", http.MethodPatch, "/x", []string{"12abc"}, false, 400, "invalid-request", 0, 0},
		{"Twice", http.MethodPut, "/x", []string{"7", "8"}, false, 400, "invalid-request", 0, 0},
		{"ReadNeedsNone", http.MethodGet, "/x", nil, false, 200, "", 0, 0},
		{"ReadKeepsNone", http.MethodGet, "/x", []string{"7"}, false, 200, "", 0, 0},
		{"Stale", http.MethodPut, "/x", []string{"4"}, true, 409, "stale-token", 0, 5},
		{"Equal", http.MethodPut, "/x", []string{"5"}, true, 200, "", 5, 0},
		{"Newer", http.MethodPut, "/x", []string{"6"}, true, 200, "", 6, 0},
		{"FirstWrite", http.MethodPut, "/fresh", []string{"1"}, true, 200, "", 1, 0},
		{"LastFails", http.MethodPut, "/broken", []string{"9"}, true, 503, "fencing-unavailable", 0, 0},
		{"MaxIssued", http.MethodPut, "/x", []string{"9007199254740991"}, false, 200, "", MaxToken, 0},
		{"AboveMaxIssued", http.MethodPut, "/x", []string{"9007199254740992"}, false, 400, "invalid-request", 0, 0},
		{"MaxInt64", http.MethodPut, "/x", []string{"9223372036854775807"}, true, 400, "invalid-request", 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var opts RequireOptions
			if tc.last {
				opts.Last = last
			}
			var seen Token
			h := Require(opts)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				seen, _ = TokenFrom(r.Context())
				w.WriteHeader(http.StatusOK)
			}))
			req := httptest.NewRequest(tc.method, tc.path, nil)
			for _, v := range tc.headers {
				req.Header.Add(Header, v)
			}
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, req)
			if rec.Code != tc.status {
				t.Fatalf("%s %s with %q = %d %s; want %d", tc.method, tc.path, tc.headers, rec.Code, rec.Body, tc.status)
			}
			if seen != tc.token {
				t.Errorf("handler saw token %d; want %d", seen, tc.token)
			}
			if tc.status == http.StatusOK {
				return
			}
			if ct := rec.Header().Get("Content-Type"); ct != "application/problem+json" {
				t.Errorf("Content-Type = %q; want application/problem+json", ct)
			}
			var p problem
			if err := json.Unmarshal(rec.Body.Bytes(), &p); err != nil {
				t.Fatalf("decoding %s: %v", rec.Body, err)
			}
			if p.Type != "urn:redfence:problem:"+tc.typ || p.Status != tc.status || p.Instance != tc.path {
				t.Errorf("problem = %+v; want type %s, status %d, instance %s", p, tc.typ, tc.status, tc.path)
			}
			if tc.current != 0 && (p.CurrentFencingToken == nil || *p.CurrentFencingToken != tc.current) {
				t.Errorf("current_fencing_token = %v; want %d", p.CurrentFencingToken, tc.current)
			}
			if tc.typ == "invalid-request" && (len(p.InvalidParams) != 1 || p.InvalidParams[0].Name != Header) {
				t.Errorf("invalid_params = %+v; want one naming %s", p.InvalidParams, Header)
			}
			if tc.typ == "fencing-unavailable" && p.Detail != "" {
				t.Errorf("detail = %q; the cause must not be sent", p.Detail)
			}
		})
	}
}

func TestRequire_Methods(t *testing.T) {
	t.Parallel()
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {})
	for _, tc := range []struct {
		name    string
		methods []string
		want    map[string]int // method without a token: status
	}{
		{"Listed", []string{http.MethodGet}, map[string]int{http.MethodGet: 400, "get": 400, http.MethodPut: 200}},
		// By default only the safe methods pass without a token: a handler
		// that takes any other method for a write (one that does not
		// route by method, a lower-case "put", WebDAV's PROPPATCH) never
		// sees one without a token.
		{"Default", nil, map[string]int{
			http.MethodGet: 200, http.MethodHead: 200, http.MethodOptions: 200, http.MethodTrace: 200,
			http.MethodPut: 400, http.MethodPost: 400, http.MethodPatch: 400, http.MethodDelete: 400,
			"put": 400, "Put": 400, "get": 400, "MERGE": 400, "PROPPATCH": 400,
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := Require(RequireOptions{Methods: tc.methods})(ok)
			for method, want := range tc.want {
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, httptest.NewRequest(method, "/", nil))
				if rec.Code != want {
					t.Errorf("%s without a token = %d; want %d", method, rec.Code, want)
				}
			}
		})
	}
}

func TestWithToken(t *testing.T) {
	t.Parallel()
	if _, ok := TokenFrom(t.Context()); ok {
		t.Error("TokenFrom(empty context) reports a token")
	}
	for _, tok := range []Token{1, 42} {
		if got, ok := TokenFrom(WithToken(t.Context(), tok)); !ok || got != tok {
			t.Errorf("TokenFrom(WithToken(%d)) = %d, %v", tok, got, ok)
		}
	}
}
