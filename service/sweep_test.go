package service

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/internal/testutil"
)

// replyErr is an error reply from a node (WRONGTYPE, READONLY, ...).
type replyErr string

func (e replyErr) Error() string { return string(e) }
func (replyErr) RedisError()     {}

// TestSweeper_Passes: a pending delete stays while its node gives no
// answer; it is done once a delete removes the key, or after two passes that
// found the key not holding the token (not one: the first may have been
// read before a SET still waiting in an older connection) once sweepSettle
// has passed since it was made; error replies end it after maxSweepErrors
// passes without stopping the node's pass.
func TestSweeper_Passes(t *testing.T) {
	ns, ms := nodes(3)
	clk := &clock{t: time.Unix(1e9, 0)}
	// A node timeout no slow moment of a loaded machine reaches (at the
	// default 50ms, a memNode answer delayed under -race would be a
	// timeout, not the answer each pass expects), with the default pass
	// interval (which follows the timeout) set back before anything is
	// pending.
	l := newLocker(t, ns, &memIssuer{}, Options{Now: clk.Now, NodeTimeout: time.Minute})
	l.sweep.every = 250 * time.Millisecond
	// Each pass reports what is left, then waits for the test to let the
	// sweeper go on.
	passes, next, quit := make(chan int), make(chan struct{}), make(chan struct{})
	l.sweep.passed = func() { // with sweep.mu held
		select {
		case passes <- l.sweep.sizeLocked():
		case <-quit:
			return
		}
		select {
		case <-next:
		case <-quit:
		}
	}
	var once sync.Once
	stopHook := func() { once.Do(func() { close(quit) }) }
	t.Cleanup(stopHook) // before l.Close: a failed test does not hang
	pass := func(want int) {
		t.Helper()
		if n := <-passes; n != want {
			t.Fatalf("after a pass %d pending; want %d", n, want)
		}
	}
	var down atomic.Bool
	down.Store(true)
	ms[0].hook = func(context.Context, string) error {
		if down.Load() {
			return context.DeadlineExceeded
		}
		return nil
	}
	ms[2].hook = func(_ context.Context, op string) error {
		if op == "release" {
			return replyErr("WRONGTYPE Operation against a key holding the wrong kind of value")
		}
		return nil
	}
	ms[0].set(rkey, "t-held", time.Minute)
	ms[1].set("other", "t-held-1", time.Minute)
	l.sweep.add(0, rkey, "t-held")         // the key holds the token: one delete does
	l.sweep.add(1, rkey, "t-gone")         // not there: two passes, once settled
	l.sweep.add(1, "other", "t-held-1")    // held: one delete
	l.sweep.add(0, rkey, "t-held")         // added twice: one entry
	l.sweep.add(2, "wrong", "t-wrongtype") // error replies
	if n := l.sweep.count(); n != 4 {
		t.Fatalf("pending = %d; want 4", n)
	}

	// Pass 1: node 0 does not answer; node 1 deletes "other" and finds no
	// key for t-gone; node 2 replies with an error.
	pass(3)
	if !ms[0].has(rkey) {
		t.Fatal("the key was deleted by an unanswered delete")
	}
	if ms[1].has("other") {
		t.Error("node 1 still holds other")
	}
	down.Store(false)
	next <- struct{}{}
	// Pass 2: node 0 deletes the key; t-gone found absent twice, but it is
	// younger than sweepSettle, so it stays.
	pass(2)
	if ms[0].has(rkey) {
		t.Error("node 0 still holds the key")
	}
	clk.Advance(sweepSettle)
	next <- struct{}{}
	pass(1) // t-gone is done; the error replies (3 so far) go on
	for range maxSweepErrors - 4 {
		next <- struct{}{}
		pass(1)
	}
	next <- struct{}{}
	pass(0) // the last error reply ends it
	next <- struct{}{}

	// The sweeper stops when nothing is pending, and starts again.
	ms[1].set(rkey, "t-late", time.Minute)
	l.sweep.add(1, rkey, "t-late")
	pass(0)
	if ms[1].has(rkey) {
		t.Error("node 1 still holds the key")
	}
	next <- struct{}{}

	// Close forgets what was pending and takes nothing more.
	l.sweep.add(2, "wrong", "t-wrongtype")
	stopHook() // Close may end the sweeper before its pass
	l.Close()
	l.sweep.add(2, "wrong", "t-after-close")
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
	var rns []*RedisNode
	var admins []*redis.Client
	for _, r := range rs {
		rn := NewRedisNode(r.Addr(), RedisOptions{})
		t.Cleanup(func() { _ = rn.Close() })
		ns, rns = append(ns, rn), append(rns, rn)
		a := redis.NewClient(&redis.Options{Addr: r.Addr()})
		t.Cleanup(func() { _ = a.Close() })
		admins = append(admins, a)
	}
	// A node timeout a loaded machine rarely reaches: only the stalled
	// nodes time out. The grants outside the stall wait out a slow moment.
	l := newLocker(t, ns, &memIssuer{}, Options{NodeTimeout: 250 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// Warm: connections open and scripts loaded on every node.
	g, err := l.Acquire(ctx, "warm", Request{TTL: time.Minute, Wait: 10 * time.Second})
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
		g, err := l.Acquire(ctx, "q", Request{TTL: time.Minute, Wait: 10 * time.Second})
		if err != nil {
			t.Fatalf("Acquire after the nodes resumed = %v; want a grant", err)
		}
		if err := l.Release(ctx, "q", g.Token); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("Release", func(t *testing.T) {
		g, err := l.Acquire(ctx, "r", Request{TTL: time.Minute, Wait: 10 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		testutil.WaitFor(t, 30*time.Second, "every node to hold the key", func() (bool, error) {
			return len(held("r")) == 5, nil
		})
		stall()
		// A command of someone else's on the wire to each stalled node
		// until well past the node timeout: the release's deletes queue
		// behind it and are dropped unsent when their deadline passes.
		blocked := make(chan error, 3)
		for _, rn := range rns[:3] {
			go func() {
				bctx, cancel := context.WithTimeout(ctx, 10*l.opts.NodeTimeout)
				defer cancel()
				_, err := rn.TTL(bctx, "other")
				blocked <- err
			}()
			testutil.WaitFor(t, 10*time.Second, "a command on the wire to the stalled node", func() (bool, error) {
				if rn.pipe.sending.TryLock() {
					rn.pipe.sending.Unlock()
					return false, nil
				}
				return true, nil
			})
		}
		err = l.Release(ctx, "r", g.Token) // 2 nodes delete it: released
		for range 3 {
			<-blocked // timed out; the deletes behind it were dropped
		}
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

// TestLocker_ReleaseSweepsAbsentNodes: a release that deleted the key on
// some nodes but found none on another leaves that node to the sweeper (the
// grant's SET there may still land), and the sweeper ends with it.
func TestLocker_ReleaseSweepsAbsentNodes(t *testing.T) {
	ns, ms := nodes(5)
	// As in TestSweeper_Passes: only node 4's answer may leave a delete
	// pending, so no answer may time out on a loaded machine.
	l := newLocker(t, ns, &memIssuer{}, Options{NodeTimeout: time.Minute})
	l.sweep.every = 250 * time.Millisecond
	ms[4].set(rkey, "someone-else", time.Minute) // the grant's SET is refused there
	g, err := l.Acquire(t.Context(), key, Request{TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	settle(ms)
	if n := l.sweep.count(); n != 0 {
		t.Fatalf("pending after a grant = %d; want 0", n)
	}
	ms[4].set(rkey, "", 0) // someone else released: node 4 holds nothing
	// What is pending after the sweeper's first pass: node 4's delete
	// alone (one "absent" answer does not end it). Read in the pass hook:
	// between passes the entry may already be gone.
	first := make(chan bool, 1)
	l.sweep.passed = func() { // with sweep.mu held
		_, ok := l.sweep.pending[4][sweepKey{rkey, g.Token}]
		select {
		case first <- ok && l.sweep.sizeLocked() == 1:
		default:
		}
	}
	if err := l.Release(t.Context(), key, g.Token); err != nil {
		t.Fatal(err)
	}
	select {
	case ok := <-first:
		if !ok {
			t.Fatal("after the sweeper's first pass, node 4's delete is not the one pending")
		}
	case <-time.After(time.Minute): // a hang, not a speed limit: nothing was left to the sweeper
		t.Fatal("the release left nothing to the sweeper")
	}
	testutil.WaitFor(t, 30*time.Second, "the sweeper to finish", func() (bool, error) {
		return l.sweep.count() == 0, nil
	})

	// A release of a token held nowhere (409) leaves nothing to sweep.
	if err := l.Release(t.Context(), key, "no-such-token"); !errors.Is(err, ErrNotHolder) {
		t.Fatalf("Release of an unknown token = %v; want ErrNotHolder", err)
	}
	if n := l.sweep.count(); n != 0 {
		t.Errorf("pending after a refused release = %d; want 0", n)
	}
}

// TestLocker_ExtendFencingDown: with the fencing records unreadable, an
// extend fails with ErrFencing before any node is asked, so every lease
// keeps its deadline.
func TestLocker_ExtendFencingDown(t *testing.T) {
	ns, ms := nodes(5)
	iss := &memIssuer{}
	l := newLocker(t, ns, iss, Options{})
	g, err := l.Acquire(t.Context(), key, Request{TTL: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	settle(ms)
	extends := countOps(ms, "extend")
	iss.mu.Lock()
	iss.err = errors.New("postgres is down")
	iss.mu.Unlock()
	if _, err := l.Extend(t.Context(), key, g.Token, time.Minute); !errors.Is(err, ErrFencing) {
		t.Fatalf("Extend with the issuer down = %v; want ErrFencing", err)
	}
	if n := extends.Load(); n != 0 {
		t.Errorf("%d nodes were asked to renew; want none", n)
	}
	for i, m := range ms {
		m.mu.Lock()
		d := m.ttl[rkey]
		m.mu.Unlock()
		if d != 30*time.Second {
			t.Errorf("node%d lease = %v; want 30s", i, d)
		}
	}
}

// failingRegistry is a Registry that cannot record quarantines.
type failingRegistry struct{ *memRegistry }

func (failingRegistry) QuarantineNode(context.Context, string, string, string, string, bool, time.Duration) (string, time.Duration, error) {
	return "", 0, errPostgresDown
}

// errPostgresDown is failingRegistry's error.
var errPostgresDown = errors.New("postgres is down")

// TestLocker_NodesLostMemory: Nodes reports a node that lost its memory as
// quarantined, and when the quarantine cannot be recorded yet, also as down
// with that reason (not the Registry's error, which is not the node's),
// never as up.
func TestLocker_NodesLostMemory(t *testing.T) {
	for _, tc := range []struct {
		name    string
		failing bool
	}{{"Recorded", false}, {"NotRecorded", true}} {
		t.Run(tc.name, func(t *testing.T) {
			ns, ms := nodes(3)
			clk := &clock{t: time.Unix(1e9, 0)}
			var reg Registry = newRegistry(clk)
			if tc.failing {
				reg = failingRegistry{newRegistry(clk)}
			}
			l := newLocker(t, ns, &memIssuer{}, Options{Registry: reg, Now: clk.Now})
			if err := l.Init(t.Context()); err != nil {
				t.Fatal(err)
			}
			for i, st := range l.Nodes(t.Context()) {
				if !st.Up || !st.QuarantinedUntil.IsZero() {
					t.Fatalf("node %d after Init: %+v; want up, not quarantined", i, st)
				}
			}
			ms[1].restart()
			st := l.Nodes(t.Context())[1]
			if st.QuarantinedUntil.IsZero() || st.QuarantineReason != QuarantineLostMemory {
				t.Errorf("node 1 lost its memory: %+v; want quarantined, as %q", st, QuarantineLostMemory)
			}
			if tc.failing && (st.Up || !errors.Is(st.Err, errRecordPending) || errors.Is(st.Err, errPostgresDown)) {
				t.Errorf("node 1 lost its memory, quarantine not recorded: %+v; want down with that reason, not the Registry's error", st)
			}
		})
	}
}
