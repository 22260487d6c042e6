package api

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/service"
)

// BenchmarkDecodeAcquire measures the strict JSON decoding of an acquire body,
// with a new request and recorder each time.
func BenchmarkDecodeAcquire(b *testing.B) {
	h := NewHandler(nil, nil, Options{})
	body := []byte(`{"ttl_ms":30000,"wait_ms":5000,"owner":"worker-17"}`)
	b.ReportAllocs()
	for b.Loop() {
		r := httptest.NewRequest(http.MethodPost, "/v1/locks/x", bytes.NewReader(body))
		r.Header.Set("Content-Type", "application/json")
		var req AcquireRequest
		if err := h.decodeAcquire(r, &req); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDecodeAcquireOnly is BenchmarkDecodeAcquire without making the
// request: reading, checking and decoding the body alone.
func BenchmarkDecodeAcquireOnly(b *testing.B) {
	h := NewHandler(nil, nil, Options{})
	r, body := benchRequest(http.MethodPost, "/v1/locks/x", `{"ttl_ms":30000,"wait_ms":5000,"owner":"worker-17"}`,
		"Content-Type", "application/json")
	b.ReportAllocs()
	for b.Loop() {
		body.Seek(0, io.SeekStart)
		var req AcquireRequest
		if err := h.decodeAcquire(r, &req); err != nil || req.Owner == nil {
			b.Fatal(err)
		}
	}
}

func benchGrant() *service.Grant {
	now := time.Now()
	return &service.Grant{Key: "orders", Token: "XO-BHVUBfJCMQRnPhNlbb6nNeSU", Fencing: fencing.Token(34),
		TTL: 30 * time.Second, Start: now, Expires: now.Add(29 * time.Second), Owner: "worker-17"}
}

// BenchmarkEncodeLockResponse measures building and writing a grant, to a
// new recorder each time.
func BenchmarkEncodeLockResponse(b *testing.B) {
	h := NewHandler(nil, nil, Options{})
	g := benchGrant()
	b.ReportAllocs()
	for b.Loop() {
		h.writeLock(httptest.NewRecorder(), http.StatusCreated, "orders", g, true, g.Start)
	}
}

// BenchmarkEncodeLockResponseOnly is BenchmarkEncodeLockResponse without
// making the recorder.
func BenchmarkEncodeLockResponseOnly(b *testing.B) {
	h := NewHandler(nil, nil, Options{})
	g := benchGrant()
	w := &benchWriter{h: http.Header{}}
	b.ReportAllocs()
	for b.Loop() {
		w.reset()
		h.writeLock(w, http.StatusCreated, "orders", g, true, g.Start)
	}
}
