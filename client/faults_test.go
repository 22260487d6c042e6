package client_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redfence/redfence/client"
	"github.com/redfence/redfence/client/clienttest"
)

// proxy forwards TCP connections to target. freeze makes every connection
// open at that moment silently drop all bytes both ways (half-open: a
// backend that died behind a load balancer, a NAT entry dropped), while new
// connections work; refuse closes the next n connections at once.
type proxy struct {
	ln     net.Listener
	mu     sync.Mutex
	frozen []*atomic.Bool
	refuse atomic.Int64
	conns  atomic.Int64 // connections accepted
}

func newProxy(t *testing.T, target string) *proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{ln: ln}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			p.conns.Add(1)
			if p.refuse.Add(-1) >= 0 {
				in.Close()
				continue
			}
			out, err := net.Dial("tcp", target)
			if err != nil {
				in.Close()
				continue
			}
			f := new(atomic.Bool)
			p.mu.Lock()
			p.frozen = append(p.frozen, f)
			p.mu.Unlock()
			pipe := func(dst, src net.Conn) {
				buf := make([]byte, 32<<10)
				for {
					n, err := src.Read(buf)
					if n > 0 && !f.Load() {
						if _, werr := dst.Write(buf[:n]); werr != nil {
							return
						}
					}
					if err != nil {
						dst.Close()
						return
					}
				}
			}
			go pipe(out, in)
			go pipe(in, out)
		}
	}()
	return p
}

func (p *proxy) url() string { return "http://" + p.ln.Addr().String() }

func (p *proxy) freeze() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, f := range p.frozen {
		f.Store(true)
	}
}

// TestLease_RenewalOnDeadConnection: a renewal stuck on a kept-alive
// connection that went dead is abandoned in time and retried on a new one,
// so the lease lives on while the server is reachable.
func TestLease_RenewalOnDeadConnection(t *testing.T) {
	t.Parallel()
	s := clienttest.Start(t, clienttest.Options{})
	p := newProxy(t, strings.TrimPrefix(s.URL, "http://"))
	c := newClient(t, p.url())
	renewed := make(chan struct{}, 16)
	l, err := c.Acquire(t.Context(), "dead-conn", &client.LockOptions{TTL: 3 * time.Second, OnRenew: func(time.Time) { renewed <- struct{}{} }})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(context.Background())
	p.freeze() // the connection the acquire used, which the watchdog reuses
	for range 2 {
		select {
		case <-renewed:
		case <-l.Done():
			t.Fatalf("lease ended after its connection went dead (%v), although the server answers on a new one", l.Err())
		}
	}
}

// TestClient_NoRedirect: an answer that redirects is not followed: the lock
// token (a secret) is sent nowhere else, and the redirect is an error.
func TestClient_NoRedirect(t *testing.T) {
	t.Parallel()
	var leaked atomic.Value
	leaked.Store("")
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		leaked.Store(r.Header.Get("Lock-Token") + "|" + r.Header.Get("Authorization"))
		w.WriteHeader(http.StatusNoContent)
	}))
	defer other.Close()
	mux := clienttest.GrantingMux("SECRET-LOCK-TOKEN-abcdefghij", 10*time.Second)
	mux.HandleFunc("DELETE /v1/locks/{name}", func(w http.ResponseWriter, r *http.Request) {
		// Another port of the same host: Go keeps Authorization there too.
		http.Redirect(w, r, other.URL+r.URL.Path, http.StatusTemporaryRedirect)
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()
	c, err := client.New(srv.URL, client.Options{APIKey: "rf_0123456789abcdef_secret", HTTPClient: &http.Client{}})
	if err != nil {
		t.Fatal(err)
	}
	l, err := c.Acquire(t.Context(), "r", &client.LockOptions{NoRenew: true})
	if err != nil {
		t.Fatal(err)
	}
	err = l.Release(t.Context())
	if got := leaked.Load().(string); got != "" {
		t.Errorf("Release followed a redirect and sent %q elsewhere", got)
	}
	if err == nil {
		t.Error("Release = nil after a redirect; want an error (the lock was not deleted)")
	}
}

// TestAcquire_WaitThroughOutage: an acquire with a wait keeps trying through
// a server that cannot be reached for a while (a rolling restart).
func TestAcquire_WaitThroughOutage(t *testing.T) {
	t.Parallel()
	s := clienttest.Start(t, clienttest.Options{})
	p := newProxy(t, strings.TrimPrefix(s.URL, "http://"))
	p.refuse.Store(3) // the first three connections are closed at once
	c := newClient(t, p.url())
	l, err := c.Acquire(t.Context(), "outage", &client.LockOptions{Wait: time.Minute})
	if err != nil {
		t.Fatalf("Acquire with a wait through 3 refused connections = %v", err)
	}
	if n := p.conns.Load(); n < 4 {
		t.Errorf("%d connections; want at least 4 (3 refused, then the grant)", n)
	}
	if err := l.Release(t.Context()); err != nil {
		t.Fatal(err)
	}
	// Without a wait, the first failure is the answer.
	p.refuse.Store(1)
	c2, err := client.New(p.url(), client.Options{HTTPClient: &http.Client{Transport: &http.Transport{}}}) // no pooled connection
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c2.Acquire(t.Context(), "outage-once", nil); !errors.Is(err, client.ErrUnavailable) {
		t.Errorf("Acquire without a wait, connection closed = %v; want ErrUnavailable", err)
	}
}

// TestClient_RequestTimeout: a server that accepts and never answers fails
// a request with ErrUnavailable after RequestTimeout (an acquire after its
// wait plus the lesser of RequestTimeout and its TTL), instead of hanging.
func TestClient_RequestTimeout(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var mu sync.Mutex
	var held []net.Conn
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c) // never answered
			mu.Unlock()
		}
	}()
	defer func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range held {
			c.Close()
		}
	}()
	c, err := client.New("http://"+ln.Addr().String(), client.Options{RequestTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Acquire(t.Context(), "hung", &client.LockOptions{TTL: 200 * time.Millisecond}); !errors.Is(err, client.ErrUnavailable) {
		t.Errorf("Acquire against a hung server = %v; want ErrUnavailable", err)
	}
	if _, err := c.GetResource(t.Context(), "hung"); !errors.Is(err, client.ErrUnavailable) {
		t.Errorf("GetResource against a hung server = %v; want ErrUnavailable", err)
	}
	// An acquire waits no longer than its wait plus its TTL, however long
	// the request timeout: a later answer would grant nothing that lasts.
	long, err := client.New("http://"+ln.Addr().String(), client.Options{RequestTimeout: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	guard, stop := context.WithTimeout(t.Context(), time.Minute)
	defer stop()
	if _, err := long.Acquire(guard, "hung", &client.LockOptions{TTL: 300 * time.Millisecond, Wait: 200 * time.Millisecond}); !errors.Is(err, client.ErrUnavailable) || guard.Err() != nil {
		t.Errorf("Acquire (wait 200ms, TTL 300ms) against a hung server = %v; want ErrUnavailable after its wait and TTL", err)
	}
	// The caller's own cancellation is reported as such.
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := c.GetResource(ctx, "hung"); !errors.Is(err, context.Canceled) || errors.Is(err, client.ErrUnavailable) {
		t.Errorf("GetResource with a cancelled context = %v; want context.Canceled", err)
	}
}

// TestRelease_Retry: a release the server could not answer (503) can be
// sent again, and Do does so; one that settled is not sent again.
func TestRelease_Retry(t *testing.T) {
	t.Parallel()
	var releases atomic.Int64
	var fail atomic.Int64
	mux := clienttest.GrantingMux("AAAAAAAAAAAAAAAAAAAAAAAAAAA", 10*time.Second)
	mux.HandleFunc("DELETE /v1/locks/{name}", func(w http.ResponseWriter, r *http.Request) {
		releases.Add(1)
		if fail.Add(-1) >= 0 {
			w.Header().Set("Content-Type", "application/problem+json")
			w.Header().Set("Retry-After", "0")
			w.WriteHeader(http.StatusServiceUnavailable)
			io.WriteString(w, `{"type":"urn:redfence:problem:quorum-unavailable","title":"t","status":503}`)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()
	c := newClient(t, srv.URL)

	fail.Store(1)
	l, err := c.Acquire(t.Context(), "r", &client.LockOptions{NoRenew: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(t.Context()); !errors.Is(err, client.ErrUnavailable) {
		t.Fatalf("first Release = %v; want ErrUnavailable", err)
	}
	if l.Err() == nil {
		t.Error("the lease lasts after Release; want it ended")
	}
	if err := l.Release(t.Context()); err != nil {
		t.Fatalf("second Release = %v; want nil", err)
	}
	if err := l.Release(t.Context()); err != nil || releases.Load() != 2 {
		t.Errorf("third Release = %v after %d requests; want nil without a third request", err, releases.Load())
	}

	releases.Store(0)
	fail.Store(2)
	if err := c.Do(t.Context(), "r", &client.LockOptions{NoRenew: true}, func(context.Context, *client.Lease) error { return nil }); err != nil {
		t.Errorf("Do with two failed releases = %v; want nil (sent again)", err)
	}
	if n := releases.Load(); n != 3 {
		t.Errorf("Do sent %d releases; want 3", n)
	}
}

// TestLease_LostSaysWhy: a lease that runs out because every renewal
// failed says, in its error, how the last one failed.
func TestLease_LostSaysWhy(t *testing.T) {
	t.Parallel()
	// A lease of 10 s: its renewals begin seconds before its deadline, so
	// one is tried even on a crowded machine (with 1 s and 3 s, a timer
	// late by most of a second left none tried, 1 run in 10).
	mux := clienttest.GrantingMux("AAAAAAAAAAAAAAAAAAAAAAAAAAA", 10*time.Second)
	mux.HandleFunc("POST /v1/locks/{name}/extend", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusServiceUnavailable)
		io.WriteString(w, `{"type":"urn:redfence:problem:quorum-unavailable","title":"No quorum","status":503,"detail":"2 of 5 nodes answered yes"}`)
	})
	mux.HandleFunc("DELETE /v1/locks/{name}", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) })
	s := httptest.NewServer(mux)
	t.Cleanup(s.Close)
	l, err := newClient(t, s.URL).Acquire(t.Context(), "r", nil)
	if err != nil {
		t.Fatal(err)
	}
	<-l.Done()
	if err := l.Err(); !errors.Is(err, client.ErrLost) || errors.Is(err, client.ErrUnavailable) || !strings.Contains(err.Error(), "2 of 5 nodes answered yes") {
		t.Errorf("Err() = %v; want ErrLost only, naming the last renewal's failure", err)
	}
}

// TestNew_BadURL: a server URL that cannot be one is refused at once, as
// invalid, not retried as an outage.
func TestNew_BadURL(t *testing.T) {
	t.Parallel()
	for _, u := range []string{"127.0.0.1:8080", "ftp://127.0.0.1:8080", "http://", "", "http://[::1"} {
		if _, err := client.New(u, client.Options{}); !errors.Is(err, client.ErrInvalid) {
			t.Errorf("New(%q) = %v; want ErrInvalid", u, err)
		}
	}
	for _, u := range []string{"http://127.0.0.1:8080", "https://locks.example.com/prefix/"} {
		if _, err := client.New(u, client.Options{}); err != nil {
			t.Errorf("New(%q) = %v", u, err)
		}
	}
	// Errors are logged: a password in the URL is not quoted.
	const pw = "s3cr3tProxyPW"
	for _, u := range []string{"ftp://user:" + pw + "@127.0.0.1:8080", "htp://user:" + pw + "@h", "http://user:" + pw + "%zz@h"} {
		_, err := client.New(u, client.Options{})
		if !errors.Is(err, client.ErrInvalid) || strings.Contains(err.Error(), pw) {
			t.Errorf("New(%q) = %v; want ErrInvalid without the password", u, err)
		}
	}
}

// TestNew_BadAPIKey: an API key no header can carry (a line break read from
// a file or a secret with it) is refused at once, as invalid, without
// echoing it: every request would otherwise fail before it is sent, as an
// outage (ErrUnavailable) that an acquire with a Wait kept retrying until
// its wait ran out.
func TestNew_BadAPIKey(t *testing.T) {
	t.Parallel()
	const key = "rf_0123456789abcdef_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
	for _, k := range []string{key + "\n", key + "\r\n", "\n" + key, key + "\r\nX-Injected: 1", key + "\x00", key + "\x7f"} {
		_, err := client.New("http://127.0.0.1:8080", client.Options{APIKey: k})
		if !errors.Is(err, client.ErrInvalid) || errors.Is(err, client.ErrUnavailable) {
			t.Errorf("New(APIKey %q) = %v; want ErrInvalid", k, err)
		}
		if err != nil && strings.Contains(err.Error(), key[len(key)-8:]) {
			t.Errorf("New(APIKey %q) = %v; the error shows the key", k, err)
		}
	}
	for _, k := range []string{"", key} {
		if _, err := client.New("http://127.0.0.1:8080", client.Options{APIKey: k}); err != nil {
			t.Errorf("New(APIKey %q) = %v", k, err)
		}
	}
}

// TestAcquire_MaxHoldBelowTTL: a MaxHold shorter than the lease is
// refused: before asking when the TTL is given (no token burned), on the
// grant, which is released, when it is the server's default.
func TestAcquire_MaxHoldBelowTTL(t *testing.T) {
	t.Parallel()
	s := clienttest.Start(t, clienttest.Options{})
	c := newClient(t, s.URL)
	if _, err := c.Acquire(t.Context(), "mh", &client.LockOptions{TTL: 5 * time.Second, MaxHold: 3 * time.Second}); !errors.Is(err, client.ErrInvalid) || !strings.Contains(err.Error(), "MaxHold") {
		t.Errorf("Acquire with MaxHold < TTL = %v; want an error about MaxHold", err)
	}
	if _, err := c.Acquire(t.Context(), "mh", &client.LockOptions{MaxHold: time.Second}); !errors.Is(err, client.ErrInvalid) || !strings.Contains(err.Error(), "MaxHold") {
		t.Errorf("Acquire with MaxHold below the server's default TTL = %v; want an error about MaxHold", err)
	}
	l, err := c.Acquire(t.Context(), "mh", &client.LockOptions{TTL: 5 * time.Second, MaxHold: 5 * time.Second})
	if err != nil {
		t.Fatalf("Acquire after the refusals = %v; want the lock free (released)", err)
	}
	if tok := l.FencingToken(); tok != 2 {
		t.Errorf("fencing token %d; want 2 (only the default-TTL grant was issued)", tok)
	}
	if err := l.Release(t.Context()); err != nil {
		t.Errorf("Release = %v", err)
	}
}

// TestClient_DotNames: "." and ".." cannot be sent (URL paths normalise
// them away, to another route): they are refused as invalid, unsent.
func TestClient_DotNames(t *testing.T) {
	t.Parallel()
	var requests atomic.Int64
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		w.WriteHeader(http.StatusNotFound)
	}))
	t.Cleanup(s.Close)
	c := newClient(t, s.URL)
	for _, name := range []string{".", ".."} {
		if _, err := c.Acquire(t.Context(), name, nil); !errors.Is(err, client.ErrInvalid) {
			t.Errorf("Acquire(%q) = %v; want ErrInvalid", name, err)
		}
		if _, err := c.GetResource(t.Context(), name); !errors.Is(err, client.ErrInvalid) {
			t.Errorf("GetResource(%q) = %v; want ErrInvalid", name, err)
		}
		if _, err := c.PutResource(t.Context(), name, 1, 1); !errors.Is(err, client.ErrInvalid) {
			t.Errorf("PutResource(%q) = %v; want ErrInvalid", name, err)
		}
	}
	if n := requests.Load(); n != 0 {
		t.Errorf("%d requests reached the server; want none", n)
	}
}

// TestRelease_AnswerLost: a release that took effect but whose answer was
// lost (the connection dropped) is sent again and finds nothing held
// (not-holder): within the lease's deadline that is the release done, not
// a loss, so Do returns fn's success.
func TestRelease_AnswerLost(t *testing.T) {
	t.Parallel()
	var releases atomic.Int64
	mux := clienttest.GrantingMux("AAAAAAAAAAAAAAAAAAAAAAAAAAA", 10*time.Second)
	mux.HandleFunc("DELETE /v1/locks/{name}", func(w http.ResponseWriter, r *http.Request) {
		if releases.Add(1) == 1 {
			conn, _, err := http.NewResponseController(w).Hijack()
			if err == nil {
				conn.Close() // deleted, but the answer never leaves
			}
			return
		}
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusConflict)
		io.WriteString(w, `{"type":"urn:redfence:problem:not-holder","title":"t","status":409}`)
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()
	c := newClient(t, srv.URL)
	if err := c.Do(t.Context(), "r", &client.LockOptions{NoRenew: true}, func(context.Context, *client.Lease) error { return nil }); err != nil {
		t.Errorf("Do whose release answer was lost = %v; want nil", err)
	}
	if n := releases.Load(); n != 2 {
		t.Errorf("Do sent %d releases; want 2", n)
	}
}

// scriptedServer answers each request with handle (a fake Redfence, for
// answers a real one gives only under faults); it counts them by method.
func scriptedServer(t *testing.T, handle func(w http.ResponseWriter, r *http.Request), opts ...client.Options) (*client.Client, map[string]*atomic.Int32) {
	t.Helper()
	counts := map[string]*atomic.Int32{http.MethodPost: {}, http.MethodDelete: {}}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n, ok := counts[r.Method]; ok {
			n.Add(1)
		}
		handle(w, r)
	}))
	t.Cleanup(srv.Close)
	c, err := client.New(srv.URL, append(opts, client.Options{})[0])
	if err != nil {
		t.Fatal(err)
	}
	return c, counts
}

const grantBody = `{"name":"n","lock_token":"jzocnifUtgU-kaoMf0LY4Vtgw_c","fencing_token":7,"ttl_ms":1000,"validity_ms":%d,"expires_at":"2030-01-01T00:00:00Z","owner":""}`

func writeGrant(w http.ResponseWriter, validityMS int) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, grantBody, validityMS)
}

// TestAcquire_LateGrant: a grant whose validity ran out before its answer
// arrived is not handed out: Acquire and Do return ErrLost (fn never runs)
// and release it.
func TestAcquire_LateGrant(t *testing.T) {
	t.Parallel()
	c, counts := scriptedServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodDelete {
			w.WriteHeader(http.StatusNoContent)
			return
		}
		time.Sleep(50 * time.Millisecond) // the fault: an answer 50 ms late, for a 10 ms validity
		writeGrant(w, 10)
	})
	if l, err := c.Acquire(t.Context(), "n", nil); !errors.Is(err, client.ErrLost) {
		t.Errorf("Acquire of a grant that ran out on its way = %v, %v; want ErrLost", l, err)
	}
	ran := false
	if err := c.Do(t.Context(), "n", nil, func(context.Context, *client.Lease) error { ran = true; return nil }); !errors.Is(err, client.ErrLost) || ran {
		t.Errorf("Do of a grant that ran out on its way = %v (fn ran: %v); want ErrLost, fn not run", err, ran)
	}
	if n := counts[http.MethodDelete].Load(); n != 2 {
		t.Errorf("%d releases; want the 2 late grants released", n)
	}
}

// TestLease_ExtendBoundedByDeadline: Lease.Extend gives up at the lease's
// end, whatever its context: an answer after it renews nothing that lasts.
func TestLease_ExtendBoundedByDeadline(t *testing.T) {
	t.Parallel()
	stop := make(chan struct{})
	c, _ := scriptedServer(t, func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/extend"):
			select { // the fault: a server that does not answer
			case <-r.Context().Done():
			case <-stop:
			}
		case r.Method == http.MethodPost:
			writeGrant(w, 300)
		default:
			w.WriteHeader(http.StatusNoContent)
		}
	}, client.Options{RequestTimeout: time.Hour}) // only the lease bounds it
	t.Cleanup(func() { close(stop) }) // before the server closes
	l, err := c.Acquire(t.Context(), "n", &client.LockOptions{NoRenew: true})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- l.Extend(context.Background(), 0) }()
	select {
	case err := <-done:
		if err == nil {
			t.Error("Extend with no answer succeeded")
		}
	case <-time.After(time.Minute): // far past the 300 ms lease: only a hang gets here
		t.Fatal("Extend outlived its lease's deadline (waiting on its context only)")
	}
	if !errors.Is(l.Err(), client.ErrLost) {
		t.Errorf("lease after its deadline: Err = %v; want ErrLost", l.Err())
	}
}

// TestAcquire_RetryAfterBeyondWait: a 503 whose Retry-After ends after the
// acquire's wait (quarantines ending later) is returned at once, not slept
// through to one more try that cannot succeed.
func TestAcquire_RetryAfterBeyondWait(t *testing.T) {
	t.Parallel()
	c, counts := scriptedServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.Header().Set("Retry-After", "30")
		w.WriteHeader(http.StatusServiceUnavailable)
		io.WriteString(w, `{"type":"urn:redfence:problem:quorum-unavailable","title":"t","status":503,"retry_after_ms":30000}`)
	})
	_, err := c.Acquire(t.Context(), "n", &client.LockOptions{Wait: 5 * time.Second})
	if !errors.Is(err, client.ErrUnavailable) {
		t.Fatalf("Acquire = %v; want ErrUnavailable", err)
	}
	if n := counts[http.MethodPost].Load(); n != 1 {
		t.Errorf("%d acquires sent; want 1", n)
	}
}

// TestClient_TimeoutKeepsOtherIdleConns: with Options.HTTPClient set to a
// client without a Transport (&http.Client{Timeout: ...}, the usual way), a
// request that times out closes the idle connections of the client's own
// transport, not http.DefaultTransport's: every idle keep-alive connection
// of the process, unrelated to Redfence.
func TestClient_TimeoutKeepsOtherIdleConns(t *testing.T) {
	var conns atomic.Int32
	other := httptest.NewUnstartedServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	other.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	other.Start()
	defer other.Close()
	get := func() {
		t.Helper()
		resp, err := http.Get(other.URL) // http.DefaultTransport
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	get()
	get()
	if n := conns.Load(); n != 1 {
		t.Fatalf("%d connections before; want 1 reused", n)
	}
	hang := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() }))
	defer hang.Close()
	c, err := client.New(hang.URL, client.Options{HTTPClient: &http.Client{}, RequestTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.GetResource(t.Context(), "x"); err == nil {
		t.Fatal("GetResource from a server that never answers = nil; want a timeout")
	}
	get()
	if n := conns.Load(); n != 1 {
		t.Errorf("a Redfence request timeout closed an idle connection of http.DefaultTransport (%d connections); want it kept", n)
	}
}

// TestClient_CloseIdleConnections: CloseIdleConnections reaches the
// transport of the client's HTTP client (the one given in Options too), and
// the client goes on working.
func TestClient_CloseIdleConnections(t *testing.T) {
	t.Parallel()
	s := clienttest.Start(t, clienttest.Options{})
	tr := &closeCounter{RoundTripper: http.DefaultTransport.(*http.Transport).Clone()}
	c, err := client.New(s.URL, client.Options{HTTPClient: &http.Client{Transport: tr}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if _, err := c.GetResource(ctx, "idle"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("GetResource = %v; want ErrNotFound", err)
	}
	c.CloseIdleConnections()
	if n := tr.closes.Load(); n != 1 {
		t.Errorf("transport told to close its idle connections %d times; want 1", n)
	}
	if _, err := c.GetResource(ctx, "idle"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("GetResource after CloseIdleConnections = %v; want ErrNotFound", err)
	}
}

// closeCounter is a transport that counts its CloseIdleConnections calls.
type closeCounter struct {
	http.RoundTripper
	closes atomic.Int64
}

func (c *closeCounter) CloseIdleConnections() {
	c.closes.Add(1)
	c.RoundTripper.(interface{ CloseIdleConnections() }).CloseIdleConnections()
}
