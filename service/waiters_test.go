package service

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redfence/redfence/internal/keyspace"
	"github.com/redfence/redfence/internal/testutil"
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

// countWakes is a Request.Continue that counts the waiter's wake-ups in n.
func countWakes(n *atomic.Int64) func(context.Context) error {
	return func(context.Context) error { n.Add(1); return nil }
}

// TestLocker_WaitersFIFO: waiters for one key are granted in arrival order,
// and a release wakes only the first of them (no thundering herd); the one
// behind it does not even try until it is first: with an hour between
// retries, every try is accounted for.
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
	l := newLocker(t, ns, &memIssuer{}, Options{RetryDelayMin: time.Hour, RetryDelayMax: time.Hour, MaxWait: 2 * time.Hour, Observer: obs})
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
		<-obs.started // queued and now waiting
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
	// holder 1 + first waiter 2 (refused, then woken) + second waiter 1
	// (woken when first). A release that woke every waiter would add a
	// refused try, and so would a second waiter trying on arrival. A grant
	// returns once a majority answered: wait for node0's answers to those
	// four tries (it counts a try before it answers).
	for range 4 {
		<-ms[0].acquired
	}
	if got := tries.Load(); got != 4 {
		t.Errorf("acquire tries on node0 = %d; want 4", got)
	}
	if n := len(l.waiters); n != 0 {
		t.Errorf("%d keys still have waiters queued", n)
	}
}

// TestLocker_WaiterLeavePassesWake: the first waiter leaving without the
// lock wakes the next one (which tries then); one that leaves with the lock
// does not, and nor does one leaving from behind the first.
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
	l.wake(key, "r1", 1)
	l.wake(key, "r2", 1) // coalesces with the pending one
	l.leave(key, w1, false)
	if pending(w3) || !pending(w2) {
		t.Fatal("the wake-up did not pass from the first waiter to the second alone")
	}
	l.wake(key, "r3", 1)
	l.wake(key, "r3", 1) // the same release announced again: ignored
	l.leave(key, w2, true)
	if pending(w3) {
		t.Fatal("a granted waiter passed its wake-up on")
	}
	w4 := l.enqueue(key)
	l.leave(key, w4, false) // behind w3
	if pending(w3) {
		t.Fatal("a waiter leaving from behind the first woke it")
	}
	l.leave(key, w3, false)
	if pending(w3) || len(l.waiters) != 0 {
		t.Fatal("w3 left, yet is woken or still queued")
	}
	w5, w6 := l.enqueue(key), l.enqueue(key)
	l.leave(key, w5, false) // nothing pending: the next is woken all the same
	if !pending(w6) {
		t.Fatal("the first waiter left without the lock and the next was not woken")
	}
	l.leave(key, w6, false)
	if n := len(l.waiters); n != 0 {
		t.Errorf("%d keys still have waiters queued", n)
	}
	l.wake(key, "r4", 1) // no waiter: nothing to do
}

// whoKey tags a test's acquire context with the waiter's name.
type whoKey struct{}

// TestLocker_WaitersDoNotOvertake: the waiter behind the first makes no try
// of its own while the first waits, so when the lock frees without a release
// here (it expired, or a release elsewhere went unannounced) the first
// waiter's retry takes it, not the later waiter's.
func TestLocker_WaitersDoNotOvertake(t *testing.T) {
	ctx := context.Background()
	ns, ms := nodes(3)
	var mu sync.Mutex
	tries := map[string]int{}
	aTried := make(chan struct{}, 1024)
	// overtakes counts b's tries while no node holds the key: before a got
	// it (once a holds it, b is first and tries as it should).
	var overtakes atomic.Int32
	ms[0].hook = func(ctx context.Context, op string) error {
		if op == "acquire" {
			who, _ := ctx.Value(whoKey{}).(string)
			mu.Lock()
			tries[who]++
			mu.Unlock()
			if who == "a" {
				aTried <- struct{}{}
			}
			if who == "b" && !slices.ContainsFunc(ms, func(m *memNode) bool { return m.has(rkey) }) {
				overtakes.Add(1)
			}
		}
		return nil
	}
	count := func(who string) int {
		mu.Lock()
		defer mu.Unlock()
		return tries[who]
	}
	obs := &waitObserver{started: make(chan struct{}, 1024)}
	// Retries every millisecond: a waiter that tried on its own would try
	// again and again while the first one waits.
	l := newLocker(t, ns, &memIssuer{}, Options{RetryDelayMin: time.Millisecond, RetryDelayMax: 2 * time.Millisecond, Observer: obs})
	if _, err := l.Acquire(ctx, key, Request{TTL: time.Second}); err != nil {
		t.Fatal(err)
	}
	type result struct {
		g   *Grant
		err error
	}
	wait := func(who string) <-chan result {
		ch := make(chan result, 1)
		go func() {
			wctx := context.WithValue(ctx, whoKey{}, who)
			g, err := l.Acquire(wctx, key, Request{TTL: time.Second, Wait: time.Minute})
			ch <- result{g, err}
		}()
		return ch
	}
	a := wait("a")
	<-aTried // a is first: it tried
	b := wait("b")
	testutil.WaitFor(t, 10*time.Second, "b to queue behind a", func() (bool, error) {
		l.waitMu.Lock()
		defer l.waitMu.Unlock()
		wq := l.waiters[key]
		return wq != nil && len(wq.q) == 2, nil
	})
	for range 5 { // a keeps retrying
		<-aTried
	}
	if n := count("b"); n != 0 {
		t.Fatalf("b, queued behind a, tried %d times; want 0", n)
	}
	// The holder's lease ends unannounced: every node drops its key.
	for _, m := range ms {
		m.mu.Lock()
		delete(m.vals, rkey)
		m.mu.Unlock()
	}
	ra := <-a
	if ra.err != nil || ra.g.Fencing != 2 {
		t.Fatalf("first waiter: %+v; want fencing token 2", ra)
	}
	if n := overtakes.Load(); n != 0 {
		t.Fatalf("b tried %d times before a got the lock; want 0", n)
	}
	if err := l.Release(ctx, key, ra.g.Token); err != nil {
		t.Fatal(err)
	}
	rb := <-b
	if rb.err != nil || rb.g.Fencing != 3 {
		t.Fatalf("second waiter: %+v; want fencing token 3", rb)
	}
}

// TestLocker_WaiterBehindSleepsThroughOutage: while too few nodes answer,
// the first waiter retries after the (short) retry delay, but a waiter
// behind it, which makes no try, is not woken at that pace: it waits for its
// turn (checking its caller once a second at most). Found by a scale hunt:
// 2,000 waiters on one name cost 35% of a core while 3 of 5 nodes were
// stopped, against 6% while the lock was merely held.
func TestLocker_WaiterBehindSleepsThroughOutage(t *testing.T) {
	ctx := context.Background()
	ns, ms := nodes(3)
	for _, m := range ms {
		m.acquired = nil // hundreds of tries, nobody waiting for them
	}
	// No quorum, though a majority answers (so the first waiter keeps the
	// short retry delay: see TestLocker_NoMajorityWaitsForIt): node 1
	// fails, node 2 holds a stray key of the name.
	ms[1].hook = func(_ context.Context, op string) error {
		if op == "acquire" {
			return errors.New("down")
		}
		return nil
	}
	ms[2].vals[rkey], ms[2].ttl[rkey] = "stray", time.Hour
	obs := &waitObserver{started: make(chan struct{}, 1<<16)}
	l := newLocker(t, ns, &memIssuer{}, Options{RetryDelayMin: time.Millisecond, RetryDelayMax: 2 * time.Millisecond, Observer: obs})
	var aWakes, bWakes atomic.Int64
	actx, cancelA := context.WithCancel(ctx)
	bctx, cancelB := context.WithCancel(ctx)
	defer cancelA()
	defer cancelB()
	a, b := make(chan error, 1), make(chan error, 1)
	go func() {
		_, err := l.Acquire(actx, key, Request{TTL: time.Second, Wait: time.Minute, Continue: countWakes(&aWakes)})
		a <- err
	}()
	<-obs.started // A tried, failed for want of a quorum, and waits
	go func() {
		_, err := l.Acquire(bctx, key, Request{TTL: time.Second, Wait: time.Minute, Continue: countWakes(&bWakes)})
		b <- err
	}()
	testutil.WaitFor(t, time.Minute, "B to queue behind A", func() (bool, error) {
		l.waitMu.Lock()
		defer l.waitMu.Unlock()
		wq := l.waiters[key]
		return wq != nil && len(wq.q) == 2, nil
	})
	const retries = 400
	testutil.WaitFor(t, time.Minute, "A to retry", func() (bool, error) { return aWakes.Load() >= retries, nil })
	// A retried every 1-2 ms; B, woken once a second at most, saw a
	// handful of those retries (none on any but a very slow host).
	if n := bWakes.Load(); n > retries/20 {
		t.Errorf("B, behind A, woke %d times while A retried %d times; want at most %d", n, aWakes.Load(), retries/20)
	}
	cancelA()
	if err := <-a; !errors.Is(err, context.Canceled) {
		t.Fatalf("A = %v; want context.Canceled", err)
	}
	// A left without the lock: B is first now, woken at once, and retries.
	before := bWakes.Load()
	testutil.WaitFor(t, time.Minute, "B to retry as the first waiter", func() (bool, error) { return bWakes.Load() >= before+retries/20+1, nil })
	cancelB()
	if err := <-b; !errors.Is(err, context.Canceled) {
		t.Fatalf("B = %v; want context.Canceled", err)
	}
}

// announcingNode is a memNode that claims to announce releases (it never
// does), as Redis nodes do: a waiter for a held lock then retries once a
// second, not after the retry delay.
type announcingNode struct{ *memNode }

func (announcingNode) WatchReleases(string, bool)     {}
func (announcingNode) OnRelease(func(string, string)) {}

// TestLocker_WaiterHeldThroughOutage: a waiter that found the lock held
// does not fall back to the short retry delay when a later try finds too
// few nodes answering while that lease still runs: it retries as while the
// lock is held (a release wakes it). Found by a scale hunt: 3,000 waiters
// on distinct held names, then a 2-second stop of 3 of 5 nodes; every
// waiter retried 10-100 times a second, the nodes never caught up, and the
// server went from 6,000 to 225,000 goroutines and 1.5 GB within 8 s.
func TestLocker_WaiterHeldThroughOutage(t *testing.T) {
	ctx := context.Background()
	_, ms := nodes(3)
	ns := make([]Node, len(ms))
	var failing atomic.Bool
	for i, m := range ms {
		m.acquired = nil // hundreds of tries, nobody waiting for them
		ns[i] = announcingNode{m}
		if i == 1 {
			m.hook = func(_ context.Context, op string) error {
				if op == "acquire" && failing.Load() {
					return errors.New("down")
				}
				return nil
			}
		}
	}
	obs := &waitObserver{started: make(chan struct{}, 1<<16)}
	l := newLocker(t, ns, &memIssuer{}, Options{RetryDelayMin: time.Millisecond, RetryDelayMax: 2 * time.Millisecond, Observer: obs})
	hold, err := l.Acquire(ctx, key, Request{TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	// A grant answers once a majority said yes: wait for the third
	// node's SET, or A's first try could take that node and leave it free.
	testutil.WaitFor(t, time.Minute, "every node to hold the lock", func() (bool, error) {
		for _, m := range ms {
			m.mu.Lock()
			v := m.vals[rkey]
			m.mu.Unlock()
			if v != hold.Token {
				return false, nil
			}
		}
		return true, nil
	})
	var aWakes, cWakes atomic.Int64
	actx, cancelA := context.WithCancel(ctx)
	cctx, cancelC := context.WithCancel(ctx)
	defer cancelA()
	defer cancelC()
	a, c := make(chan error, 1), make(chan error, 1)
	go func() {
		_, err := l.Acquire(actx, key, Request{TTL: time.Second, Wait: time.Minute, Continue: countWakes(&aWakes)})
		a <- err
	}()
	<-obs.started // A found the lock held, and waits
	// No quorum, though a majority answers (a majority not answering
	// slows every waiter: see TestLocker_NoMajorityWaitsForIt): node 1
	// fails, node 0 lost the holder's key early, and node 2 holds a stray
	// key of C's name.
	failing.Store(true)
	ms[0].mu.Lock()
	delete(ms[0].vals, rkey)
	ms[0].mu.Unlock()
	ms[2].mu.Lock()
	ms[2].vals["redfence:lock:other"], ms[2].ttl["redfence:lock:other"] = "stray", time.Hour
	ms[2].mu.Unlock()
	// A tries again within a second (the lease it found runs for a
	// minute; no release comes): no quorum.
	// C, on a name never found held, retries after the retry delay: it
	// keeps the time.
	go func() {
		_, err := l.Acquire(cctx, "other", Request{TTL: time.Second, Wait: time.Minute, Continue: countWakes(&cWakes)})
		c <- err
	}()
	testutil.WaitFor(t, time.Minute, "A to try again", func() (bool, error) { return aWakes.Load() >= 1, nil })
	const retries = 400
	testutil.WaitFor(t, time.Minute, "C to retry", func() (bool, error) { return cWakes.Load() >= retries, nil })
	if n := aWakes.Load(); n > retries/20 {
		t.Errorf("A, which found the lock held for a minute, woke %d times while C retried %d times; want at most %d", n, cWakes.Load(), retries/20)
	}
	cancelA()
	cancelC()
	for _, ch := range []chan error{a, c} {
		if err := <-ch; !errors.Is(err, context.Canceled) {
			t.Fatalf("waiter = %v; want context.Canceled", err)
		}
	}
}

// TestLocker_WaiterBehindTimesOut: a waiter that never got to try ends its
// wait with what the first waiter's last try found (the lock is held).
func TestLocker_WaiterBehindTimesOut(t *testing.T) {
	ctx := context.Background()
	ns, ms := nodes(3)
	var bTries atomic.Int32
	ms[0].hook = func(ctx context.Context, op string) error {
		if op == "acquire" && ctx.Value(whoKey{}) == "b" {
			bTries.Add(1)
		}
		return nil
	}
	obs := &waitObserver{started: make(chan struct{}, 1024)}
	l := newLocker(t, ns, &memIssuer{}, Options{RetryDelayMin: time.Hour, RetryDelayMax: time.Hour, MaxWait: 2 * time.Hour, Observer: obs})
	if _, err := l.Acquire(ctx, key, Request{TTL: time.Minute}); err != nil {
		t.Fatal(err)
	}
	a := make(chan error, 1)
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		_, err := l.Acquire(actx, key, Request{TTL: time.Second, Wait: time.Minute})
		a <- err
	}()
	<-obs.started // a tried, was refused, and waits
	_, err := l.Acquire(context.WithValue(ctx, whoKey{}, "b"), key, Request{TTL: time.Second, Wait: 100 * time.Millisecond})
	if n := bTries.Load(); n != 0 {
		t.Errorf("the waiter behind tried %d times; want 0", n)
	}
	var e *Error
	if !errors.As(err, &e) || !errors.Is(err, ErrWaitTimeout) || !errors.Is(err, ErrHeld) {
		t.Fatalf("Acquire behind a waiter = %v; want ErrWaitTimeout and ErrHeld", err)
	}
	if len(e.Nodes) != 3 || e.RetryAfter <= 0 {
		t.Errorf("nodes %v, retry after %v; want the first waiter's 3 node answers and a retry-after", e.Nodes, e.RetryAfter)
	}
	cancel()
	if err := <-a; !errors.Is(err, context.Canceled) {
		t.Fatalf("first waiter = %v; want context.Canceled", err)
	}
}

// TestLocker_WaiterBehindReportsNews: what a waiter behind the first reports
// when its wait ends is the newest news of the lock: the first waiter's try
// that failed for want of a quorum is superseded once it got the lock (held,
// not 503), and a retry-after counts down.
func TestLocker_WaiterBehindReportsNews(t *testing.T) {
	ctx := context.Background()
	ns, ms := nodes(3)
	var failing atomic.Bool
	for _, m := range ms[1:] {
		m.hook = func(_ context.Context, op string) error {
			if op == "acquire" && failing.Load() {
				return errors.New("down")
			}
			return nil
		}
	}
	obs := &waitObserver{started: make(chan struct{}, 1024)}
	l := newLocker(t, ns, &memIssuer{}, Options{RetryDelayMin: time.Hour, RetryDelayMax: time.Hour, MaxWait: 2 * time.Hour, Observer: obs})
	failing.Store(true)
	bctx, cancelB := context.WithCancel(ctx)
	defer cancelB()
	a, b := make(chan error, 1), make(chan error, 1)
	go func() {
		_, err := l.Acquire(ctx, key, Request{TTL: time.Minute, Wait: time.Minute})
		a <- err
	}()
	<-obs.started // A tried, failed for want of a quorum, and waits
	go func() {
		_, err := l.Acquire(bctx, key, Request{TTL: time.Second, Wait: time.Minute})
		b <- err
	}()
	<-obs.started // B waits behind A
	failing.Store(false)
	l.wake(key, "r1", l.quorum) // A tries again, and is granted
	if err := <-a; err != nil {
		t.Fatalf("A = %v; want granted", err)
	}
	_, err := l.Acquire(ctx, key, Request{TTL: time.Second, Wait: 10 * time.Millisecond}) // C, behind B
	var e *Error
	if !errors.As(err, &e) || !errors.Is(err, ErrWaitTimeout) || !errors.Is(err, ErrHeld) || errors.Is(err, ErrQuorum) {
		t.Fatalf("C behind B = %v; want ErrWaitTimeout and ErrHeld, not ErrQuorum", err)
	}
	if e.RetryAfter <= 0 || e.RetryAfter > time.Minute {
		t.Errorf("C's retry-after = %v; want within A's minute-long lease", e.RetryAfter)
	}
	cancelB()
	if err := <-b; !errors.Is(err, context.Canceled) {
		t.Fatalf("B = %v; want context.Canceled", err)
	}
}

// TestLocker_WakeAgainAtMajority: a release announced node by node wakes
// the first waiter at its first announcement and again once a majority
// announced it (the try the first began may have found the others not
// released yet), never more; a release of this process (made on a
// majority) wakes it once.
func TestLocker_WakeAgainAtMajority(t *testing.T) {
	ns, _ := nodes(5)
	l := newLocker(t, ns, &memIssuer{}, Options{})
	w := l.enqueue(key)
	defer l.leave(key, w, false)
	woken := func() bool {
		select {
		case <-w.wake:
			return true
		default:
			return false
		}
	}
	for i, want := range []bool{true, false, true, false, false} {
		l.announced(keyspace.RedisKey(key), "r1")
		if got := woken(); got != want {
			t.Errorf("announcement %d of 5: woken %v; want %v", i+1, got, want)
		}
	}
	l.wake(key, "r2", l.quorum) // released here, on a majority
	if !woken() {
		t.Error("a release of this process did not wake the waiter")
	}
	for i := range 5 {
		l.announced(keyspace.RedisKey(key), "r2")
		if woken() {
			t.Errorf("announcement %d of a release of this process woke the waiter again", i+1)
		}
	}
}

// TestLocker_NoMajorityWaitsForIt: while fewer nodes than a majority answer,
// a waiting acquire does not try at the short retry delay (its tries could
// only time out on them, and thousands of waiting names each trying 10-100
// times a second buried the server in tries and clean-ups: a scale hunt saw
// 166,000 goroutines and 1 GB within seconds of 3,000 waiters arriving
// during an outage). It tries about once a second, and is woken as soon as
// a majority answers again.
func TestLocker_NoMajorityWaitsForIt(t *testing.T) {
	faulty := func(ms []*memNode) *atomic.Bool {
		var failing atomic.Bool
		failing.Store(true)
		for _, m := range ms {
			m.acquired = nil
		}
		for _, m := range ms[1:] {
			m.hook = func(_ context.Context, op string) error {
				if op == "acquire" && failing.Load() {
					return errors.New("down")
				}
				return nil
			}
		}
		return &failing
	}
	t.Run("Paced", func(t *testing.T) {
		ns, ms := nodes(3)
		faulty(ms)
		l := newLocker(t, ns, &memIssuer{}, Options{RetryDelayMin: time.Millisecond, RetryDelayMax: 2 * time.Millisecond})
		var tries atomic.Int64
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() {
			_, err := l.Acquire(ctx, key, Request{TTL: time.Second, Wait: time.Minute, Continue: countWakes(&tries)})
			done <- err
		}()
		// A clock of 400 ticks of 1 ms (at least 400 ms): at the retry
		// delay the waiter would have tried 200-400 times; about once a
		// second, once or twice (a few on a very slow host).
		const ticks = 400
		tk := time.NewTicker(time.Millisecond)
		for range ticks {
			<-tk.C
		}
		tk.Stop()
		if n := tries.Load(); n > ticks/20 {
			t.Errorf("the waiter tried %d times in %d ticks of 1 ms with no majority answering; want at most %d", n, ticks, ticks/20)
		}
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Fatalf("waiter = %v; want context.Canceled", err)
		}
	})
	t.Run("WokenWhenBack", func(t *testing.T) {
		ns, ms := nodes(3)
		failing := faulty(ms)
		obs := &waitObserver{started: make(chan struct{}, 16)}
		// An hour between tries: only a wake-up makes the second one.
		l := newLocker(t, ns, &memIssuer{}, Options{RetryDelayMin: time.Hour, RetryDelayMax: time.Hour, MaxWait: 2 * time.Hour, Observer: obs})
		done := make(chan error, 1)
		go func() {
			_, err := l.Acquire(t.Context(), key, Request{TTL: time.Second, Wait: 2 * time.Hour})
			done <- err
		}()
		select {
		case <-obs.started: // its try found no majority, and it waits
		case err := <-done:
			t.Fatalf("waiter = %v; want it to wait", err)
		}
		if l.majorityBack() == nil {
			t.Fatal("no majority answers, yet majorityBack is nil")
		}
		failing.Store(false)
		// Another request's answers tell the Locker that a majority
		// answers again.
		if _, err := l.Acquire(t.Context(), "other", Request{TTL: time.Second}); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("waiter = %v; want granted", err)
			}
		case <-time.After(time.Minute):
			t.Fatal("the waiter was not woken when a majority answered again")
		}
	})
}
