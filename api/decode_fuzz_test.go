package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
)

// FuzzDecode checks the strict body decoder: it never panics, rejects with
// a 4xx problem kind, and what it accepts is exactly one JSON object whose
// fields are all known.
func FuzzDecode(f *testing.F) {
	for _, s := range []string{
		``, `{}`, `{"ttl_ms":1000}`, `{"ttl_ms":1000,"wait_ms":5,"owner":"a"}`, `{"ttl_ms":"1"}`,
		`{"bogus":1}`, `{} {}`, `[]`, `null`, `{"owner":"\u0000"}`, `{"ttl_ms":1e3}`, `{"ttl_ms":-1}`,
		`{"ttl_ms":99999999999999999999}`, "{\"owner\":\"\xff\"}", `{"ttl_ms":1000`, ` {"wait_ms":0} `,
	} {
		f.Add(s, "application/json")
	}
	f.Add(`{"ttl_ms":1000}`, "text/plain")
	f.Add(`{"ttl_ms":1000}`, "application/merge-patch+json; charset=utf-8")
	h := NewHandler(nil, nil, Options{MaxBodyBytes: 4096})
	f.Fuzz(func(t *testing.T, body, ctype string) {
		r := httptest.NewRequest(http.MethodPost, "/v1/locks/x", bytes.NewBufferString(body))
		r.Header.Set("Content-Type", ctype)
		var req AcquireRequest
		err := h.decode(httptest.NewRecorder(), r, &req, true)
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
		var fields map[string]json.RawMessage
		if err := json.Unmarshal([]byte(body), &fields); err != nil {
			t.Fatalf("decode accepted %q, which is not one JSON object: %v", body, err)
		}
		for k := range fields {
			switch k {
			case "ttl_ms", "wait_ms", "owner":
			default:
				t.Fatalf("decode accepted unknown field %q in %q", k, body)
			}
		}
	})
}
