package api

import (
	"bytes"
	"encoding/json"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/service"
)

// stdJSON is what the API wrote with encoding/json before the hand-written
// encoders: json.Encoder without HTML escaping.
func stdJSON(t testing.TB, v any) []byte {
	t.Helper()
	var b bytes.Buffer
	if err := encodeJSON(&b, v); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// awkwardStrings are owners, names and details that exercise JSON string
// escaping.
func awkwardStrings() []string {
	s := []string{
		"", "worker-17", "host:4242", `"quoted"`, `back\slash`, "<script>&amp;</script>", "tab\there",
		"line\nbreak", "cr\rlf", "bell\a", "nul\x00", "esc\x1b", "\b\f", "del\x7f", "café", "日本語",
		"emoji 😀", "\u2028line sep", "para\u2029sep", "\ufeffbom", "\ufffd", "bad\xffutf8", "\xc3",
		"\xed\xa0\x80surrogate", "\xf4\x90\x80\x80 too big", "mixed \"<\u2028>\" \x01 é \xfe",
		strings.Repeat("x", 300), "\u0085next line", "\u00a0nbsp", "/slash/",
	}
	for b := 0; b < 256; b++ {
		s = append(s, string([]byte{byte(b)}), "a"+string([]byte{byte(b)})+"z")
	}
	rng := rand.New(rand.NewPCG(1, 2))
	runes := []rune{'a', '"', '\\', '<', '>', '&', '\n', 0, 0x1f, 0x7f, 0x80, 0x7ff, 0x800, 0x2028, 0x2029, 0xfffd, 0xffff, 0x10000, 0x10ffff, 'é', '😀'}
	for range 500 {
		var b strings.Builder
		for range rng.IntN(12) {
			switch rng.IntN(4) {
			case 0:
				b.WriteByte(byte(rng.IntN(256))) // maybe invalid UTF-8
			case 1:
				b.WriteRune(runes[rng.IntN(len(runes))])
			default:
				b.WriteRune(rune(rng.IntN(0x110000)))
			}
		}
		s = append(s, b.String())
	}
	return s
}

func TestAppendJSONString(t *testing.T) {
	for _, s := range awkwardStrings() {
		want := bytes.TrimSuffix(stdJSON(t, s), []byte("\n"))
		if got := appendJSONString(nil, s); !bytes.Equal(got, want) {
			t.Errorf("appendJSONString(%q) = %s; encoding/json: %s", s, got, want)
		}
		if got := appendJSONString([]byte("x"), []byte(s)); !bytes.Equal(got[1:], want) {
			t.Errorf("appendJSONString([]byte(%q)) = %s; encoding/json: %s", s, got[1:], want)
		}
	}
}

// FuzzAppendJSONString holds the string escaper to encoding/json's output,
// byte for byte.
func FuzzAppendJSONString(f *testing.F) {
	for _, s := range awkwardStrings()[:40] {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		want := bytes.TrimSuffix(stdJSON(t, s), []byte("\n"))
		if got := appendJSONString(nil, s); !bytes.Equal(got, want) {
			t.Fatalf("appendJSONString(%q) = %s; encoding/json: %s", s, got, want)
		}
	})
}

func TestAppendLockResponse(t *testing.T) {
	strs := awkwardStrings()
	rng := rand.New(rand.NewPCG(3, 4))
	ints := []int64{0, 1, -1, 34, 30000, math.MaxInt64, math.MinInt64}
	pick := func() int64 {
		if rng.IntN(2) == 0 {
			return ints[rng.IntN(len(ints))]
		}
		return rng.Int64() - math.MaxInt64/2
	}
	for i, name := range strs {
		r := &LockResponse{Name: name, FencingToken: pick(), TTLMS: pick(), ValidityMS: pick(),
			ExpiresAt: strs[rng.IntN(len(strs))], Owner: strs[(i*7)%len(strs)]}
		if i%3 != 0 {
			r.LockToken = strs[rng.IntN(len(strs))]
		}
		want := stdJSON(t, r)
		got := appendLockResponse(nil, r, r.ExpiresAt)
		if !bytes.Equal(got, want) {
			t.Fatalf("appendLockResponse(%+v)\n got %s\nwant %s", r, got, want)
		}
		sameAsMap(t, got, want)
	}
}

// sameAsMap checks that got and want decode to the same JSON value.
func sameAsMap(t *testing.T, got, want []byte) {
	t.Helper()
	var g, w map[string]any
	if err := json.Unmarshal(got, &g); err != nil {
		t.Fatalf("%s is not JSON: %v", got, err)
	}
	if err := json.Unmarshal(want, &w); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(g, w) {
		t.Fatalf("got %v; want %v", g, w)
	}
}

func TestAppendProblem(t *testing.T) {
	strs := awkwardStrings()
	rng := rand.New(rand.NewPCG(5, 6))
	str := func() string {
		if rng.IntN(4) == 0 {
			return ""
		}
		return strs[rng.IntN(len(strs))]
	}
	for range 2000 {
		p := &Problem{Type: str(), Title: str(), Status: rng.IntN(600) - 50, Detail: str(), Instance: str(), RequestID: str()}
		if rng.IntN(2) == 0 {
			v := rng.Int64() - math.MaxInt64/2
			p.RetryAfterMS = &v
		}
		if rng.IntN(2) == 0 {
			v := rng.Int64()
			p.CurrentFencingToken = &v
		}
		switch rng.IntN(3) {
		case 1:
			p.Nodes = []NodeOutcome{} // empty: left out, as omitempty does
		case 2:
			for range 1 + rng.IntN(4) {
				p.Nodes = append(p.Nodes, NodeOutcome{Address: str(), Outcome: str(), Error: str()})
			}
		}
		switch rng.IntN(3) {
		case 1:
			p.InvalidParams = []InvalidParam{}
		case 2:
			for range 1 + rng.IntN(3) {
				p.InvalidParams = append(p.InvalidParams, InvalidParam{Name: str(), Reason: str()})
			}
		}
		want := stdJSON(t, p)
		got := appendProblem(nil, p)
		if !bytes.Equal(got, want) {
			t.Fatalf("appendProblem(%+v)\n got %s\nwant %s", p, got, want)
		}
		sameAsMap(t, got, want)
	}
}

// lockResponse is the LockResponse of g for a request that arrived at
// arrived, built plainly: what writeLock must encode.
func lockResponse(name string, g *service.Grant, withToken bool, arrived time.Time) *LockResponse {
	resp := &LockResponse{
		Name:         name,
		FencingToken: int64(g.Fencing),
		TTLMS:        g.TTL.Milliseconds(),
		ValidityMS:   max(g.ValidityFrom(arrived).Milliseconds(), 0),
		ExpiresAt:    g.Expires.UTC().Format(time.RFC3339Nano),
		Owner:        g.Owner,
	}
	if withToken {
		resp.LockToken = g.Token
	}
	return resp
}

// TestWriteLock compares the grant the handler writes with what
// lockResponse and encoding/json made of it.
func TestWriteLock(t *testing.T) {
	now := time.Date(2026, 3, 1, 12, 0, 0, 123456789, time.FixedZone("CET", 3600))
	h := NewHandler(nil, nil, Options{Now: func() time.Time { return now }})
	for i, owner := range awkwardStrings() {
		for _, withToken := range []bool{true, false} {
			g := &service.Grant{Key: "k", Token: "XO-BHVUBfJCMQRnPhNlbb6nNeSU", Fencing: fencing.Token(i + 1),
				TTL: time.Duration(i) * time.Millisecond, Start: now, Expires: now.Add(time.Duration(i*i) * time.Microsecond), Owner: owner}
			if i%5 == 0 {
				g.Expires = now.Add(-time.Second) // validity clamps to 0
			}
			w := httptest.NewRecorder()
			h.writeLock(w, http.StatusCreated, "orders:"+owner, g, withToken, now)
			want := stdJSON(t, lockResponse("orders:"+owner, g, withToken, now))
			if w.Code != http.StatusCreated || !bytes.Equal(w.Body.Bytes(), want) {
				t.Fatalf("writeLock = %d %s; want 201 %s", w.Code, w.Body.Bytes(), want)
			}
			if ct, cc := w.Header().Get("Content-Type"), w.Header().Get("Cache-Control"); ct != "application/json" || cc != "no-store" {
				t.Fatalf("writeLock headers: Content-Type %q, Cache-Control %q", ct, cc)
			}
		}
	}
}

func TestAppendRFC3339Nano(t *testing.T) {
	for _, tm := range []time.Time{
		time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC),
		time.Date(2026, 3, 1, 12, 0, 0, 100, time.FixedZone("x", -7*3600)),
		time.Date(1, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(9999, 12, 31, 23, 59, 59, 999999999, time.UTC),
		time.Now(), time.Now().Add(29 * time.Second),
	} {
		if got, want := string(appendRFC3339Nano(nil, tm)), tm.UTC().Format(time.RFC3339Nano); got != want {
			t.Errorf("appendRFC3339Nano(%v) = %s; want %s", tm, got, want)
		}
	}
}

// TestFastAcquireRequest pins which bodies take the fast path: the plain
// ones clients send must, and none that encoding/json would read otherwise.
func TestFastAcquireRequest(t *testing.T) {
	i64 := func(v int64) *int64 { return &v }
	str := func(v string) *string { return &v }
	for _, tc := range []struct {
		body string
		ok   bool
		want AcquireRequest
	}{
		{`{}`, true, AcquireRequest{}},
		{` { } `, true, AcquireRequest{}},
		{`{"ttl_ms":30000,"wait_ms":5000,"owner":"worker-17"}`, true, AcquireRequest{i64(30000), i64(5000), str("worker-17")}},
		{"{\n  \"owner\": \"caf\xc3\xa9\",\n  \"ttl_ms\": 10000\n}\n", true, AcquireRequest{TTLMS: i64(10000), Owner: str("café")}},
		{`{"ttl_ms":-5}`, true, AcquireRequest{TTLMS: i64(-5)}},
		{`{"ttl_ms":-0}`, true, AcquireRequest{TTLMS: i64(0)}},
		{`{"ttl_ms":999999999999999999}`, true, AcquireRequest{TTLMS: i64(999999999999999999)}},
		{`{"ttl_ms":1,"ttl_ms":2}`, false, AcquireRequest{}}, // repeated: encoding/json's path refuses it
		{`{"owner":"a","owner":null}`, false, AcquireRequest{}},
		{`{"ttl_ms":null}`, false, AcquireRequest{}}, // null: the same
		{`{"owner":null}`, false, AcquireRequest{}},
		{`{"owner":""}`, true, AcquireRequest{Owner: str("")}},
		{`{"ttl_ms":1000000000000000000}`, false, AcquireRequest{}}, // 19 digits: encoding/json decides
		{`{"ttl_ms":1.5}`, false, AcquireRequest{}},
		{`{"ttl_ms":1e3}`, false, AcquireRequest{}},
		{`{"ttl_ms":01}`, false, AcquireRequest{}},
		{`{"ttl_ms":"1"}`, false, AcquireRequest{}},
		{`{"TTL_MS":1}`, false, AcquireRequest{}},
		{`{"owner":"a\"b"}`, false, AcquireRequest{}},
		{"{\"owner\":\"\xff\"}", false, AcquireRequest{}},
		{`{"bogus":1}`, false, AcquireRequest{}},
		{`{}{}`, false, AcquireRequest{}},
		{"\v{}", false, AcquireRequest{}},
		{`{"ttl_ms":1,}`, false, AcquireRequest{}},
	} {
		var got AcquireRequest
		ok := fastAcquireRequest([]byte(tc.body), &got)
		if ok != tc.ok || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("fastAcquireRequest(%q) = %v %s; want %v %s", tc.body, ok, showAcquire(got), tc.ok, showAcquire(tc.want))
		}
	}
}

// TestReadBody checks the body limit: exactly the limit is read, one byte
// more is a *http.MaxBytesError, as with http.MaxBytesReader.
func TestReadBody(t *testing.T) {
	for _, n := range []int{0, 1, 511, 512, 1023, 1024, 1025, 4095, 4096, 4097, 10000} {
		for _, limit := range []int64{0, 1, 512, 1024, 4096} {
			body := strings.Repeat("x", n)
			got, err := readBody(make([]byte, 0, 16), iotestHalfReader{strings.NewReader(body)}, limit)
			if int64(n) > limit {
				if _, ok := err.(*http.MaxBytesError); !ok || err.(*http.MaxBytesError).Limit != limit {
					t.Errorf("n %d limit %d: err %v; want MaxBytesError", n, limit, err)
				}
				continue
			}
			if err != nil || string(got) != body {
				t.Errorf("n %d limit %d: %d bytes, %v", n, limit, len(got), err)
			}
		}
	}
}

// iotestHalfReader reads at most half of what is asked at a time.
type iotestHalfReader struct{ r *strings.Reader }

func (h iotestHalfReader) Read(p []byte) (int, error) {
	return h.r.Read(p[:(len(p)+1)/2])
}
