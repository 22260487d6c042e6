package api

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/service"
)

// BenchmarkDecodeAcquire measures the strict JSON decoding of an acquire body.
func BenchmarkDecodeAcquire(b *testing.B) {
	h := NewHandler(nil, nil, Options{})
	body := []byte(`{"ttl_ms":30000,"wait_ms":5000,"owner":"worker-17"}`)
	b.ReportAllocs()
	for b.Loop() {
		r := httptest.NewRequest(http.MethodPost, "/v1/locks/x", bytes.NewReader(body))
		r.Header.Set("Content-Type", "application/json")
		var req AcquireRequest
		if err := h.decode(httptest.NewRecorder(), r, &req, true); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkEncodeLockResponse measures building and writing a grant.
func BenchmarkEncodeLockResponse(b *testing.B) {
	h := NewHandler(nil, nil, Options{})
	now := time.Now()
	g := &service.Grant{Key: "orders", Token: "XO-BHVUBfJCMQRnPhNlbb6nNeSU", Fencing: fencing.Token(34),
		TTL: 30 * time.Second, Start: now, Expires: now.Add(29 * time.Second), Owner: "worker-17"}
	b.ReportAllocs()
	for b.Loop() {
		writeJSON(httptest.NewRecorder(), http.StatusCreated, h.lockResponse("orders", g, true))
	}
}
