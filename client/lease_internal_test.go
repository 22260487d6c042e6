package client

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

// hangingLease is a lease (NoRenew) from a server whose every request
// waits until release is closed, or the request's end.
func hangingLease(t *testing.T, validity time.Duration) (l *Lease, arrived <-chan string, release chan<- struct{}) {
	t.Helper()
	in, out := make(chan string, 8), make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in <- r.Method + " " + r.URL.Path
		select {
		case <-out:
			w.WriteHeader(http.StatusNoContent)
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(out) })
	c, err := New(srv.URL, Options{})
	if err != nil {
		t.Fatal(err)
	}
	o, err := (&LockOptions{NoRenew: true}).withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	l, err = c.newLease("n", &grant{fencing: 1, lock: "tok", ttl: validity, validity: validity, sent: time.Now()}, o)
	if err != nil {
		t.Fatal(err)
	}
	return l, in, out
}

// TestLease_ReleaseEndsFirst: Release ends the lease before its delete is
// sent. Once the delete lands another client may be granted the name, so a
// lease still open while the answer is on its way would be held twice.
func TestLease_ReleaseEndsFirst(t *testing.T) {
	l, arrived, release := hangingLease(t, time.Minute)
	done := make(chan error, 1)
	go func() { done <- l.Release(t.Context()) }()
	if got := <-arrived; got != "DELETE /v1/locks/n" {
		t.Fatalf("request %q; want the release", got)
	}
	// The delete has reached the server, which has not answered.
	if err := l.Err(); !errors.Is(err, ErrReleased) {
		t.Errorf("Err while the release is on its way = %v; want ErrReleased", err)
	}
	select {
	case <-l.Done():
	default:
		t.Error("Done still open while the release is on its way")
	}
	release <- struct{}{}
	if err := <-done; err != nil {
		t.Errorf("Release = %v", err)
	}
}

// TestLease_ExtendCutShortByTheEnd: an Extend still unanswered when the
// lease ends is bounded by that end and says the lease is gone (ErrLost),
// as the lease itself does, not a bare context error.
func TestLease_ExtendCutShortByTheEnd(t *testing.T) {
	l, arrived, _ := hangingLease(t, 300*time.Millisecond)
	err := l.Extend(t.Context(), time.Second)
	if got := <-arrived; got != "POST /v1/locks/n/extend" {
		t.Fatalf("request %q; want the extend", got)
	}
	if !errors.Is(err, ErrLost) || errors.Is(err, ErrUnavailable) {
		t.Errorf("Extend cut short by the lease's end = %v; want ErrLost", err)
	}
	if !errors.Is(l.Err(), ErrLost) {
		t.Errorf("Err after = %v; want ErrLost", l.Err())
	}
}

// TestLease_NoRenewalAfterSuspend: a renewal that comes due after the
// lease ran out by the wall clock (the machine slept through both) is not
// sent: the lease ends, as the TypeScript SDK's does. (The renewal is due
// 600 ms after the grant, before the watchdog's first look at the deadline,
// a second after it.)
func TestLease_NoRenewalAfterSuspend(t *testing.T) {
	in := make(chan string, 8)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in <- r.Method + " " + r.URL.Path
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	t.Cleanup(srv.Close)
	c, err := New(srv.URL, Options{})
	if err != nil {
		t.Fatal(err)
	}
	slept := sleepAfter(c)
	o, err := (&LockOptions{RenewFraction: 0.01}).withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	l, err := c.newLease("n", &grant{fencing: 1, lock: "tok", ttl: time.Minute, validity: time.Minute, sent: time.Now()}, o)
	if err != nil {
		t.Fatal(err)
	}
	slept.Store(true) // an hour asleep, long before the renewal is due
	<-l.Done()
	l.stop()
	<-l.watchdogRet
	if !errors.Is(l.ended(), ErrLost) {
		t.Errorf("lease ended with %v; want ErrLost", l.ended())
	}
	select {
	case got := <-in:
		t.Errorf("request %q sent for a lease the wall clock says ran out; want none", got)
	default:
	}
}

// TestLease_ExtendUnderLeaseContext: an Extend made with the lease's own
// context (as Do's fn gets, derived from it) that the lease's end cuts short
// answers ErrLost, whichever of the lease's timers ends it.
func TestLease_ExtendUnderLeaseContext(t *testing.T) {
	l, arrived, _ := hangingLease(t, time.Minute)
	fctx, cancel := context.WithCancelCause(t.Context())
	defer cancel(nil)
	stop := context.AfterFunc(l.Context(), func() { cancel(context.Cause(l.Context())) })
	defer stop()
	res := make(chan error, 1)
	go func() { res <- l.Extend(fctx, time.Second) }()
	<-arrived
	// The watchdog ends the lease (its expiry check ran first, or a renewal
	// was answered 409) while the Extend is on its way.
	l.lose(fmt.Errorf("%w: the deadline passed without a renewal", ErrLost))
	err := <-res
	if !errors.Is(err, ErrLost) {
		t.Errorf("Extend cut short by the lease's end (lease context) = %v; want ErrLost", err)
	}
}
