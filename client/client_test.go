package client_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redfence/redfence/client"
	"github.com/redfence/redfence/client/clienttest"
)

// waitTimeout bounds every wait for an observable condition.
const waitTimeout = 60 * time.Second

func newClient(t *testing.T, url string) *client.Client {
	t.Helper()
	c, err := client.New(url, client.Options{Owner: t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// released checks that name is free: an acquire that tries once succeeds.
func released(t *testing.T, c *client.Client, name string) {
	t.Helper()
	l, err := c.Acquire(t.Context(), name, &client.LockOptions{TTL: 5 * time.Second})
	if err != nil {
		t.Fatalf("Acquire(%q) after release = %v; want the lock to be free", name, err)
	}
	if err := l.Release(t.Context()); err != nil {
		t.Fatalf("Release = %v", err)
	}
}

// waitDone waits for the lease to end and returns when that was observed.
func waitDone(t *testing.T, l *client.Lease) time.Time {
	t.Helper()
	select {
	case <-l.Done():
		return time.Now()
	case <-time.After(waitTimeout):
		t.Fatalf("lease %q still not done after %v", l.Name(), waitTimeout)
		return time.Time{}
	}
}

func TestLease_RenewalKeepsItAlive(t *testing.T) {
	t.Parallel()
	s := clienttest.Start(t, clienttest.Options{})
	c := newClient(t, s.URL)
	const ttl = 2 * time.Second
	renewed := make(chan time.Time, 100)
	l, err := c.Acquire(t.Context(), "renewed", &client.LockOptions{TTL: ttl, OnRenew: func(d time.Time) { renewed <- d }})
	if err != nil {
		t.Fatal(err)
	}
	first := l.Deadline()
	if d := time.Until(first); d <= 0 || d > ttl {
		t.Fatalf("first deadline in %v; want within the TTL %v", d, ttl)
	}
	// Wait until the watchdog has pushed the deadline three TTLs past the
	// first one: the lease has then lived through several TTLs.
	for last := first; last.Before(first.Add(3 * ttl)); {
		select {
		case last = <-renewed:
		case <-l.Done():
			t.Fatalf("lease ended after renewals up to %v: %v", last, l.Err())
		case <-time.After(waitTimeout):
			t.Fatal("no renewal")
		}
	}
	if err := l.Err(); err != nil {
		t.Fatalf("Err() = %v; want nil while renewed", err)
	}
	// The server agrees: another client is refused, with the same token held.
	_, err = newClient(t, s.URL).Acquire(t.Context(), "renewed", nil)
	if !errors.Is(err, client.ErrHeld) {
		t.Fatalf("second Acquire = %v; want ErrHeld", err)
	}
	var ce *client.Error
	if !errors.As(err, &ce) || ce.Slug() != "lock-held" || ce.RetryAfter <= 0 || ce.RequestID == "" {
		t.Errorf("second Acquire error = %#v; want lock-held with retry_after and a request id", err)
	}
	if err := l.Release(t.Context()); err != nil {
		t.Fatalf("Release = %v", err)
	}
	if !errors.Is(l.Err(), client.ErrReleased) {
		t.Errorf("Err() after Release = %v; want ErrReleased", l.Err())
	}
	if err := l.Release(t.Context()); err != nil {
		t.Errorf("second Release = %v; want the first result (nil)", err)
	}
	released(t, c, "renewed")
}

func TestLease_ServerSideLossEndsItBeforeTheDeadline(t *testing.T) {
	t.Parallel()
	s := clienttest.Start(t, clienttest.Options{})
	c := newClient(t, s.URL)
	l, err := c.Acquire(t.Context(), "lost", &client.LockOptions{TTL: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Release(context.Background()) })
	deadline := l.Deadline() // renewals only move it later
	s.DeleteLock(t, "lost", 3)
	ended := waitDone(t, l)
	if !ended.Before(deadline) {
		t.Errorf("Done closed at %v, after the deadline %v; want before", ended, deadline)
	}
	if err := l.Err(); !errors.Is(err, client.ErrLost) {
		t.Errorf("Err() = %v; want ErrLost", err)
	}
	if cause := context.Cause(l.Context()); !errors.Is(cause, client.ErrLost) {
		t.Errorf("context.Cause(Context()) = %v; want ErrLost", cause)
	}
	if err := l.Extend(t.Context(), 0); !errors.Is(err, client.ErrLost) {
		t.Errorf("Extend after loss = %v; want ErrLost", err)
	}
}

func TestLease_Caps(t *testing.T) {
	t.Parallel()
	s := clienttest.Start(t, clienttest.Options{})
	c := newClient(t, s.URL)
	for _, tc := range []struct {
		name string
		opts client.LockOptions
		want int    // renewals before the lease runs out; -1: at least one
		why  string // in the error
	}{
		{"MaxRenewals", client.LockOptions{TTL: 2 * time.Second, MaxRenewals: 2}, 2, "MaxRenewals"},
		{"MaxHold", client.LockOptions{TTL: 2 * time.Second, MaxHold: 4 * time.Second}, -1, "MaxHold"},
		{"NoRenew", client.LockOptions{TTL: 500 * time.Millisecond, NoRenew: true}, 0, "renewal is off"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var mu sync.Mutex
			n := 0
			tc.opts.OnRenew = func(time.Time) { mu.Lock(); n++; mu.Unlock() }
			l, err := c.Acquire(t.Context(), "capped-"+tc.name, &tc.opts)
			if err != nil {
				t.Fatal(err)
			}
			ended := waitDone(t, l)
			if err := l.Err(); !errors.Is(err, client.ErrLost) || !strings.Contains(err.Error(), "deadline passed") || !strings.Contains(err.Error(), tc.why) {
				t.Errorf("Err() = %v; want ErrLost because the deadline passed (%s)", err, tc.why)
			}
			if d := l.Deadline(); ended.Before(d) {
				t.Errorf("Done closed at %v, before the deadline %v", ended, d)
			}
			mu.Lock()
			defer mu.Unlock()
			if n != tc.want && (tc.want >= 0 || n < 1) {
				t.Errorf("%d renewals; want %d (-1: at least one)", n, tc.want)
			}
		})
	}
}

func TestLease_Margin(t *testing.T) {
	t.Parallel()
	s := clienttest.Start(t, clienttest.Options{})
	c := newClient(t, s.URL)
	// A margin of seconds: the lease must end well before its deadline, with
	// time left for what follows to reach the server even on a loaded host.
	const margin = 2 * time.Second
	l, err := c.Acquire(t.Context(), "margin", &client.LockOptions{TTL: 5 * time.Second, NoRenew: true, Margin: margin})
	if err != nil {
		t.Fatal(err)
	}
	ended := waitDone(t, l)
	if d := l.Deadline(); !ended.Before(d) {
		t.Errorf("Done closed at %v; want before the deadline %v (Margin %v)", ended, d, margin)
	}
	// The server still holds it until the deadline: Release deletes it.
	if err := l.Release(t.Context()); err != nil {
		t.Errorf("Release after the margin = %v; want nil (the key was still there)", err)
	}
	// A margin that leaves no room to renew is refused before anything is
	// asked of the server: no lock taken, no token burned.
	if _, err := c.Acquire(t.Context(), "margin-bad", &client.LockOptions{TTL: time.Second, Margin: 900 * time.Millisecond}); err == nil ||
		!strings.Contains(err.Error(), "Margin") {
		t.Errorf("Acquire with a margin beyond the renewal point = %v; want an error about Margin", err)
	}
	// Nor one that leaves the renewal less than half a renewal interval.
	if _, err := c.Acquire(t.Context(), "margin-bad", &client.LockOptions{TTL: 6 * time.Second, Margin: 3*time.Second + time.Millisecond}); !errors.Is(err, client.ErrInvalid) ||
		!strings.Contains(err.Error(), "Margin") {
		t.Errorf("Acquire with a margin leaving the renewal under a second = %v; want an error about Margin", err)
	}
	l, err = c.Acquire(t.Context(), "margin-bad", &client.LockOptions{TTL: 5 * time.Second})
	if err != nil {
		t.Fatalf("Acquire after the refused margin = %v; want the lock free", err)
	}
	if tok := l.FencingToken(); tok != 1 {
		t.Errorf("first grant after the refused margin has token %d; want 1 (nothing was issued)", tok)
	}
	if err := l.Release(t.Context()); err != nil {
		t.Errorf("Release = %v", err)
	}
}

func TestDo(t *testing.T) {
	t.Parallel()
	s := clienttest.Start(t, clienttest.Options{})
	c := newClient(t, s.URL)

	t.Run("ReturnsFnErrorAndReleases", func(t *testing.T) {
		t.Parallel()
		boom := errors.New("boom")
		var token int64
		err := c.Do(t.Context(), "do-error", nil, func(ctx context.Context, l *client.Lease) error {
			token = int64(l.FencingToken())
			if _, err := c.PutResource(ctx, "do-error", l.FencingToken(), map[string]int{"n": 1}); err != nil {
				return err
			}
			return boom
		})
		if err != boom {
			t.Errorf("Do = %v; want fn's error %v unchanged", err, boom)
		}
		if token < 1 {
			t.Errorf("fn saw fencing token %d", token)
		}
		released(t, c, "do-error")
	})

	t.Run("ReleasesOnSuccess", func(t *testing.T) {
		t.Parallel()
		if err := c.Do(t.Context(), "do-ok", nil, func(context.Context, *client.Lease) error { return nil }); err != nil {
			t.Errorf("Do = %v; want nil", err)
		}
		released(t, c, "do-ok")
	})

	t.Run("ReleasesOnPanic", func(t *testing.T) {
		t.Parallel()
		func() {
			defer func() {
				if v := recover(); v != "oops" {
					t.Errorf("recovered %v; want the panic to pass through", v)
				}
			}()
			_ = c.Do(t.Context(), "do-panic", nil, func(context.Context, *client.Lease) error { panic("oops") })
		}()
		released(t, c, "do-panic")
	})

	t.Run("ReleasesWhenCallerCancels", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(t.Context())
		err := c.Do(ctx, "do-cancel", nil, func(ctx context.Context, _ *client.Lease) error {
			cancel()
			<-ctx.Done()
			return ctx.Err()
		})
		if !errors.Is(err, context.Canceled) {
			t.Errorf("Do = %v; want context.Canceled", err)
		}
		released(t, c, "do-cancel")
	})

	t.Run("ContextEndsOnLoss", func(t *testing.T) {
		t.Parallel()
		err := c.Do(t.Context(), "do-lost", &client.LockOptions{TTL: 3 * time.Second}, func(ctx context.Context, l *client.Lease) error {
			s.DeleteLock(t, "do-lost", 3)
			select {
			case <-ctx.Done():
			case <-time.After(waitTimeout):
				t.Error("fn's context not cancelled after the loss")
			}
			if cause := context.Cause(ctx); !errors.Is(cause, client.ErrLost) {
				t.Errorf("context.Cause = %v; want ErrLost", cause)
			}
			return nil
		})
		if !errors.Is(err, client.ErrLost) {
			t.Errorf("Do = %v; want ErrLost: fn returned nil after the lease was lost", err)
		}
		released(t, c, "do-lost")
	})

	t.Run("Held", func(t *testing.T) {
		t.Parallel()
		l, err := c.Acquire(t.Context(), "do-held", nil)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Release(t.Context())
		ran := false
		err = c.Do(t.Context(), "do-held", nil, func(context.Context, *client.Lease) error { ran = true; return nil })
		if !errors.Is(err, client.ErrHeld) || ran {
			t.Errorf("Do on a held lock = %v (fn ran: %v); want ErrHeld without running fn", err, ran)
		}
	})
}

func TestAcquire_Wait(t *testing.T) {
	t.Parallel()
	s := clienttest.Start(t, clienttest.Options{})
	c := newClient(t, s.URL)
	first, err := c.Acquire(t.Context(), "queue", &client.LockOptions{TTL: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		l   *client.Lease
		err error
	}
	got := make(chan result, 1)
	go func() {
		l, err := c.Acquire(t.Context(), "queue", &client.LockOptions{TTL: 10 * time.Second, Wait: waitTimeout})
		got <- result{l, err}
	}()
	if err := first.Release(t.Context()); err != nil {
		t.Fatal(err)
	}
	r := <-got
	if r.err != nil {
		t.Fatalf("waiting Acquire = %v; want the lock after the release", r.err)
	}
	defer r.l.Release(t.Context())
	if r.l.FencingToken() <= first.FencingToken() {
		t.Errorf("second fencing token %d; want above the first %d", r.l.FencingToken(), first.FencingToken())
	}

	// A short wait on a held lock ends with ErrHeld (wait-timeout).
	_, err = c.Acquire(t.Context(), "queue", &client.LockOptions{Wait: 200 * time.Millisecond})
	var ce *client.Error
	if !errors.Is(err, client.ErrHeld) || !errors.As(err, &ce) || ce.Slug() != "wait-timeout" {
		t.Errorf("Acquire with a short wait = %v; want ErrHeld (wait-timeout)", err)
	}
}

func TestPutResource(t *testing.T) {
	t.Parallel()
	s := clienttest.Start(t, clienttest.Options{})
	c := newClient(t, s.URL)
	var old *client.Lease
	err := c.Do(t.Context(), "orders:invoice-7", nil, func(ctx context.Context, l *client.Lease) error {
		old = l
		for i := range 2 { // one holder may write several times
			if _, err := c.PutResource(ctx, l.Name(), l.FencingToken(), map[string]int{"total": 40 + i}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	res, err := c.GetResource(t.Context(), "orders:invoice-7")
	if err != nil || string(res.Data) != `{"total":41}` || res.FencingToken != old.FencingToken() || res.Version != 2 {
		t.Fatalf("GetResource = %+v, %v; want total 41, version 2, token %d", res, err, old.FencingToken())
	}

	next, err := c.Acquire(t.Context(), "orders:invoice-7", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer next.Release(t.Context())
	_, err = c.PutResource(t.Context(), "orders:invoice-7", old.FencingToken(), map[string]int{"total": 0})
	var ce *client.Error
	if !errors.Is(err, client.ErrStale) || !errors.As(err, &ce) || ce.CurrentFencingToken != next.FencingToken() {
		t.Errorf("PutResource with the old token = %v; want ErrStale with current token %d", err, next.FencingToken())
	}
	if _, err := c.GetResource(t.Context(), "never-written"); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("GetResource(never-written) = %v; want ErrNotFound", err)
	}
	if _, err := c.Acquire(t.Context(), "bad name!", nil); !errors.Is(err, client.ErrInvalid) {
		t.Errorf("Acquire(bad name!) = %v; want ErrInvalid", err)
	}
}

// TestPutResourceIf: a conditional write is a compare-and-set on the
// document's version: version 0 creates only, another applies only at that
// version; otherwise ErrPrecondition with CurrentVersion, nothing written.
func TestPutResourceIf(t *testing.T) {
	t.Parallel()
	s := clienttest.Start(t, clienttest.Options{})
	c := newClient(t, s.URL)
	ctx := t.Context()
	l, err := c.Acquire(ctx, "cas", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx)
	wantPrecondition := func(step string, err error, version int64) {
		t.Helper()
		var ce *client.Error
		if !errors.Is(err, client.ErrPrecondition) || !errors.As(err, &ce) || ce.CurrentVersion != version {
			t.Errorf("%s = %v; want ErrPrecondition at version %d", step, err, version)
		}
	}
	wantPrecondition("If-Match with no document", errOf(c.PutResourceIf(ctx, "cas", l.FencingToken(), 0, 1)), 0)
	res, err := c.PutResourceIf(ctx, "cas", l.FencingToken(), 1, 0)
	if err != nil || res.Version != 1 {
		t.Fatalf("create-only write = %+v, %v; want version 1", res, err)
	}
	wantPrecondition("create-only over version 1", errOf(c.PutResourceIf(ctx, "cas", l.FencingToken(), 2, 0)), 1)
	if res, err = c.PutResourceIf(ctx, "cas", l.FencingToken(), 2, 1); err != nil || res.Version != 2 {
		t.Fatalf("write at version 1 = %+v, %v; want version 2", res, err)
	}
	wantPrecondition("write at version 1 over version 2", errOf(c.PutResourceIf(ctx, "cas", l.FencingToken(), 3, 1)), 2)
	if _, err := c.PutResourceIf(ctx, "cas", l.FencingToken(), 3, -1); !errors.Is(err, client.ErrInvalid) {
		t.Errorf("PutResourceIf with version -1 = %v; want ErrInvalid", err)
	}
	if res, err := c.GetResource(ctx, "cas"); err != nil || res.Version != 2 || string(res.Data) != "2" {
		t.Errorf("document = %+v, %v; want version 2, data 2", res, err)
	}
}

// errOf returns the error of a call that returns a value and an error.
func errOf[T any](_ T, err error) error { return err }

func TestClient_Unreachable(t *testing.T) {
	t.Parallel()
	c := newClient(t, "http://127.0.0.1:1") // nothing listens on port 1
	_, err := c.Acquire(t.Context(), "x", nil)
	var ce *client.Error
	if !errors.Is(err, client.ErrUnavailable) || !errors.As(err, &ce) || ce.Status != 0 {
		t.Errorf("Acquire on an unreachable server = %v; want ErrUnavailable with no status", err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := c.Acquire(ctx, "x", nil); !errors.Is(err, context.Canceled) || errors.Is(err, client.ErrUnavailable) {
		t.Errorf("Acquire with a cancelled context = %v; want context.Canceled only", err)
	}
}
