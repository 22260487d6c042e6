package api

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/apikey"
	"github.com/redfence/redfence/internal/refstore"
	"github.com/redfence/redfence/service"
)

// This file benchmarks the HTTP layer alone: full requests through
// Handler.ServeHTTP (router, middleware, auth, decoding, encoding, logging,
// metrics) over in-memory FAKES of the lock manager, the reference store and
// the API key table. The fakes do no I/O and are not the real Redis/Postgres
// code: numbers here are the API layer's own cost, nothing more.

// benchFakeLocker is an in-memory fake Locker for HTTP-layer benchmarks
// only: one lease per key, no Redis, no expiry.
type benchFakeLocker struct {
	now       func() time.Time
	mu        sync.Mutex
	held      map[string]string // key → lock token
	fencing   fencing.Token
	n         uint64
	last      map[string]fencing.Record // what benchFakeStore.Last answers
	lastCalls int                       // how many times it was asked
	// taking, if set, runs first in Acquire and Extend: a test's way to
	// let time pass in them (a wait).
	taking func()
	// lastGate, if set, holds benchFakeStore.Last until it is closed: a
	// slow Postgres.
	lastGate chan struct{}
}

func newBenchFakeLocker() *benchFakeLocker {
	return &benchFakeLocker{now: time.Now, held: map[string]string{}, last: map[string]fencing.Record{}}
}

func (l *benchFakeLocker) Acquire(_ context.Context, key string, req service.Request) (*service.Grant, error) {
	if l.taking != nil {
		l.taking()
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.held[key]; ok {
		return nil, &service.Error{Op: "acquire", Key: key, Err: service.ErrHeld, RetryAfter: 20 * time.Second,
			Nodes: []service.NodeResult{{Addr: "127.0.0.1:6379", Outcome: service.No}, {Addr: "127.0.0.1:6380", Outcome: service.No},
				{Addr: "127.0.0.1:6381", Outcome: service.No}}}
	}
	l.n++
	var b [20]byte
	binary.BigEndian.PutUint64(b[:], l.n)
	token := base64.RawURLEncoding.EncodeToString(b[:])
	l.held[key] = token
	l.fencing++
	l.last[key] = fencing.Record{Claim: fencing.Claim{Key: key, Owner: req.Owner, Holder: service.HolderID(token)}, Token: l.fencing}
	now := l.now()
	return &service.Grant{Key: key, Token: token, Fencing: l.fencing, TTL: req.TTL, Start: now,
		Expires: now.Add(req.TTL - 2*time.Millisecond), Owner: req.Owner}, nil
}

func (l *benchFakeLocker) Extend(_ context.Context, key, token string, ttl time.Duration) (*service.Grant, error) {
	if l.taking != nil {
		l.taking()
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.held[key] != token {
		return nil, &service.Error{Op: "extend", Key: key, Err: service.ErrLost}
	}
	rec := l.last[key]
	now := l.now()
	return &service.Grant{Key: key, Token: token, Fencing: rec.Token, TTL: ttl, Start: now,
		Expires: now.Add(ttl - 2*time.Millisecond), Owner: rec.Owner}, nil
}

func (l *benchFakeLocker) Release(_ context.Context, key, token string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.held[key] != token {
		return &service.Error{Op: "release", Key: key, Err: service.ErrNotHolder}
	}
	delete(l.held, key)
	return nil
}

func (l *benchFakeLocker) Status(context.Context, string) (*service.Status, error) {
	return &service.Status{}, nil
}
func (l *benchFakeLocker) Nodes(context.Context) []service.NodeStatus { return nil }
func (l *benchFakeLocker) Quorum() int                                { return 2 }

// benchFakeStore is an in-memory fake Store for HTTP-layer benchmarks only.
// Its Last answers from the fake locker's grants, as store.DB's does from
// Postgres (without the round trip).
type benchFakeStore struct{ l *benchFakeLocker }

func (s benchFakeStore) PutResourceIf(context.Context, string, fencing.Token, json.RawMessage, refstore.Condition) (*refstore.Resource, error) {
	return nil, refstore.ErrNotFound
}
func (s benchFakeStore) GetResource(context.Context, string) (*refstore.Resource, error) {
	return nil, refstore.ErrNotFound
}
func (s benchFakeStore) Ping(context.Context) error { return nil }
func (s benchFakeStore) Last(_ context.Context, key string) (fencing.Record, error) {
	s.l.mu.Lock()
	gate := s.l.lastGate
	s.l.mu.Unlock()
	if gate != nil {
		<-gate
	}
	s.l.mu.Lock()
	defer s.l.mu.Unlock()
	s.l.lastCalls++
	return s.l.last[key], nil
}

// benchFakeKeys is an in-memory fake API key table for HTTP-layer
// benchmarks only.
type benchFakeKeys map[string]*apikey.Key

func (k benchFakeKeys) Key(_ context.Context, id string) (*apikey.Key, error) {
	if key, ok := k[id]; ok {
		return key, nil
	}
	return nil, apikey.ErrNotFound
}

// benchWriter is a reusable http.ResponseWriter that keeps the status and
// discards the body.
type benchWriter struct {
	h      http.Header
	status int
	n      int
	body   []byte // the last body, if keep
	keep   bool
}

func (w *benchWriter) Header() http.Header { return w.h }
func (w *benchWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
}
func (w *benchWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	w.n += len(p)
	if w.keep {
		w.body = append(w.body, p...)
	}
	return len(p), nil
}
func (w *benchWriter) reset() {
	clear(w.h)
	w.status, w.n, w.body = 0, 0, w.body[:0]
}

// benchBody is a request body that can be read again.
type benchBody struct{ bytes.Reader }

func (*benchBody) Close() error { return nil }

// benchAPIKey is the API key of the auth variants (tenant "bench").
const benchAPIKey = apikey.Prefix + "0123456789abcdef_" + "sEcReTsEcReTsEcReTsEcReTsEcReTsEcReTsEcReTx"

// benchHandler returns a Handler over fakes that logs at Info, as JSON, to
// io.Discard (the production default level: access and audit lines are
// formatted).
func benchHandler(b *testing.B, auth bool) (*Handler, *benchFakeLocker) {
	b.Helper()
	l := newBenchFakeLocker()
	opts := Options{Logger: slog.New(slog.NewJSONHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelInfo}))}
	if auth {
		id, ok := apikey.ParseID(benchAPIKey)
		if !ok {
			b.Fatalf("benchAPIKey is malformed")
		}
		keys := benchFakeKeys{id: {ID: id, Tenant: "bench", Scopes: apikey.AllScopes(), Hash: apikey.Hash(benchAPIKey)}}
		opts.Auth = NewKeyAuth(keys, KeyAuthOptions{CacheTTL: time.Hour})
		opts.RateLimit = 1e9
	}
	return NewHandler(l, benchFakeStore{l}, opts), l
}

func benchRequest(method, target, body string, hdr ...string) (*http.Request, *benchBody) {
	r := httptest.NewRequest(method, target, nil)
	bb := &benchBody{}
	bb.Reset([]byte(body))
	r.Body = bb
	r.ContentLength = int64(len(body))
	r.RemoteAddr = "192.0.2.1:43210"
	for i := 0; i+1 < len(hdr); i += 2 {
		r.Header.Set(hdr[i], hdr[i+1])
	}
	return r, bb
}

// BenchmarkHandlerCycle measures one acquire (POST /v1/locks/{name}, 201
// with a JSON body) and its release (DELETE, 204) through ServeHTTP, with
// the access log, the audit lines and the metrics of each request. The lock
// manager and the store are in-memory fakes: this is the HTTP layer's cost.
func BenchmarkHandlerCycle(b *testing.B) {
	for _, variant := range []struct {
		name string
		auth bool
	}{{"open", false}, {"auth", true}} {
		b.Run(variant.name, func(b *testing.B) {
			h, l := benchHandler(b, variant.auth)
			var hdr []string
			if variant.auth {
				hdr = []string{"Authorization", "Bearer " + benchAPIKey}
			}
			acq, acqBody := benchRequest(http.MethodPost, "/v1/locks/orders", `{"ttl_ms":30000,"owner":"worker-17"}`,
				append([]string{"Content-Type", "application/json"}, hdr...)...)
			rel, _ := benchRequest(http.MethodDelete, "/v1/locks/orders", "", hdr...)
			rel.Header.Set(LockTokenHeader, "")
			token := rel.Header[LockTokenHeader]
			lockKey := "orders"
			if variant.auth {
				lockKey = "bench/orders"
			}
			w := &benchWriter{h: http.Header{}, keep: true}
			b.ReportAllocs()
			for b.Loop() {
				w.reset()
				acqBody.Seek(0, io.SeekStart)
				h.ServeHTTP(w, acq)
				if w.status != http.StatusCreated {
					b.Fatalf("acquire = %d %s", w.status, w.body)
				}
				// The client's part: send the lock token back. The fake
				// knows it, which saves allocating it from the body.
				l.mu.Lock()
				token[0] = l.held[lockKey]
				l.mu.Unlock()
				if !bytes.Contains(w.body, []byte(token[0])) {
					b.Fatalf("the lock token is not in %s", w.body)
				}
				w.reset()
				h.ServeHTTP(w, rel)
				if w.status != http.StatusNoContent {
					b.Fatalf("release = %d %s", w.status, w.body)
				}
			}
		})
	}
}

// BenchmarkHandlerHeld measures an acquire refused because the lock is held
// (409 lock-held problem+json, with the refusal's audit and error lines).
func BenchmarkHandlerHeld(b *testing.B) {
	h, _ := benchHandler(b, false)
	acq, acqBody := benchRequest(http.MethodPost, "/v1/locks/orders", `{"ttl_ms":30000,"owner":"worker-17"}`, "Content-Type", "application/json")
	w := &benchWriter{h: http.Header{}}
	h.ServeHTTP(w, acq)
	if w.status != http.StatusCreated {
		b.Fatalf("acquire = %d", w.status)
	}
	b.ReportAllocs()
	for b.Loop() {
		w.reset()
		acqBody.Seek(0, io.SeekStart)
		h.ServeHTTP(w, acq)
		if w.status != http.StatusConflict {
			b.Fatalf("acquire of a held lock = %d", w.status)
		}
	}
}

// BenchmarkHandlerCycleParallel is BenchmarkHandlerCycle/open from
// GOMAXPROCS goroutines at once, each on its own lock.
func BenchmarkHandlerCycleParallel(b *testing.B) {
	h, l := benchHandler(b, false)
	var n atomic.Int64
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		name := fmt.Sprintf("orders-%d", n.Add(1))
		acq, acqBody := benchRequest(http.MethodPost, "/v1/locks/"+name, `{"ttl_ms":30000,"owner":"worker-17"}`, "Content-Type", "application/json")
		rel, _ := benchRequest(http.MethodDelete, "/v1/locks/"+name, "")
		rel.Header.Set(LockTokenHeader, "")
		token := rel.Header[LockTokenHeader]
		w := &benchWriter{h: http.Header{}}
		for pb.Next() {
			w.reset()
			acqBody.Seek(0, io.SeekStart)
			h.ServeHTTP(w, acq)
			if w.status != http.StatusCreated {
				b.Fatalf("acquire = %d", w.status)
			}
			l.mu.Lock()
			token[0] = l.held[name]
			l.mu.Unlock()
			w.reset()
			h.ServeHTTP(w, rel)
			if w.status != http.StatusNoContent {
				b.Fatalf("release = %d", w.status)
			}
		}
	})
}
