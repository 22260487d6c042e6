package api_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redfence/redfence/api"
	"github.com/redfence/redfence/internal/testutil"
	"github.com/redfence/redfence/service"
)

// TestAcquire_WaitOutlastsWriteTimeout: a blocking acquire granted after
// the server's WriteTimeout (counted from the request's arrival) still
// gets its answer, with the lock token: otherwise the lease would be
// granted to nobody and hold the name for its TTL. Over HTTP/2 too, where
// the deadline passing resets the stream while the handler waits.
func TestAcquire_WaitOutlastsWriteTimeout(t *testing.T) {
	t.Parallel()
	for _, h2c := range []bool{false, true} {
		t.Run(map[bool]string{false: "HTTP1", true: "H2C"}[h2c], func(t *testing.T) {
			t.Parallel()
			testWaitOutlastsWriteTimeout(t, h2c)
		})
	}
}

func testWaitOutlastsWriteTimeout(t *testing.T, h2c bool) {
	const writeTimeout = 300 * time.Millisecond
	obs := waitObserver{waiting: make(chan struct{}, 1)}
	e := newEnv(t, envOptions{writeTimeout: writeTimeout, h2c: h2c, service: service.Options{Observer: obs}})
	holder := e.mustAcquire("w", map[string]any{"ttl_ms": 60000})
	client := http.DefaultClient
	if h2c {
		var p http.Protocols
		p.SetUnencryptedHTTP2(true)
		client = &http.Client{Transport: &http.Transport{Protocols: &p}}
	}

	type result struct {
		status int
		body   []byte
		err    error
	}
	done := make(chan result, 1)
	sent := time.Now()
	go func() {
		resp, err := client.Post(e.srv.URL+"/v1/locks/w", "application/json", strings.NewReader(`{"ttl_ms":10000,"wait_ms":30000}`))
		if err != nil {
			done <- result{err: err}
			return
		}
		defer resp.Body.Close()
		if want := map[bool]int{false: 1, true: 2}[h2c]; resp.ProtoMajor != want {
			done <- result{err: fmt.Errorf("answered over %s; want HTTP/%d", resp.Proto, want)}
			return
		}
		b, err := io.ReadAll(resp.Body)
		done <- result{resp.StatusCode, b, err}
	}()
	<-obs.waiting // the waiter's request was read, and it waits for the holder
	testutil.WaitFor(t, 10*time.Second, "the server's WriteTimeout to pass", func() (bool, error) {
		return time.Since(sent) > 2*writeTimeout, nil
	})
	if r := e.release("w", holder.LockToken); r.status != http.StatusNoContent {
		t.Fatalf("holder's release = %d %s", r.status, r.body)
	}
	r := <-done
	if r.err != nil || r.status != http.StatusCreated {
		t.Fatalf("waiter granted after the WriteTimeout = %d %s, %v; want 201 with the lock", r.status, r.body, r.err)
	}
	var g api.LockResponse
	if err := json.Unmarshal(r.body, &g); err != nil || g.LockToken == "" {
		t.Fatalf("waiter's answer %s: %v", r.body, err)
	}
	if r := e.release("w", g.LockToken); r.status != http.StatusNoContent {
		t.Errorf("waiter's release = %d %s", r.status, r.body)
	}
}

// grantOnLeave is a Locker whose Acquire grants just as its caller's
// context ends (the client left during the grant), and which records
// releases.
type grantOnLeave struct {
	api.Locker
	mu       sync.Mutex
	released []string
}

func (l *grantOnLeave) Acquire(ctx context.Context, key string, req service.Request) (*service.Grant, error) {
	<-ctx.Done()
	now := time.Now()
	return &service.Grant{Key: key, Token: "abandoned-token", Fencing: 7, TTL: req.TTL, Start: now, Expires: now.Add(req.TTL)}, nil
}

func (l *grantOnLeave) Release(ctx context.Context, key, token string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.released = append(l.released, key+" "+token)
	return ctx.Err()
}

// TestAcquire_ClientLeftAtGrant: a grant made as its client leaves is
// released at once (nobody will learn its lock token), not left to hold
// the name for its TTL.
func TestAcquire_ClientLeftAtGrant(t *testing.T) {
	t.Parallel()
	l := &grantOnLeave{}
	h := api.NewHandler(l, nil, api.Options{Logger: slog.New(slog.DiscardHandler)})
	ctx, leave := context.WithCancel(t.Context())
	req := httptest.NewRequestWithContext(ctx, http.MethodPost, "/v1/locks/gone", strings.NewReader(`{"ttl_ms":10000}`))
	req.Header.Set("Content-Type", "application/json")
	rec := httptest.NewRecorder()
	served := make(chan struct{})
	go func() {
		defer close(served)
		h.ServeHTTP(rec, req)
	}()
	leave()
	<-served
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.released) != 1 || !strings.HasSuffix(l.released[0], " abandoned-token") {
		t.Errorf("releases after the client left at the grant: %q; want the grant's", l.released)
	}
	if rec.Code == http.StatusCreated {
		t.Errorf("answer to a client that left: 201 %s", rec.Body)
	}
}
