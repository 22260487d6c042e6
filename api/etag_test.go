package api_test

import (
	"net/http"
	"strconv"
	"testing"

	"github.com/redfence/redfence/api"
)

// TestAPI_ConditionalWrites: the reference store's documents carry their
// version as a strong ETag; PUT honours If-Match and If-None-Match (412
// precondition-failed with current_version and nothing written), GET
// honours If-None-Match (304); a stale token is refused first; malformed
// fields are refused as invalid-request naming the field.
func TestAPI_ConditionalWrites(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	g := e.mustAcquire("cas", nil)
	const path = "/v1/resources/cas"
	put := func(data any, hdr ...string) *response {
		return e.do(e.client, http.MethodPut, path, map[string]any{"fencing_token": g.FencingToken, "data": data}, hdr...)
	}
	wantPrecondition := func(step string, r *response, version int64) {
		t.Helper()
		p := r.problem(t)
		if r.status != 412 || p.Type != api.ProblemTypePrefix+"precondition-failed" {
			t.Fatalf("%s = %d %s; want 412 precondition-failed", step, r.status, r.body)
		}
		got := int64(0)
		if p.CurrentVersion != nil {
			got = *p.CurrentVersion
		}
		if got != version {
			t.Errorf("%s: current_version %d; want %d", step, got, version)
		}
		if want := map[bool]string{true: strconv.Quote(strconv.FormatInt(version, 10))}[version > 0]; r.header.Get("ETag") != want {
			t.Errorf("%s: ETag %q; want %q", step, r.header.Get("ETag"), want)
		}
	}
	wantWritten := func(step string, r *response, version int64) {
		t.Helper()
		var res api.Resource
		r.decode(t, &res)
		if r.status != 200 || res.Version != version || r.header.Get("ETag") != strconv.Quote(strconv.FormatInt(version, 10)) {
			t.Fatalf("%s = %d %s (ETag %q); want 200 at version %d", step, r.status, r.body, r.header.Get("ETag"), version)
		}
	}

	wantPrecondition("If-Match: * with no document", put(0, "If-Match", "*"), 0)
	if r := e.do(e.client, http.MethodGet, path, nil); r.status != 404 {
		t.Fatalf("GET after a refused conditional write = %d %s; want 404", r.status, r.body)
	}
	wantWritten("If-None-Match: * with no document", put(1, "If-None-Match", "*"), 1)
	wantPrecondition("If-None-Match: * over version 1", put("x", "If-None-Match", "*"), 1)
	wantWritten(`If-Match: "1"`, put(2, "If-Match", `"1"`), 2)
	wantPrecondition(`If-Match: "1" over version 2`, put("x", "If-Match", `"1"`), 2)
	wantPrecondition(`If-Match: W/"2" (weak: never matches)`, put("x", "If-Match", `W/"2"`), 2)
	wantWritten(`If-Match: "9", "2"`, put(3, "If-Match", `"9", "2"`), 3)
	wantWritten("no condition", put(4), 4)

	r := e.do(e.client, http.MethodGet, path, nil)
	if r.status != 200 || r.header.Get("ETag") != `"4"` {
		t.Fatalf("GET = %d (ETag %q); want 200 with ETag \"4\"", r.status, r.header.Get("ETag"))
	}
	for _, inm := range []string{`"4"`, `W/"4"`, `"1", "4"`, "*"} {
		if r := e.do(e.client, http.MethodGet, path, nil, "If-None-Match", inm); r.status != 304 || len(r.body) != 0 || r.header.Get("ETag") != `"4"` {
			t.Errorf("GET with If-None-Match %s = %d %q (ETag %q); want 304, no body, ETag \"4\"", inm, r.status, r.body, r.header.Get("ETag"))
		}
	}
	if r := e.do(e.client, http.MethodGet, path, nil, "If-None-Match", `"3"`); r.status != 200 {
		t.Errorf("GET with If-None-Match \"3\" at version 4 = %d; want 200", r.status)
	}
	wantPrecondition(`GET with If-Match: "3" at version 4`, e.do(e.client, http.MethodGet, path, nil, "If-Match", `"3"`), 4)
	if r := e.do(e.client, http.MethodGet, path, nil, "If-Match", `"4"`); r.status != 200 {
		t.Errorf("GET with If-Match \"4\" at version 4 = %d; want 200", r.status)
	}
	// If-Match is evaluated first (RFC 9110 §13.2.2): a failing one is 412
	// even where If-None-Match alone would be 304; a passing one leaves the
	// answer to If-None-Match.
	wantPrecondition(`GET with If-Match: "3", If-None-Match: "4" at version 4`,
		e.do(e.client, http.MethodGet, path, nil, "If-Match", `"3"`, "If-None-Match", `"4"`), 4)
	if r := e.do(e.client, http.MethodGet, path, nil, "If-Match", `"4"`, "If-None-Match", `"4"`); r.status != 304 {
		t.Errorf("GET with If-Match and If-None-Match both naming version 4 = %d; want 304", r.status)
	}
	wantPrecondition(`PUT with If-Match: "4", If-None-Match: W/"4" at version 4`, put("x", "If-Match", `"4"`, "If-None-Match", `W/"4"`), 4)
	// With no document GET answers 404 whatever the conditions: a server
	// ignores preconditions when the request without them would fail
	// (RFC 9110 §13.2.1).
	for _, h := range [][2]string{{"If-Match", "*"}, {"If-Match", `"1"`}, {"If-None-Match", "*"}, {"If-None-Match", `"1"`}} {
		r := e.do(e.client, http.MethodGet, "/v1/resources/none", nil, h[0], h[1])
		if p := r.problem(t); r.status != 404 || p.Type != api.ProblemTypePrefix+"resource-not-found" {
			t.Errorf("GET with %s: %s and no document = %d %s; want 404 resource-not-found", h[0], h[1], r.status, r.body)
		}
	}
	if p := e.do(e.client, http.MethodGet, path, nil, "If-Match", `"3"`).problem(t); p.Detail != `the document is at version 4 (ETag "4")` {
		t.Errorf("GET with a failing If-Match: detail %q; want it to name the version, and no write", p.Detail)
	}

	for _, h := range [][2]string{{"If-Match", "4"}, {"If-Match", `"4`}, {"If-None-Match", `"4" "5"`}, {"If-Match", ""}} {
		if h[1] == "" {
			h[1] = " "
		}
		r := put("x", h[0], h[1])
		p := r.problem(t)
		if r.status != 400 || p.Type != api.ProblemTypePrefix+"invalid-request" || len(p.InvalidParams) != 1 || p.InvalidParams[0].Name != h[0] {
			t.Errorf("PUT with %s: %q = %d %s; want 400 invalid-request naming %s", h[0], h[1], r.status, r.body, h[0])
		}
	}
	if r := e.do(e.client, http.MethodGet, path, nil, "If-None-Match", "4"); r.status != 400 {
		t.Errorf("GET with a malformed If-None-Match = %d; want 400", r.status)
	}

	// A stale token is refused as stale, whatever the condition; nothing
	// was written by any refused write.
	e.release("cas", g.LockToken)
	e.mustAcquire("cas", nil) // a newer grant: g's token is stale
	r = e.do(e.client, http.MethodPut, path, map[string]any{"fencing_token": g.FencingToken, "data": "stale"}, "If-Match", `"4"`)
	if p := r.problem(t); r.status != 409 || p.Type != api.ProblemTypePrefix+"stale-token" {
		t.Errorf("stale write with a matching If-Match = %d %s; want 409 stale-token", r.status, r.body)
	}
	var res api.Resource
	e.do(e.client, http.MethodGet, path, nil).decode(t, &res)
	if res.Version != 4 || string(res.Data) != "4" {
		t.Errorf("document = %+v; want version 4, data 4", res)
	}
}
