package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
)

// decodeSeeds are bodies for the decode fuzz tests: plain ones (the fast
// path's) and every corner the fast path must leave to encoding/json or get
// exactly right.
var decodeSeeds = []string{
	``, `{}`, `{"ttl_ms":1000}`, `{"ttl_ms":1000,"wait_ms":5,"owner":"a"}`, `{"ttl_ms":"1"}`,
	`{"bogus":1}`, `{} {}`, `[]`, `null`, `{"owner":"\u0000"}`, `{"ttl_ms":1e3}`, `{"ttl_ms":-1}`,
	`{"ttl_ms":99999999999999999999}`, "{\"owner\":\"\xff\"}", `{"ttl_ms":1000`, ` {"wait_ms":0} `,
	// repeated members and null: refused
	`{"ttl_ms":1,"ttl_ms":2}`, `{"owner":"a","owner":null}`, `{"owner":null,"owner":"b"}`,
	`{"ttl_ms":"x","ttl_ms":1}`, `{"owner":"alice","owner":5}`, `{"owner":"alice","bogus":1}`,
	`{"ttl_ms":null,"wait_ms":null,"owner":null}`,
	// key spelling: encoding/json folds case (and ſ, K), reads escapes; the
	// contract does not fold
	`{"TTL_MS":1}`, `{"Owner":"x"}`, `{"ttl_m\u017f":1}`, `{"ttl\u005fms":1}`, `{"owner\u0000":1}`,
	// numbers
	`{"ttl_ms":-0}`, `{"ttl_ms":0}`, `{"ttl_ms":01}`, `{"ttl_ms":1.0}`, `{"ttl_ms":1E2}`, `{"ttl_ms":-}`,
	`{"ttl_ms":999999999999999999}`, `{"ttl_ms":9223372036854775807}`, `{"ttl_ms":9223372036854775808}`,
	`{"ttl_ms":-9223372036854775808}`, `{"ttl_ms":1x}`, `{"ttl_ms":+1}`, `{"ttl_ms":true}`,
	`{"ttl_ms":{}}`, `{"ttl_ms":[1]}`, `{"ttl_ms":nul}`, `{"ttl_ms":nullx}`,
	// strings
	`{"owner":"\"q\""}`, `{"owner":"a\\b"}`, `{"owner":"\ud800"}`, `{"owner":"\ud83d\ude00"}`,
	"{\"owner\":\"\xe2\x80\xa8\"}", "{\"owner\":\"caf\xc3\xa9 \xe6\x97\xa5\"}", "{\"owner\":\"\xed\xa0\x80\"}",
	"{\"owner\":\"a\tb\"}", `{"owner":"<>&"}`, `{"owner":""}`, "{\"owner\":\"\x7f\"}",
	`{"owner":true}`, `{"owner":{}}`, `{"owner":[]}`, `{"owner":"x"` + "\n}",
	// whitespace, trailing data
	"\t{\r\n\"ttl_ms\" : 1 ,\n\"owner\":\"w\" }\n", "\v{}", "{}\v", "\u00a0{}", "{}\u00a0", `{},`, `{}}`,
	`{"ttl_ms":1,}`, `{,}`, `{"ttl_ms" 1}`, `{"ttl_ms":1 "wait_ms":2}`, `{}` + "\x00",
	`{"a":1,"ttl_ms":"x"}`,
}

// FuzzDecode checks the strict body decoders: they never panic, reject with
// a 4xx problem kind, and what they accept is exactly one JSON object whose
// fields are all known. It is also a differential test of the acquire
// decoder (decodeAcquire, with its fast path) against the encoding/json one
// (decode): they must agree on accepting, on the problem of a refusal, and
// on the value decoded, even when refused (acquire logs the owner of a
// refused body).
func FuzzDecode(f *testing.F) {
	for _, s := range decodeSeeds {
		f.Add(s, "application/json")
	}
	f.Add(`{"ttl_ms":1000}`, "text/plain")
	f.Add(`{"ttl_ms":1000}`, "application/merge-patch+json; charset=utf-8")
	f.Add(`{"ttl_ms":1000}`, "Application/JSON")
	f.Add(``, "")
	h := NewHandler(nil, nil, Options{MaxBodyBytes: 4096})
	f.Fuzz(func(t *testing.T, body, ctype string) { checkDecode(t, h, body, ctype) })
}

// FuzzDecodeAcquire is FuzzDecode with the Content-Type fixed, so that the
// fuzzer spends its time on the JSON, where the fast path is.
func FuzzDecodeAcquire(f *testing.F) {
	for _, s := range decodeSeeds {
		f.Add(s)
	}
	h := NewHandler(nil, nil, Options{MaxBodyBytes: 4096})
	f.Fuzz(func(t *testing.T, body string) { checkDecode(t, h, body, "application/json") })
}

func checkDecode(t *testing.T, h *Handler, body, ctype string) {
	request := func() *http.Request {
		r := httptest.NewRequest(http.MethodPost, "/v1/locks/x", strings.NewReader(body))
		r.Header.Set("Content-Type", ctype)
		return r
	}
	var req AcquireRequest
	err := h.decode(httptest.NewRecorder(), request(), &req, true)
	var fast AcquireRequest
	fastErr := h.decodeAcquire(request(), &fast)
	if !sameRequestError(err, fastErr) {
		t.Fatalf("body %q: decode = %v, decodeAcquire = %v", body, err, fastErr)
	}
	if !reflect.DeepEqual(req, fast) {
		t.Fatalf("body %q: decode gave %s, decodeAcquire %s", body, showAcquire(req), showAcquire(fast))
	}
	var direct AcquireRequest
	if fastAcquireRequest([]byte(body), &direct) {
		var slow AcquireRequest
		if err := decodeJSON([]byte(body), &slow); err != nil {
			t.Fatalf("the fast path accepted %q, encoding/json refuses it: %v", body, err)
		}
		if !reflect.DeepEqual(direct, slow) {
			t.Fatalf("body %q: the fast path gave %s, encoding/json %s", body, showAcquire(direct), showAcquire(slow))
		}
	}
	if err != nil {
		var re *requestError
		if !errors.As(err, &re) || re.kind.status < 400 || re.kind.status > 499 {
			t.Fatalf("decode(%q) = %v; want a 4xx request error", body, err)
		}
		return
	}
	if len(bytes.TrimSpace([]byte(body))) == 0 {
		return
	}
	// One JSON object, each member known (spelt exactly), once, and not null.
	dec := json.NewDecoder(strings.NewReader(body))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		t.Fatalf("decode accepted %q, which is not a JSON object", body)
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			t.Fatalf("decode accepted %q: %v", body, err)
		}
		k := tok.(string)
		switch k {
		case "ttl_ms", "wait_ms", "owner":
		default:
			t.Fatalf("decode accepted unknown field %q in %q", k, body)
		}
		if seen[k] {
			t.Fatalf("decode accepted %q with %q twice", body, k)
		}
		seen[k] = true
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			t.Fatalf("decode accepted %q: %v", body, err)
		}
		if string(v) == "null" {
			t.Fatalf("decode accepted %q with %q null", body, k)
		}
	}
}

// sameRequestError reports whether a and b are the same answer to the
// client: both nil, or problems of the same kind, detail and parameters.
func sameRequestError(a, b error) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	var ra, rb *requestError
	if !errors.As(a, &ra) || !errors.As(b, &rb) {
		return a.Error() == b.Error()
	}
	return ra.kind == rb.kind && ra.detail == rb.detail && reflect.DeepEqual(ra.params, rb.params)
}

func showAcquire(r AcquireRequest) string {
	b, _ := json.Marshal(r)
	s := string(b)
	if r.TTLMS != nil && *r.TTLMS == 0 {
		s += " (ttl_ms 0 set)"
	}
	return s
}

// TestDecode_Charset: JSON is UTF-8 (RFC 8259): a charset parameter that
// says so, in any case and by any of its WHATWG labels, is accepted; any
// other is 415.
func TestDecode_Charset(t *testing.T) {
	h := NewHandler(nil, nil, Options{MaxBodyBytes: 4096})
	for ct, ok := range map[string]bool{
		"application/json; charset=utf-8":             true,
		"application/json;charset=UTF-8":              true,
		"application/problem+json; charset=utf-8":     true,
		"application/json; charset=utf8":              true, // a WHATWG alias of UTF-8
		"application/json; charset=UTF8":              true,
		"application/json; charset=utf-8-sig":         false,
		"application/json; charset=latin1":            false,
		"application/json; charset=utf-16":            false,
		"application/merge-patch+json; charset=ascii": false,
	} {
		r := httptest.NewRequest(http.MethodPost, "/v1/locks/x", strings.NewReader(`{"ttl_ms":1000}`))
		r.Header.Set("Content-Type", ct)
		var req AcquireRequest
		err := h.decodeAcquire(r, &req)
		var re *requestError
		switch {
		case ok && err != nil:
			t.Errorf("%q: %v; want accepted", ct, err)
		case !ok && (!errors.As(err, &re) || re.kind != kMediaType):
			t.Errorf("%q: %v; want unsupported-media-type", ct, err)
		}
	}
}

// TestDecodeJSON_TooDeep: a member nested deeper than encoding/json reads
// (10,000 levels) is named itself, not the body: free-form data with its
// own limit's reason, a typed field with the type it must have, an unknown
// member as unknown.
func TestDecodeJSON_TooDeep(t *testing.T) {
	deep := strings.Repeat("[", 10001) + strings.Repeat("]", 10001)
	for _, tc := range []struct {
		body string
		v    any
		name string
		in   string
	}{
		{`{"fencing_token":1,"data":` + deep + `}`, &PutResourceRequest{}, "data", "levels deep"},
		{`{"data":` + deep + `,"fencing_token":1}`, &PutResourceRequest{}, "data", "levels deep"},
		{`{"ttl_ms":` + deep + `}`, &AcquireRequest{}, "ttl_ms", "must be an integer"},
		{`{"owner":"a","bogus":` + deep + `}`, &AcquireRequest{}, "bogus", "unknown field"},
	} {
		var re *requestError
		if err := decodeJSON([]byte(tc.body), tc.v); !errors.As(err, &re) || re.kind != kInvalid || len(re.params) != 1 ||
			re.params[0].Name != tc.name || !strings.Contains(re.params[0].Reason, tc.in) {
			t.Errorf("decode %.40q… = %v; want invalid naming %s (%q)", tc.body, err, tc.name, tc.in)
		}
	}
	// Within encoding/json's limit the member is read, and judged by its
	// own rules (data by the API's depth check).
	if err := decodeJSON([]byte(`{"ttl_ms":`+strings.Repeat("[", 9000)+strings.Repeat("]", 9000)+`}`), &AcquireRequest{}); err == nil || !strings.Contains(err.Error(), "ttl_ms") {
		t.Errorf("ttl_ms 9,000 levels deep: %v; want refused naming ttl_ms", err)
	}
}
