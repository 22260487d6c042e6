package service

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/internal/testutil"
)

// TestPipeline_AsyncBatches: asynchronous calls queued while a pipeline is
// on the wire go out together in the next one, and each callback runs once
// with its own answer.
func TestPipeline_AsyncBatches(t *testing.T) {
	n, h, _ := realNode(t, RedisOptions{})
	bg := context.Background()
	first := holdFirst(n, h)
	const calls = 20
	type answer struct {
		i   int
		ok  bool
		err error
	}
	answers := make(chan answer, 2*calls)
	for i := range calls {
		key := fmt.Sprintf("k%d", i%(calls/2)) // two calls per key: one wins
		n.acquireAsync(bg, acquireArgs(key, fmt.Sprint("t", i), time.Minute), "", func(ok bool, _ time.Duration, err error) {
			answers <- answer{i, ok, err}
		})
	}
	close(h.hold)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	won := map[int]bool{}
	for range calls {
		a := <-answers
		if a.err != nil {
			t.Fatalf("call %d: %v", a.i, a.err)
		}
		won[a.i%(calls/2)] = won[a.i%(calls/2)] || a.ok
		if a.ok && a.i >= calls/2 {
			t.Errorf("call %d won key k%d; the first call for it was queued first", a.i, a.i%(calls/2))
		}
	}
	if len(won) != calls/2 {
		t.Errorf("%d keys answered; want %d", len(won), calls/2)
	}
	if b := h.batches(); len(b) != 2 || b[1] != calls {
		t.Errorf("pipeline sizes = %v; want [1 %d]", b, calls)
	}
	if b := h.commands(); len(b) != 2 || b[1] != 1 {
		t.Errorf("commands per pipeline = %v; want [1 1]: the %d acquires merged into one EVALSHA", b, calls)
	}
	select {
	case a := <-answers:
		t.Errorf("call %d answered twice", a.i)
	default:
	}
}

// TestPipeline_YieldOnlyWhenBusy: the writer yields before a write only
// while the node is busy (its last batch carried more than one command); a
// command on an idle node goes out at once.
func TestPipeline_YieldOnlyWhenBusy(t *testing.T) {
	n, h, _ := realNode(t, RedisOptions{})
	var yields atomic.Int32
	n.pipe.yield = func() { yields.Add(1) } // before any call reaches the writer
	bg := context.Background()

	// Commands queued behind a held batch reach the idle writer, which
	// sends them together without yielding first.
	first := holdFirst(n, h)
	const calls = 5
	acquireBehind(t, n, h, first, "busy", calls)
	if b := h.batches(); len(b) != 2 || b[1] != calls {
		t.Fatalf("pipeline sizes = %v; want [1 %d]", b, calls)
	}
	if got := yields.Load(); got != 0 {
		t.Fatalf("%d yields before the first batch of an idle node; want 0", got)
	}

	// That batch made the node busy: the next write yields once. It
	// carried one command, so the writes after it do not.
	one := func(key string) {
		t.Helper()
		done := make(chan error, 1)
		n.acquireAsync(bg, acquireArgs(key, "t", time.Minute), "", func(_ bool, _ time.Duration, err error) { done <- err })
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	one("after-busy")
	if got := yields.Load(); got != 1 {
		t.Fatalf("%d yields for the first command after a batch of %d; want 1", got, calls)
	}
	for i := range 3 {
		one(fmt.Sprint("idle", i))
	}
	if got := yields.Load(); got != 1 {
		t.Errorf("%d yields in all after lone commands; want still 1", got)
	}
}

// TestPipeline_AsyncClose: Close answers queued asynchronous calls with
// errNodeClosed, and a call after Close is answered at once.
func TestPipeline_AsyncClose(t *testing.T) {
	n, h, _ := realNode(t, RedisOptions{})
	bg := context.Background()
	first := holdFirst(n, h)
	queued := make(chan error, 1)
	n.releaseAsync(bg, releaseArgs("b", "t1"), func(_ bool, err error) { queued <- err })
	closed := make(chan error, 1)
	go func() { closed <- n.Close() }()
	// The writer answers the queued call once the batch on the wire is
	// done; the node is closed by then.
	<-n.pipe.closed
	close(h.hold)
	if err := <-queued; !errors.Is(err, errNodeClosed) {
		t.Fatalf("queued call: %v; want errNodeClosed", err)
	}
	<-first
	<-closed
	after := make(chan error, 1)
	n.acquireAsync(bg, acquireArgs("c", "t2", time.Minute), "", func(_ bool, _ time.Duration, err error) { after <- err })
	if err := <-after; !errors.Is(err, errNodeClosed) {
		t.Fatalf("call after Close: %v; want errNodeClosed", err)
	}
}

// realLocker returns a Locker over n real pipelined Redis nodes and admin
// clients of those nodes.
func realLocker(t *testing.T, n int, opts Options) (*Locker, []*RedisNode, []*redis.Client) {
	t.Helper()
	rs := clustertest.Redis(t, n, cluster.RedisOptions{})
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
	return newLocker(t, ns, &memIssuer{}, opts), rns, admins
}

// TestLocker_AsyncRounds: on pipelined nodes, acquire and release rounds
// are answered through the nodes' writers (no goroutine per node), and a
// failed try has deleted what it set on every node before it returns.
func TestLocker_AsyncRounds(t *testing.T) {
	l, rns, admins := realLocker(t, 5, Options{NodeTimeout: 10 * time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	queued := func() (sum int64) {
		for _, n := range rns {
			sum += n.pipe.queued.Load()
		}
		return sum
	}
	q0 := queued()
	g, err := l.Acquire(ctx, key, Request{TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx, key, g.Token); err != nil {
		t.Fatal(err)
	}
	if q := queued() - q0; q < 5+3 {
		t.Errorf("%d calls went through the node writers; want every acquire and at least a majority of releases (8)", q)
	}

	// A release answers once a majority deleted the lock: wait for the
	// others' deletes.
	clean := func(what string, admins []*redis.Client) {
		t.Helper()
		testutil.WaitFor(t, 10*time.Second, what, func() (bool, error) {
			for _, a := range admins {
				if n, err := a.Exists(ctx, rkey).Result(); err != nil || n != 0 {
					return false, err
				}
			}
			return true, nil
		})
	}
	clean("every node to drop the released lock", admins)

	// Another holder on 3 of 5 nodes: the try fails, and the 2 free nodes
	// it set are cleaned up (a refused try answers once a majority refused:
	// a node that answers after that gets its delete then).
	for _, a := range admins[:3] {
		if err := a.Set(ctx, rkey, "someone-else", time.Minute).Err(); err != nil {
			t.Fatal(err)
		}
	}
	_, err = l.Acquire(ctx, key, Request{TTL: time.Minute})
	if !errors.Is(err, ErrHeld) {
		t.Fatalf("Acquire of a held lock = %v; want ErrHeld", err)
	}
	clean("the failed try's keys on nodes 3 and 4 to be deleted", admins[3:])
	for i, a := range admins[:3] {
		if v, err := a.Get(ctx, rkey).Result(); err != nil || v != "someone-else" {
			t.Errorf("node %d: the holder's key = %q, %v; the failed try must leave it", i, v, err)
		}
	}
}

// TestLocker_AsyncConcurrent: many concurrent acquires and releases of a
// few names over pipelined nodes never grant one name twice at once.
func TestLocker_AsyncConcurrent(t *testing.T) {
	l, _, _ := realLocker(t, 5, Options{NodeTimeout: 10 * time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const workers, rounds, names = 32, 40, 4
	var mu sync.Mutex
	holding := map[string]bool{}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for r := range rounds {
				name := fmt.Sprintf("n%d", (w+r)%names)
				g, err := l.Acquire(ctx, name, Request{TTL: time.Minute})
				if errors.Is(err, ErrHeld) {
					continue
				}
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				if holding[name] {
					t.Errorf("%s granted twice at once", name)
				}
				holding[name] = true
				mu.Unlock()
				runtime.Gosched() // give the other workers a chance to try
				mu.Lock()
				holding[name] = false
				mu.Unlock()
				if err := l.Release(ctx, name, g.Token); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	// No try or release left a key behind: each name is free well before
	// the minute-long TTL of a leaked key would end.
	for _, name := range []string{"n0", "n1", "n2", "n3"} {
		g, err := l.Acquire(ctx, name, Request{TTL: time.Minute, Wait: 20 * time.Second})
		if err != nil {
			t.Fatalf("%s after the run: %v", name, err)
		}
		if err := l.Release(ctx, name, g.Token); err != nil {
			t.Fatal(err)
		}
	}
}

// lateNode is a memNode that answers acquires asynchronously, and holds the
// answer of each acquire until the test lets it go (after the node's
// deadline, to play a late answer).
type lateNode struct {
	*memNode
	held chan heldAcquire
}

type heldAcquire struct {
	ctx    context.Context
	answer func()
}

func (n *lateNode) async() bool { return true }

func (n *lateNode) acquireAsync(ctx context.Context, a *scriptArgs, epoch string, done func(bool, time.Duration, error)) {
	key, token, ttl := a.keys[0].(string), a.argv[0].(string), time.Duration(a.argv[1].(int64))*time.Millisecond
	n.held <- heldAcquire{ctx: ctx, answer: func() {
		ok, rem, err := n.memNode.Acquire(context.Background(), key, token, ttl, epoch)
		done(ok, rem, err)
	}}
}

func (n *lateNode) releaseAsync(ctx context.Context, a *scriptArgs, done func(bool, error)) {
	key, token := a.keys[0].(string), a.argv[0].(string)
	go func() { done(n.memNode.Release(ctx, key, token)) }()
}

// outcomes records the Locker's per-node outcomes.
type outcomes struct {
	nopObserver
	mu  sync.Mutex
	got map[string][]Outcome
}

func (o *outcomes) NodeOp(addr, op string, out Outcome, _ time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.got == nil {
		o.got = map[string][]Outcome{}
	}
	o.got[addr+" "+op] = append(o.got[addr+" "+op], out)
}

func (o *outcomes) of(addr, op string) []Outcome {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]Outcome(nil), o.got[addr+" "+op]...)
}

// TestLocker_AsyncLateAnswer: an asynchronous answer that comes after the
// node's deadline counts as a timeout, even when the node did set the key;
// when the grant was released meanwhile, the late SET is deleted again.
func TestLocker_AsyncLateAnswer(t *testing.T) {
	ns, ms := nodes(3)
	late := &lateNode{memNode: ms[2], held: make(chan heldAcquire, 1)}
	ns[2] = late
	obs := &outcomes{}
	l := newLocker(t, ns, &memIssuer{}, Options{NodeTimeout: 20 * time.Millisecond, Observer: obs})
	ctx := context.Background()
	g, err := l.Acquire(ctx, key, Request{TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx, key, g.Token); err != nil {
		t.Fatal(err)
	}
	h := <-late.held
	<-h.ctx.Done() // the node's deadline has passed
	h.answer()     // its SET lands now, late
	// The late SET is undone once the answer is in.
	testutil.WaitFor(t, time.Minute, "the late SET deleted", func() (bool, error) { return !ms[2].has(rkey), nil })
	if got := obs.of("node2", "acquire"); len(got) != 1 || got[0] != Timeout {
		t.Errorf("node2's acquire outcomes = %v; want one Timeout", got)
	}
	if got := obs.of("node0", "acquire"); len(got) != 1 || got[0] != Yes {
		t.Errorf("node0's acquire outcomes = %v; want one Yes", got)
	}
}

// TestPipeline_AsyncQueueFull: asynchronous calls beyond the queue's room
// wait for it elsewhere (the caller never blocks) and are all answered once.
func TestPipeline_AsyncQueueFull(t *testing.T) {
	n, h, _ := realNode(t, RedisOptions{})
	bg := context.Background()
	first := holdFirst(n, h)
	calls := cap(n.pipe.queue) + 100
	answers := make(chan error, 2*calls)
	for i := range calls { // returns although the queue fills up
		n.releaseAsync(bg, releaseArgs(fmt.Sprint("k", i), "t"), func(_ bool, err error) { answers <- err })
	}
	close(h.hold)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	for range calls {
		if err := <-answers; err != nil {
			t.Fatal(err)
		}
	}
	// Every call went through the writer, so a later one is answered after
	// all of them: no call is answered twice.
	if _, err := n.TTL(bg, "x"); err != nil {
		t.Fatal(err)
	}
	if len(answers) != 0 {
		t.Errorf("%d extra answers", len(answers))
	}
}
