package service

import (
	"context"
	"sync/atomic"
	"testing"
	"time"
)

// waitObserver reports every start of a wait.
type waitObserver struct {
	nopObserver
	started chan struct{}
}

func (o *waitObserver) Waiting(delta int) {
	if delta > 0 {
		o.started <- struct{}{}
	}
}

// TestLocker_WaitersFIFO: waiters for one key are granted in arrival order,
// and a release wakes only the first of them (no thundering herd): with an
// hour between retries, every try is accounted for.
func TestLocker_WaitersFIFO(t *testing.T) {
	ctx := context.Background()
	ns, ms := nodes(3)
	var tries atomic.Int64
	ms[0].hook = func(_ context.Context, op string) error {
		if op == "acquire" {
			tries.Add(1)
		}
		return nil
	}
	obs := &waitObserver{started: make(chan struct{}, 8)}
	l := newLocker(t, ns, &memIssuer{}, Options{RetryDelayMin: time.Hour, RetryDelayMax: time.Hour, Observer: obs})
	g, err := l.Acquire(ctx, key, Request{TTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		g   *Grant
		err error
	}
	wait := func() <-chan result {
		ch := make(chan result, 1)
		go func() {
			g, err := l.Acquire(ctx, key, Request{TTL: time.Second, Wait: time.Minute})
			ch <- result{g, err}
		}()
		<-obs.started // queued, tried once and now waiting
		return ch
	}
	a := wait()
	b := wait()
	if err := l.Release(ctx, key, g.Token); err != nil {
		t.Fatal(err)
	}
	ra := <-a
	if ra.err != nil || ra.g.Fencing != 2 {
		t.Fatalf("first waiter: %+v; want fencing token 2", ra)
	}
	if err := l.Release(ctx, key, ra.g.Token); err != nil {
		t.Fatal(err)
	}
	rb := <-b
	if rb.err != nil || rb.g.Fencing != 3 {
		t.Fatalf("second waiter: %+v; want fencing token 3", rb)
	}
	// holder 1 + first waiter 2 (refused, then woken) + second waiter 2.
	// A release that woke every waiter would add a refused try. A grant
	// returns once a majority answered: wait for node0's answers to those
	// five tries (it counts a try before it answers).
	for range 5 {
		<-ms[0].acquired
	}
	if got := tries.Load(); got != 5 {
		t.Errorf("acquire tries on node0 = %d; want 5", got)
	}
	if n := len(l.waiters); n != 0 {
		t.Errorf("%d keys still have waiters queued", n)
	}
}

// TestLocker_WaiterLeavePassesWake: a waiter that leaves without the lock
// hands a pending wake-up to the next one; one that leaves with the lock
// does not.
func TestLocker_WaiterLeavePassesWake(t *testing.T) {
	ns, _ := nodes(1)
	l := newLocker(t, ns, &memIssuer{}, Options{})
	pending := func(w *waiter) bool {
		select {
		case <-w.wake:
			return true
		default:
			return false
		}
	}
	w1, w2, w3 := l.enqueue(key), l.enqueue(key), l.enqueue(key)
	l.wake(key, "r1")
	l.wake(key, "r2") // coalesces with the pending one
	l.leave(key, w1, false)
	if pending(w3) || !pending(w2) {
		t.Fatal("the wake-up did not pass from the first waiter to the second alone")
	}
	l.wake(key, "r3")
	l.wake(key, "r3") // the same release announced again: ignored
	l.leave(key, w2, true)
	if pending(w3) {
		t.Fatal("a granted waiter passed its wake-up on")
	}
	l.leave(key, w3, false)
	if n := len(l.waiters); n != 0 {
		t.Errorf("%d keys still have waiters queued", n)
	}
	l.wake(key, "r4") // no waiter: nothing to do
}
