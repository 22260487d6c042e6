package service

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/internal/testutil"
)

// TestSweeper_Passes: a pending delete stays while its node gives no
// answer; it is done once a delete removes the key, or after two passes that
// found the key not holding the token (not one: the first may have been
// read before a SET still waiting in an older connection).
func TestSweeper_Passes(t *testing.T) {
	ns, ms := nodes(3)
	l := newLocker(t, ns, &memIssuer{}, Options{})
	// Each pass reports what is left, then waits for the test to let the
	// sweeper go on.
	passes, next := make(chan int), make(chan struct{})
	l.sweep.passed = func() { passes <- l.sweep.size; <-next } // with sweep.mu held
	var down atomic.Bool
	down.Store(true)
	ms[0].hook = func(context.Context, string) error {
		if down.Load() {
			return context.DeadlineExceeded
		}
		return nil
	}
	ms[0].set(rkey, "t-held", time.Minute)
	l.sweep.add(0, rkey, "t-held") // the key holds the token: one delete does
	l.sweep.add(1, rkey, "t-gone") // not there: two passes
	l.sweep.add(0, rkey, "t-held") // added twice: one entry
	if n := l.sweep.count(); n != 2 {
		t.Fatalf("pending = %d; want 2", n)
	}

	// Pass 1: node 0 does not answer; node 1 finds no key (first time).
	if n := <-passes; n != 2 {
		t.Fatalf("after pass 1 pending = %d; want 2", n)
	}
	if !ms[0].has(rkey) {
		t.Fatal("the key was deleted by an unanswered delete")
	}
	down.Store(false)
	next <- struct{}{}
	// Pass 2: node 0 deletes the key; node 1 finds no key a second time.
	if n := <-passes; n != 0 {
		t.Fatalf("after pass 2 pending = %d; want 0", n)
	}
	if ms[0].has(rkey) {
		t.Error("node 0 still holds the key")
	}
	next <- struct{}{}
	// The sweeper stops when nothing is pending, and starts again.
	ms[2].set(rkey, "t-late", time.Minute)
	l.sweep.add(2, rkey, "t-late")
	if n := <-passes; n != 0 {
		t.Fatalf("after a restart pending = %d; want 0", n)
	}
	if ms[2].has(rkey) {
		t.Error("node 2 still holds the key")
	}
	next <- struct{}{}
	l.Close()
	l.sweep.add(2, rkey, "t-after-close")
	if n := l.sweep.count(); n != 0 {
		t.Errorf("pending after Close = %d; want 0", n)
	}
}

// TestLocker_StalledMajorityLeavesNoKey: a majority of real nodes stalled
// (SIGSTOP) past the node timeout while a try runs and fails. Their SETs
// wait in sockets the client gave up on, and their deletes either wait
// behind them on other connections or are dropped unsent, so the SET can
// land after its delete. Once the nodes resume, no node holds the key, and
// the same goes for a release the stalled nodes did not answer.
func TestLocker_StalledMajorityLeavesNoKey(t *testing.T) {
	rs := clustertest.Redis(t, 5, cluster.RedisOptions{})
	var ns []Node
	var admins []*redis.Client
	for _, r := range rs {
		rn := NewRedisNode(r.Addr(), RedisOptions{})
		t.Cleanup(func() { _ = rn.Close() })
		ns = append(ns, rn)
		a := redis.NewClient(&redis.Options{Addr: r.Addr()})
		t.Cleanup(func() { _ = a.Close() })
		admins = append(admins, a)
	}
	l := newLocker(t, ns, &memIssuer{}, Options{NodeTimeout: 50 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// Warm: connections open and scripts loaded on every node.
	g, err := l.Acquire(ctx, "warm", Request{TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx, "warm", g.Token); err != nil {
		t.Fatal(err)
	}

	stall := func() {
		t.Helper()
		for _, r := range rs[:3] {
			if err := r.Pause(); err != nil {
				t.Fatal(err)
			}
		}
	}
	resume := func() {
		t.Helper()
		for _, r := range rs[:3] {
			if err := r.Resume(); err != nil {
				t.Fatal(err)
			}
		}
	}
	held := func(key string) (nodes []int) {
		t.Helper()
		for i, a := range admins {
			n, err := a.Exists(ctx, "redfence:lock:"+key).Result()
			if err != nil {
				t.Fatal(err)
			}
			if n != 0 {
				nodes = append(nodes, i)
			}
		}
		return nodes
	}
	settled := func() {
		t.Helper()
		testutil.WaitFor(t, 30*time.Second, "the unanswered deletes to be redelivered", func() (bool, error) {
			return l.sweep.count() == 0, nil
		})
	}

	t.Run("FailedTry", func(t *testing.T) {
		stall()
		_, err := l.Acquire(ctx, "q", Request{TTL: time.Minute, Wait: 300 * time.Millisecond})
		resume()
		if !errors.Is(err, ErrQuorum) {
			t.Fatalf("Acquire with 3 of 5 nodes stalled = %v; want ErrQuorum", err)
		}
		settled()
		if n := held("q"); len(n) != 0 {
			t.Fatalf("nodes %v hold the key of a failed acquire", n)
		}
		g, err := l.Acquire(ctx, "q", Request{TTL: time.Minute})
		if err != nil {
			t.Fatalf("Acquire after the nodes resumed = %v; want a grant", err)
		}
		if err := l.Release(ctx, "q", g.Token); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("Release", func(t *testing.T) {
		g, err := l.Acquire(ctx, "r", Request{TTL: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		testutil.WaitFor(t, 30*time.Second, "every node to hold the key", func() (bool, error) {
			return len(held("r")) == 5, nil
		})
		stall()
		err = l.Release(ctx, "r", g.Token) // 2 nodes delete it: released
		resume()
		if err != nil {
			t.Fatalf("Release with 3 of 5 nodes stalled = %v", err)
		}
		settled()
		if n := held("r"); len(n) != 0 {
			t.Fatalf("nodes %v hold the key of a released lock", n)
		}
	})
}

// TestLocker_ExtendFencingDown: with the fencing records unreadable, an
// extend fails with ErrFencing before any node is asked, so every lease
// keeps its deadline.
func TestLocker_ExtendFencingDown(t *testing.T) {
	ns, ms := nodes(5)
	iss := &memIssuer{}
	l := newLocker(t, ns, iss, Options{})
	g, err := l.Acquire(t.Context(), key, Request{TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	settle(ms)
	var extends atomic.Int32
	for _, m := range ms {
		m.hook = func(_ context.Context, op string) error {
			if op == "extend" {
				extends.Add(1)
			}
			return nil
		}
	}
	iss.mu.Lock()
	iss.err = errors.New("postgres is down")
	iss.mu.Unlock()
	if _, err := l.Extend(t.Context(), key, g.Token, time.Second); !errors.Is(err, ErrFencing) {
		t.Fatalf("Extend with the issuer down = %v; want ErrFencing", err)
	}
	if n := extends.Load(); n != 0 {
		t.Errorf("%d nodes were asked to renew; want none", n)
	}
	for i, m := range ms {
		m.mu.Lock()
		d := m.ttl[rkey]
		m.mu.Unlock()
		if d != time.Minute {
			t.Errorf("node%d lease = %v; want 1m", i, d)
		}
	}
}
