package api_test

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redfence/redfence/api"
)

// TestAPI_BadRequests sends malformed and refused requests and checks each gets
// its documented problem+json and changes nothing in Redis or Postgres.
func TestAPI_BadRequests(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	// Some state for refusals to leave alone: a held lock and a document.
	held := e.mustAcquire("held", map[string]any{"ttl_ms": 60000, "owner": "keeper"})
	if r := e.put("held", held.FencingToken, map[string]any{"v": 1}); r.status != 200 {
		t.Fatalf("seed PUT = %d %s", r.status, r.body)
	}
	validToken := held.LockToken
	wrongToken := strings.Repeat("A", 27)
	long := strings.Repeat("n", 201)

	const json = "application/json"
	tests := []struct {
		name         string
		method, path string
		body         string
		ctype        string
		hdr          []string
		status       int
		slug         string
	}{
		// names
		{"NameWithSpace", "POST", "/v1/locks/bad%20name", "", "", nil, 400, "invalid-request"},
		{"NameTooLong", "POST", "/v1/locks/" + long, "", "", nil, 400, "invalid-request"},
		{"NameWithEncodedSlash", "POST", "/v1/locks/a%2Fb", "", "", nil, 400, "invalid-request"},
		{"NameNonASCII", "POST", "/v1/locks/%C3%A9t%C3%A9", "", "", nil, 400, "invalid-request"},
		{"NameWithPercent", "GET", "/v1/locks/100%25", "", "", nil, 400, "invalid-request"},
		// decoded once: "a%41", not "aA"
		{"NameDoubleEncoded", "POST", "/v1/locks/a%2541", "", "", nil, 400, "invalid-request"},
		{"NameDoubleEncodedGet", "GET", "/v1/locks/a%253Ab", "", "", nil, 400, "invalid-request"},
		{"NameDoubleEncodedRelease", "DELETE", "/v1/locks/held%2541", "", "", []string{api.LockTokenHeader, validToken}, 400, "invalid-request"},
		{"ResourceNameDoubleEncoded", "PUT", "/v1/resources/a%2541", `{"fencing_token":1,"data":1}`, json, nil, 400, "invalid-request"},
		{"ResourceNameBang", "GET", "/v1/resources/bad!name", "", "", nil, 400, "invalid-request"},
		{"ResourceNameTooLong", "PUT", "/v1/resources/" + long, `{"fencing_token":1,"data":1}`, json, nil, 400, "invalid-request"},
		// acquire bodies
		{"NotJSON", "POST", "/v1/locks/x", "not json", json, nil, 400, "invalid-request"},
		{"Truncated", "POST", "/v1/locks/x", `{"ttl_ms": 1000`, json, nil, 400, "invalid-request"},
		{"NullBody", "POST", "/v1/locks/x", `null`, json, nil, 400, "invalid-request"},
		{"ArrayBody", "POST", "/v1/locks/x", `[1,2]`, json, nil, 400, "invalid-request"},
		{"UnknownField", "POST", "/v1/locks/x", `{"ttl_ms":1000,"bogus":1}`, json, nil, 400, "invalid-request"},
		{"TrailingData", "POST", "/v1/locks/x", `{"ttl_ms":1000} {"ttl_ms":2000}`, json, nil, 400, "invalid-request"},
		{"FieldCaseFolded", "POST", "/v1/locks/x", `{"TTL_MS":1000}`, json, nil, 400, "invalid-request"},
		{"OwnerCaseFolded", "POST", "/v1/locks/x", `{"Owner":"x"}`, json, nil, 400, "invalid-request"},
		{"FieldTwice", "POST", "/v1/locks/x", `{"ttl_ms":-1,"ttl_ms":1000}`, json, nil, 400, "invalid-request"},
		{"TTLNull", "POST", "/v1/locks/x", `{"ttl_ms":null}`, json, nil, 400, "invalid-request"},
		{"OwnerNull", "POST", "/v1/locks/x", `{"owner":null}`, json, nil, 400, "invalid-request"},
		{"TTLString", "POST", "/v1/locks/x", `{"ttl_ms":"1000"}`, json, nil, 400, "invalid-request"},
		{"TTLFraction", "POST", "/v1/locks/x", `{"ttl_ms":1.5}`, json, nil, 400, "invalid-request"},
		{"TTLNegative", "POST", "/v1/locks/x", `{"ttl_ms":-1}`, json, nil, 400, "invalid-request"},
		{"TTLZero", "POST", "/v1/locks/x", `{"ttl_ms":0}`, json, nil, 400, "invalid-request"},
		{"TTLBelowMin", "POST", "/v1/locks/x", `{"ttl_ms":50}`, json, nil, 400, "invalid-request"},
		{"TTLAboveMax", "POST", "/v1/locks/x", `{"ttl_ms":3600000}`, json, nil, 400, "invalid-request"},
		{"TTLOverflow", "POST", "/v1/locks/x", `{"ttl_ms":99999999999999999999}`, json, nil, 400, "invalid-request"},
		{"WaitNegative", "POST", "/v1/locks/x", `{"wait_ms":-5}`, json, nil, 400, "invalid-request"},
		{"WaitAboveMax", "POST", "/v1/locks/x", `{"wait_ms":3600000}`, json, nil, 400, "invalid-request"},
		{"OwnerNotString", "POST", "/v1/locks/x", `{"owner":5}`, json, nil, 400, "invalid-request"},
		{"OwnerTooLong", "POST", "/v1/locks/x", `{"owner":"` + strings.Repeat("o", 257) + `"}`, json, nil, 400, "invalid-request"},
		{"OwnerControlChar", "POST", "/v1/locks/x", `{"owner":"bell\u0007"}`, json, nil, 400, "invalid-request"},
		{"WrongContentType", "POST", "/v1/locks/x", `{"ttl_ms":1000}`, "text/plain", nil, 415, "unsupported-media-type"},
		{"NoContentType", "POST", "/v1/locks/x", `{"ttl_ms":1000}`, "", nil, 415, "unsupported-media-type"},
		{"ContentTypeLatin1", "POST", "/v1/locks/x", `{"ttl_ms":1000}`, "application/json; charset=latin1", nil, 415, "unsupported-media-type"},
		{"TwoContentTypes", "POST", "/v1/locks/x", `{"ttl_ms":1000}`, json, []string{"Content-Type", "text/plain"}, 415, "unsupported-media-type"},
		{"ContentEncodingGzip", "POST", "/v1/locks/x", `{"ttl_ms":1000}`, json, []string{"Content-Encoding", "gzip"}, 415, "unsupported-media-type"},
		{"ContentEncodingPut", "PUT", "/v1/resources/held", `{"fencing_token":1,"data":1}`, json, []string{"Content-Encoding", "br"}, 415, "unsupported-media-type"},
		{"BodyTooLarge", "POST", "/v1/locks/x", `{"owner":"` + strings.Repeat("x", 2<<20) + `"}`, json, nil, 413, "request-too-large"},
		// lock tokens
		{"ExtendNoToken", "POST", "/v1/locks/held/extend", "", "", nil, 400, "invalid-request"},
		{"ExtendShortToken", "POST", "/v1/locks/held/extend", "", "", []string{api.LockTokenHeader, "abc"}, 400, "invalid-request"},
		{"ExtendTokenBadChars", "POST", "/v1/locks/held/extend", "", "", []string{api.LockTokenHeader, strings.Repeat("+", 27)}, 400, "invalid-request"},
		{"ExtendTwoTokens", "POST", "/v1/locks/held/extend", "", "", []string{api.LockTokenHeader, validToken, api.LockTokenHeader, validToken}, 400, "invalid-request"},
		{"ExtendTTLTooShort", "POST", "/v1/locks/held/extend", `{"ttl_ms":1}`, json, []string{api.LockTokenHeader, validToken}, 400, "invalid-request"},
		{"ExtendTTLAboveMax", "POST", "/v1/locks/held/extend", `{"ttl_ms":86400000}`, json, []string{api.LockTokenHeader, validToken}, 400, "invalid-request"},
		{"ExtendUnknownField", "POST", "/v1/locks/held/extend", `{"ttl":1000}`, json, []string{api.LockTokenHeader, validToken}, 400, "invalid-request"},
		{"ExtendWrongToken", "POST", "/v1/locks/held/extend", "", "", []string{api.LockTokenHeader, wrongToken}, 409, "lock-lost"},
		{"ReleaseNoToken", "DELETE", "/v1/locks/held", "", "", nil, 400, "invalid-request"},
		{"ReleasePaddedToken", "DELETE", "/v1/locks/held", "", "", []string{api.LockTokenHeader, validToken + "="}, 400, "invalid-request"},
		{"ReleaseWrongToken", "DELETE", "/v1/locks/held", "", "", []string{api.LockTokenHeader, wrongToken}, 409, "not-holder"},
		// resources
		{"PutNoBody", "PUT", "/v1/resources/held", "", "", nil, 400, "invalid-request"},
		{"PutNoToken", "PUT", "/v1/resources/held", `{"data":1}`, json, nil, 400, "invalid-request"},
		{"PutTokenZero", "PUT", "/v1/resources/held", `{"fencing_token":0,"data":1}`, json, nil, 400, "invalid-request"},
		{"PutTokenNegative", "PUT", "/v1/resources/held", `{"fencing_token":-3,"data":1}`, json, nil, 400, "invalid-request"},
		{"PutTokenAboveMax", "PUT", "/v1/resources/held", `{"fencing_token":9007199254740992,"data":1}`, json, nil, 400, "invalid-request"},
		{"PutTokenString", "PUT", "/v1/resources/held", `{"fencing_token":"1","data":1}`, json, nil, 400, "invalid-request"},
		{"PutNoData", "PUT", "/v1/resources/held", `{"fencing_token":1}`, json, nil, 400, "invalid-request"},
		{"PutUnknownField", "PUT", "/v1/resources/held", `{"fencing_token":1,"data":1,"version":3}`, json, nil, 400, "invalid-request"},
		{"PutFieldCaseFolded", "PUT", "/v1/resources/held", `{"Fencing_Token":1,"data":1}`, json, nil, 400, "invalid-request"},
		{"PutTokenTwice", "PUT", "/v1/resources/held", `{"fencing_token":999,"fencing_token":1,"data":1}`, json, nil, 400, "invalid-request"},
		{"PutTokenNull", "PUT", "/v1/resources/held", `{"fencing_token":null,"data":1}`, json, nil, 400, "invalid-request"},
		{"ExtendFieldCaseFolded", "POST", "/v1/locks/held/extend", `{"Ttl_Ms":1000}`, json, []string{api.LockTokenHeader, validToken}, 400, "invalid-request"},
		{"PutUnissuedToken", "PUT", "/v1/resources/held", `{"fencing_token":999,"data":1}`, json, nil, 409, "stale-token"},
		{"PutNeverLocked", "PUT", "/v1/resources/never", `{"fencing_token":1,"data":1}`, json, nil, 409, "stale-token"},
		// query strings: no operation takes one (a ttl_ms there would be ignored)
		{"QueryOnAcquire", "POST", "/v1/locks/x?ttl_ms=5", `{}`, json, nil, 400, "invalid-request"},
		{"QueryOnAcquireBadName", "POST", "/v1/locks/x!?wait_ms=5", `{"bogus":1}`, json, nil, 400, "invalid-request"},
		{"QueryOnGetLock", "GET", "/v1/locks/held?fresh", "", "", nil, 400, "invalid-request"},
		{"QueryOnExtend", "POST", "/v1/locks/held/extend?ttl_ms=60000", `{}`, json, []string{api.LockTokenHeader, validToken}, 400, "invalid-request"},
		{"QueryOnRelease", "DELETE", "/v1/locks/held?lock_token=" + validToken, "", "", nil, 400, "invalid-request"},
		{"QueryOnPut", "PUT", "/v1/resources/held?version=1", `{"fencing_token":1,"data":1}`, json, nil, 400, "invalid-request"},
		{"QueryOnGetResource", "GET", "/v1/resources/held?x=1", "", "", nil, 400, "invalid-request"},
		{"EmptyQueryOnAcquire", "POST", "/v1/locks/x?", `{}`, json, nil, 400, "invalid-request"},
		{"EmptyQueryOnGetResource", "GET", "/v1/resources/held?", "", "", nil, 400, "invalid-request"},
		// routes and methods
		{"PatchLock", "PATCH", "/v1/locks/held", "", "", nil, 405, "method-not-allowed"},
		{"PutLock", "PUT", "/v1/locks/held", `{}`, json, nil, 405, "method-not-allowed"},
		{"DeleteResource", "DELETE", "/v1/resources/held", "", "", nil, 405, "method-not-allowed"},
		{"GetExtend", "GET", "/v1/locks/held/extend", "", "", nil, 405, "method-not-allowed"},
		{"UnknownRoute", "GET", "/v1/nope", "", "", nil, 404, "not-found"},
		{"EmptyName", "POST", "/v1/locks/", "", "", nil, 404, "not-found"},
		{"EmptyNameExtend", "POST", "/v1/locks//extend", `{"ttl_ms":1000}`, json, nil, 404, "not-found"},
		{"EmptyNameResource", "PUT", "/v1/resources/", `{}`, json, nil, 404, "not-found"},
		// every problem of a request, named in one answer
		{"AllTTLWait", "POST", "/v1/locks/x", `{"ttl_ms":-1,"wait_ms":-1}`, json, nil, 400, "invalid-request"},
		{"AllTTLWaitOwner", "POST", "/v1/locks/x", `{"ttl_ms":99999999,"wait_ms":99999999,"owner":"\n"}`, json, nil, 400, "invalid-request"},
		{"AllTTLOwner", "POST", "/v1/locks/x", `{"ttl_ms":1,"owner":"\n"}`, json, nil, 400, "invalid-request"},
		{"AllNameTTL", "POST", "/v1/locks/a%20b", `{"ttl_ms":1}`, json, nil, 400, "invalid-request"},
		{"AllTypes", "POST", "/v1/locks/x", `{"ttl_ms":"1","wait_ms":1.5,"owner":5}`, json, nil, 400, "invalid-request"},
		{"AllUnknown", "POST", "/v1/locks/x", `{"ttl":1000,"wait_ms":-1,"Owner":"w"}`, json, nil, 400, "invalid-request"},
		{"AllNullTwiceTrailing", "POST", "/v1/locks/x", `{"owner":null,"ttl_ms":5,"ttl_ms":6} {}`, json, nil, 400, "invalid-request"},
		{"UnknownFieldTwice", "POST", "/v1/locks/x", `{"x":1,"x":2}`, json, nil, 400, "invalid-request"},
		{"FieldThrice", "POST", "/v1/locks/x", `{"ttl_ms":1000,"ttl_ms":1000,"ttl_ms":1000}`, json, nil, 400, "invalid-request"},
		{"TruncatedObject", "POST", "/v1/locks/x", `{"ttl_ms":1000`, json, nil, 400, "invalid-request"},
		{"TruncatedAfterComma", "POST", "/v1/locks/x", `{"ttl_ms":1000,`, json, nil, 400, "invalid-request"},
		{"PutTokenBeyondInt64", "PUT", "/v1/resources/held", `{"fencing_token":99999999999999999999,"data":1}`, json, nil, 400, "invalid-request"},
		{"PutTokenBelowInt64", "PUT", "/v1/resources/held", `{"fencing_token":-99999999999999999999,"data":1}`, json, nil, 400, "invalid-request"},
		{"AllExtend", "POST", "/v1/locks/a%20b/extend", `{"ttl_ms":1}`, json, nil, 400, "invalid-request"},
		{"AllRelease", "DELETE", "/v1/locks/a%20b", "", "", []string{api.LockTokenHeader, "abc"}, 400, "invalid-request"},
		{"AllPutTokenData", "PUT", "/v1/resources/held", `{"fencing_token":0,"data":"\u0000"}`, json, nil, 400, "invalid-request"},
		{"AllPutEmptyObject", "PUT", "/v1/resources/held", `{}`, json, nil, 400, "invalid-request"},
		{"AllPutNameTokenUnknown", "PUT", "/v1/resources/a%20b", `{"fencing_token":"1","data":1,"v":2}`, json, nil, 400, "invalid-request"},
		// what each reason says
		{"PutTokenNullRequired", "PUT", "/v1/resources/held", `{"fencing_token":null,"data":{}}`, json, nil, 400, "invalid-request"},
		{"TTLAboveDay", "POST", "/v1/locks/x", `{"ttl_ms":99999999}`, json, nil, 400, "invalid-request"},
		{"TTLDay", "POST", "/v1/locks/x", `{"ttl_ms":86400000}`, json, nil, 400, "invalid-request"},
		{"TTLBeyondInt64", "POST", "/v1/locks/x", `{"ttl_ms":99999999999999999999}`, json, nil, 400, "invalid-request"},
		{"WaitAboveDay", "POST", "/v1/locks/x", `{"wait_ms":99999999}`, json, nil, 400, "invalid-request"},
		{"ExtendTTLAboveDay", "POST", "/v1/locks/held/extend", `{"ttl_ms":99999999}`, json, []string{api.LockTokenHeader, validToken}, 400, "invalid-request"},
		{"UnknownFieldNamed", "POST", "/v1/locks/x", `{"ttl":1000}`, json, nil, 400, "invalid-request"},
		// RFC 8259 §8.1 lets a parser ignore a byte-order mark; Redfence
		// refuses it, as it refuses all but one plain JSON object, and
		// says so.
		{"ByteOrderMark", "POST", "/v1/locks/x", "\ufeff{}", json, nil, 400, "invalid-request"},
		{"ByteOrderMarkPut", "PUT", "/v1/resources/held", "\ufeff{\"fencing_token\":1,\"data\":1}", json, nil, 400, "invalid-request"},
		// Only an empty body takes the defaults: whitespace is no JSON text.
		{"WhitespaceBody", "POST", "/v1/locks/x", "   ", json, nil, 400, "invalid-request"},
		{"WhitespaceBodyExtend", "POST", "/v1/locks/held/extend", "\n", json, []string{api.LockTokenHeader, validToken}, 400, "invalid-request"},
		{"WhitespaceBodyPut", "PUT", "/v1/resources/held", " \t", json, nil, 400, "invalid-request"},
		{"ContentTypeEmptySuffixName", "POST", "/v1/locks/x", `{"ttl_ms":1000}`, "application/+json", nil, 415, "unsupported-media-type"},
		{"ContentTypeNoSlash", "POST", "/v1/locks/x", `{"ttl_ms":1000}`, "x+json", nil, 415, "unsupported-media-type"},
		{"ContentTypeTextJSON", "POST", "/v1/locks/x", `{"ttl_ms":1000}`, "text/json", nil, 415, "unsupported-media-type"},
		{"OwnerTooManyCharacters", "POST", "/v1/locks/x", `{"owner":"` + strings.Repeat("é", 257) + `"}`, json, nil, 400, "invalid-request"},
		{"OwnerNoBreakSpace", "POST", "/v1/locks/x", `{"owner":"a\u00a0b"}`, json, nil, 400, "invalid-request"},
		{"OwnerReplacementChar", "POST", "/v1/locks/x", `{"owner":"a\ufffdb"}`, json, nil, 400, "invalid-request"},
		{"NameHoldsAPIKey", "POST", "/v1/locks/ci:rf_0123456789abcdef_" + strings.Repeat("s", 43), "", "", nil, 400, "invalid-request"},
		{"OwnerHoldsAPIKey", "POST", "/v1/locks/x", `{"owner":"ci rf_0123456789abcdef_` + strings.Repeat("s", 43) + `"}`, json, nil, 400, "invalid-request"},
	}
	// The invalid_params name of some refusals: the field at fault, "body"
	// only for the body as a whole.
	wantParam := map[string]string{
		"TTLString": "ttl_ms", "TTLFraction": "ttl_ms", "TTLOverflow": "ttl_ms", "TTLNull": "ttl_ms",
		"FieldTwice": "ttl_ms", "TTLNegative": "ttl_ms", "OwnerNotString": "owner", "PutTokenString": "fencing_token",
		"PutTokenAboveMax": "fencing_token", "OwnerHoldsAPIKey": "owner",
		"NotJSON": "body", "UnknownField": "bogus", "ArrayBody": "body",
	}
	// Every invalid_params name of some refusals, in order (the path's, the
	// headers', the body's as JSON in body order, then the values'): each
	// problem of the request, not the first only. The detail names each too.
	wantParams := map[string][]string{
		"AllTTLWait":              {"ttl_ms", "wait_ms"},
		"AllTTLWaitOwner":         {"ttl_ms", "wait_ms", "owner"},
		"AllTTLOwner":             {"ttl_ms", "owner"},
		"AllNameTTL":              {"name", "ttl_ms"},
		"AllTypes":                {"ttl_ms", "wait_ms", "owner"},
		"AllUnknown":              {"ttl", "Owner", "wait_ms"},
		"AllNullTwiceTrailing":    {"owner", "ttl_ms", "body"},
		"UnknownFieldTwice":       {"x"},
		"FieldThrice":             {"ttl_ms"},
		"AllExtend":               {"name", api.LockTokenHeader, "ttl_ms"},
		"AllRelease":              {"name", api.LockTokenHeader},
		"QueryOnAcquire":          {"query"},
		"EmptyQueryOnAcquire":     {"query"},
		"EmptyQueryOnGetResource": {"query"},
		"QueryOnAcquireBadName":   {"name", "query", "bogus"},
		"QueryOnExtend":           {"query"},
		"QueryOnRelease":          {"query", api.LockTokenHeader},
		"QueryOnPut":              {"query"},
		"AllPutTokenData":         {"fencing_token", "data"},
		"AllPutEmptyObject":       {"fencing_token", "data"},
		"AllPutNameTokenUnknown":  {"name", "fencing_token", "v"},
		"PutNoToken":              {"fencing_token"},
		"PutTokenNullRequired":    {"fencing_token"},
		"UnknownFieldNamed":       {"ttl"},
		"ByteOrderMark":           {"body"},
		"ByteOrderMarkPut":        {"body"},
		"WhitespaceBody":          {"body"},
		"WhitespaceBodyExtend":    {"body"},
		"WhitespaceBodyPut":       {"body"},
	}
	// What the reason of the first invalid_params says (a substring), and,
	// after a "!", what it must not say. A bound is the server's
	// configured one, in milliseconds, whatever the value.
	o := e.locker.Options()
	ttlBounds := fmt.Sprintf("from %d to %d ", o.MinTTL.Milliseconds(), o.MaxTTL.Milliseconds())
	waitBounds := fmt.Sprintf("from 0 to %d ", o.MaxWait.Milliseconds())
	wantReason := map[string]string{
		"PutTokenNullRequired":   "required: a positive integer!default",
		"PutNoToken":             "required: a positive integer",
		"PutTokenZero":           "positive integer",
		"TruncatedObject":        "truncated JSON!EOF",
		"TruncatedAfterComma":    "truncated JSON!EOF",
		"PutTokenBeyondInt64":    "at most 9007199254740991",
		"PutTokenBelowInt64":     "positive integer",
		"PutTokenAboveMax":       "at most 9007199254740991",
		"TTLNull":                "leave it out for the default",
		"OwnerNull":              "leave it out for the default",
		"TTLAboveDay":            ttlBounds + "!24 hours",
		"TTLDay":                 ttlBounds,
		"TTLBeyondInt64":         ttlBounds,
		"TTLOverflow":            ttlBounds,
		"TTLAboveMax":            ttlBounds,
		"TTLBelowMin":            ttlBounds,
		"TTLZero":                ttlBounds,
		"TTLNegative":            ttlBounds,
		"AllTTLWait":             ttlBounds,
		"WaitAboveDay":           waitBounds,
		"WaitAboveMax":           waitBounds,
		"WaitNegative":           waitBounds,
		"ExtendTTLAboveDay":      ttlBounds,
		"ExtendTTLAboveMax":      ttlBounds,
		"ExtendTTLTooShort":      ttlBounds,
		"UnknownFieldNamed":      "unknown field",
		"FieldCaseFolded":        `did you mean "ttl_ms"`,
		"ByteOrderMark":          "byte-order mark",
		"ByteOrderMarkPut":       "byte-order mark",
		"WhitespaceBody":         "must be a JSON object",
		"OwnerTooManyCharacters": "256 characters",
		"OwnerControlChar":       "not U+0007!U+FFFD",
		"OwnerNoBreakSpace":      "not U+00A0!U+FFFD",
		"OwnerReplacementChar":   "not U+FFFD",
		"NameHoldsAPIKey":        "must not hold an API key",
	}
	if len(tests) < 30 {
		t.Fatalf("only %d cases; want at least 30", len(tests))
	}
	before := e.snapshot()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, err := http.NewRequest(tt.method, e.srv.URL+tt.path, strings.NewReader(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			if tt.ctype != "" {
				req.Header.Set("Content-Type", tt.ctype)
			}
			for i := 0; i+1 < len(tt.hdr); i += 2 {
				req.Header.Add(tt.hdr[i], tt.hdr[i+1])
			}
			client := e.loose
			if tt.status == 404 || tt.status == 405 {
				client = http.DefaultClient // the spec has no such operation to check against
			}
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			r := readResponse(t, resp)
			p := r.problem(t)
			if r.status != tt.status || p.Type != api.ProblemTypePrefix+tt.slug || p.Status != tt.status {
				t.Errorf("%s %s = %d %s; want %d %s", tt.method, tt.path, r.status, p.Type, tt.status, tt.slug)
			}
			if want, _, _ := strings.Cut(strings.Replace(tt.path, "_"+strings.Repeat("s", 43), "_[redacted]", 1), "?"); p.Instance != want {
				t.Errorf("instance %q; want the path as sent (a key's secret redacted), %q", p.Instance, want)
			}
			if p.Title == "" || p.Detail == "" && tt.status != 405 && tt.status != 404 {
				t.Errorf("problem %+v lacks title or detail", p)
			}
			if tt.slug == "invalid-request" && len(p.InvalidParams) == 0 {
				t.Errorf("invalid-request without invalid_params: %s", r.body)
			}
			if want, ok := wantParam[tt.name]; ok && (len(p.InvalidParams) == 0 || p.InvalidParams[0].Name != want) {
				t.Errorf("invalid_params = %+v; want the first named %q", p.InvalidParams, want)
			}
			if want, ok := wantParams[tt.name]; ok {
				var got []string
				for _, ip := range p.InvalidParams {
					got = append(got, ip.Name)
					if !strings.Contains(p.Detail, ip.Name) && !(ip.Name == "name" && strings.Contains(p.Detail, "name in the path")) {
						t.Errorf("detail %q does not name %q", p.Detail, ip.Name)
					}
				}
				if !slices.Equal(got, want) {
					t.Errorf("invalid_params named %q; want %q: %s", got, want, r.body)
				}
			}
			if want, ok := wantReason[tt.name]; ok {
				want, not, _ := strings.Cut(want, "!")
				if len(p.InvalidParams) == 0 || !strings.Contains(p.InvalidParams[0].Reason, want) ||
					not != "" && strings.Contains(p.InvalidParams[0].Reason+p.Detail, not) {
					t.Errorf("invalid_params = %+v (detail %q); want the first reason to say %q and not %q", p.InvalidParams, p.Detail, want, not)
				}
			}
			for _, ip := range p.InvalidParams {
				if strings.Contains(ip.Reason, "default") && ip.Name != "ttl_ms" && ip.Name != "wait_ms" && ip.Name != "owner" {
					t.Errorf("invalid_params %+v: only a field with a default may speak of one", ip)
				}
			}
			if strings.HasPrefix(tt.name, "ContentEncoding") && resp.Header.Get("Accept-Encoding") != "identity" {
				t.Errorf("Accept-Encoding %q; want identity", resp.Header.Get("Accept-Encoding"))
			}
			if tt.status == 405 && resp.Header.Get("Allow") == "" {
				t.Error("405 without Allow")
			}
			if strings.Contains(string(r.body), validToken) {
				t.Error("error body contains the lock token")
			}
		})
	}
	if after := e.snapshot(); after != before {
		t.Errorf("bad requests changed state:\nbefore:\n%s\nafter:\n%s", before, after)
	}
}

// TestAPI_OwnerCountsCharacters: owner is at most 256 characters (code
// points), as openapi.yaml's maxLength counts them, not 256 bytes.
func TestAPI_OwnerCountsCharacters(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	for i, owner := range []string{strings.Repeat("é", 200), strings.Repeat("é", 256), strings.Repeat("日", 255) + "x"} {
		g := e.mustAcquire(fmt.Sprintf("owner-%d", i), map[string]any{"owner": owner})
		if g.Owner != owner {
			t.Errorf("owner %q; want %q", g.Owner, owner)
		}
	}
}

// TestAPI_ManyProblems: a body with thousands of problems (unknown
// members, here) gets an answer naming a bounded number of them and
// counting the rest, not one ever larger than the body.
func TestAPI_ManyProblems(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	const n = 20000
	var b strings.Builder
	b.WriteString("{")
	for i := range n {
		fmt.Fprintf(&b, `"m%d":1,`, i)
	}
	b.WriteString(`"ttl_ms":-1}`)
	r := e.do(e.loose, http.MethodPost, "/v1/locks/many", b.String())
	p := r.problem(t)
	if r.status != http.StatusBadRequest || p.Type != api.ProblemTypePrefix+"invalid-request" {
		t.Fatalf("%d problems = %d %s", n+1, r.status, p.Type)
	}
	if len(r.body) > 8<<10 {
		t.Errorf("answer of %d bytes to %d problems; want a bounded one", len(r.body), n+1)
	}
	if len(p.InvalidParams) == 0 || len(p.InvalidParams) > 16 || p.InvalidParams[0].Name != "m0" {
		t.Errorf("invalid_params %v; want the first few (at most 16), m0 first", p.InvalidParams)
	}
	if want := fmt.Sprintf("%d problems: ", n+1); !strings.HasPrefix(p.Detail, want) || !strings.Contains(p.Detail, "more") {
		t.Errorf("detail %q; want it to count all %d problems and say how many more", p.Detail, n+1)
	}
	if st := e.do(e.client, http.MethodGet, "/v1/locks/many", nil); !strings.Contains(string(st.body), `"held":false`) {
		t.Errorf("after the refusal: %s", st.body)
	}
}

// TestAPI_LongNumberCut: a number of the wrong type is quoted cut short, as
// an unknown field's name is: a megabyte of digits does not come back twice
// in the answer (detail and invalid_params).
func TestAPI_LongNumberCut(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	held := e.mustAcquire("long-number", map[string]any{"ttl_ms": 60000})
	digits := strings.Repeat("1", 512<<10)
	for _, tc := range []struct{ method, path, body string }{
		{http.MethodPost, "/v1/locks/long-number-2", `{"ttl_ms":1.` + digits + `}`},
		{http.MethodPut, "/v1/resources/long-number", `{"fencing_token":1.` + digits + `,"data":1}`},
		{http.MethodPost, "/v1/locks/long-number/extend", `{"ttl_ms":-` + digits + `.5}`},
	} {
		var hdr []string
		if strings.HasSuffix(tc.path, "/extend") {
			hdr = []string{api.LockTokenHeader, held.LockToken}
		}
		r := e.do(e.loose, tc.method, tc.path, tc.body, hdr...)
		p := r.problem(t)
		if r.status != http.StatusBadRequest || p.Type != api.ProblemTypePrefix+"invalid-request" {
			t.Fatalf("%s %s = %d %s", tc.method, tc.path, r.status, p.Type)
		}
		if len(r.body) > 1<<10 || !strings.Contains(p.Detail, "got number ") || !strings.Contains(p.Detail, "…") {
			t.Errorf("%s %s: an answer of %d bytes, detail %.200q; want the number quoted cut short", tc.method, tc.path, len(r.body), p.Detail)
		}
	}
}

// TestAPI_BodyCutShort: a body that stops before its Content-Length is
// answered without the connection's addresses or Go's wording: 408
// request-timeout when the server's read timeout runs out first, 400 when
// the client closes its side. Nothing is acquired.
func TestAPI_BodyCutShort(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	srv := httptest.NewUnstartedServer(e.srv.Config.Handler)
	srv.Config.ReadTimeout = 2 * time.Second // the time the headers have to arrive in, too
	srv.Start()
	t.Cleanup(srv.Close)
	for _, tc := range []struct {
		name      string
		closeSide bool
		status    int
		slug      string
	}{
		{"Timeout", false, http.StatusRequestTimeout, "request-timeout"},
		{"ClosedEarly", true, http.StatusBadRequest, "invalid-request"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", srv.Listener.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			if _, err := io.WriteString(conn, "POST /v1/locks/cut HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"+
				"Content-Length: 100\r\n\r\n{\""); err != nil {
				t.Fatal(err)
			}
			if tc.closeSide {
				if err := conn.(*net.TCPConn).CloseWrite(); err != nil {
					t.Fatal(err)
				}
			}
			resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
			if err != nil {
				t.Fatal(err)
			}
			r := readResponse(t, resp)
			p := r.problem(t)
			if r.status != tc.status || p.Type != api.ProblemTypePrefix+tc.slug || p.Status != tc.status || p.Detail == "" {
				t.Errorf("= %d %s; want %d %s", r.status, r.body, tc.status, tc.slug)
			}
			for _, leak := range []string{"127.0.0.1", "tcp", "i/o timeout", "EOF", conn.LocalAddr().String()} {
				if strings.Contains(string(r.body), leak) {
					t.Errorf("the answer says %q: %s", leak, r.body)
				}
			}
			if tc.status == http.StatusRequestTimeout && !resp.Close {
				t.Error("408 without Connection: close: the rest of the body could still come")
			}
			if tc.status == http.StatusBadRequest && (len(p.InvalidParams) != 1 || p.InvalidParams[0].Name != "body") {
				t.Errorf("invalid_params = %+v; want body", p.InvalidParams)
			}
		})
	}
	var st api.LockStatus
	if r := e.do(e.client, http.MethodGet, "/v1/locks/cut", nil); r.status != 200 {
		t.Fatalf("GET = %d %s", r.status, r.body)
	} else if r.decode(t, &st); st.Held {
		t.Error("a request with a body cut short acquired the lock")
	}
}

// TestAPI_HTTP2Preface: HTTP/2's connection preface (prior knowledge, as
// `curl --http2-prior-knowledge` sends it) to a server without h2c gets a
// 505 http-version-not-supported problem, not a 404 for the path "*", and
// the connection is closed.
func TestAPI_HTTP2Preface(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	for _, tc := range []struct{ name, preface string }{
		{"Preface", "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"},
		// curl's: the preface and its first SETTINGS frame in one write.
		{"Curl", "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x12\x04\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x64\x00\x04\x02\x00\x00\x00\x00\x02\x00\x00\x00\x00"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", e.srv.Listener.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			if _, err := io.WriteString(conn, tc.preface); err != nil {
				t.Fatal(err)
			}
			// A deadline far beyond any answer only guards against a hang.
			if err := conn.SetReadDeadline(time.Now().Add(time.Minute)); err != nil {
				t.Fatal(err)
			}
			br := bufio.NewReader(conn)
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatal(err)
			}
			r := readResponse(t, resp)
			p := r.problem(t)
			if r.status != http.StatusHTTPVersionNotSupported || p.Type != api.ProblemTypePrefix+"http-version-not-supported" ||
				p.Status != r.status || !strings.Contains(p.Detail, "REDFENCE_H2C") || r.header.Get("X-Request-Id") == "" || p.RequestID == "" {
				t.Errorf("HTTP/2 preface = %d %v %s; want 505 http-version-not-supported naming REDFENCE_H2C, with a request ID", r.status, r.header, r.body)
			}
			if !resp.Close {
				t.Error("505 without Connection: close")
			}
			if rest, err := io.ReadAll(br); err != nil || len(rest) != 0 {
				t.Errorf("after the 505: %q, %v; want the connection closed", rest, err)
			}
		})
	}
}

// TestAPI_Connect: CONNECT is answered as any method is: 405 with Allow
// on a path that serves other methods, and 404 not-found elsewhere, also
// for its usual host:port target, whose detail names the method and the
// target (no instance: an authority is no path).
func TestAPI_Connect(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	for _, tc := range []struct {
		name, target string
		status       int
		allow        string
		detail       string
	}{
		{"Authority", "example.com:443", http.StatusNotFound, "", "CONNECT example.com:443"},
		{"Path", "/healthz", http.StatusMethodNotAllowed, "GET, HEAD", "CONNECT"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", e.srv.Listener.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			if _, err := io.WriteString(conn, "CONNECT "+tc.target+" HTTP/1.1\r\nHost: example.com:443\r\n\r\n"); err != nil {
				t.Fatal(err)
			}
			resp, err := http.ReadResponse(bufio.NewReader(conn), &http.Request{Method: http.MethodConnect})
			if err != nil {
				t.Fatal(err)
			}
			r := readResponse(t, resp)
			p := r.problem(t)
			if r.status != tc.status || p.Status != tc.status || r.header.Get("Allow") != tc.allow || !strings.Contains(p.Detail, tc.detail) || p.RequestID == "" {
				t.Errorf("CONNECT %s = %d, Allow %q, %s; want %d, Allow %q, a detail naming %q", tc.target, r.status, r.header.Get("Allow"), r.body, tc.status, tc.allow, tc.detail)
			}
		})
	}
}
