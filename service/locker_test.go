package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	mathrand "math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/testutil"
)

// memNode is an in-memory Node with Redis' SET NX / compare-and-X semantics
// (keys never expire) and a hook to inject faults per operation.
type memNode struct {
	addr string
	mu   sync.Mutex
	vals map[string]string
	ttl  map[string]time.Duration
	// marker is the epoch marker; a restart without data clears it.
	marker string
	// hook, if set, runs before each operation; a non-nil error is returned
	// instead of doing it.
	hook     func(ctx context.Context, op string) error
	releases []string // tokens passed to Release
	// acquired receives after every Acquire, so tests can wait for
	// stragglers; nil (benchmarks) sends nothing.
	acquired chan struct{}
}

func newMem(addr string) *memNode {
	return &memNode{addr: addr, vals: map[string]string{}, ttl: map[string]time.Duration{}, acquired: make(chan struct{}, 64)}
}

func (n *memNode) Addr() string { return n.addr }

func (n *memNode) run(ctx context.Context, op string) error {
	if n.hook != nil {
		return n.hook(ctx, op)
	}
	return nil
}

func (n *memNode) Acquire(ctx context.Context, key, token string, ttl time.Duration, epoch string) (bool, time.Duration, error) {
	defer func() {
		if n.acquired != nil {
			n.acquired <- struct{}{}
		}
	}()
	if err := n.run(ctx, "acquire"); err != nil {
		return false, 0, err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if epoch != "" && n.marker != epoch {
		return false, 0, ErrMemoryLost
	}
	if _, ok := n.vals[key]; ok {
		return false, n.ttl[key], nil
	}
	n.vals[key], n.ttl[key] = token, ttl
	return true, 0, nil
}

func (n *memNode) Mark(ctx context.Context, epoch string, replace bool) (bool, error) {
	if err := n.run(ctx, "mark"); err != nil {
		return false, err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.marker != "" && !replace {
		return false, nil
	}
	n.marker = epoch
	return true, nil
}

// restart simulates a restart without persistence: every key and the marker
// are gone.
func (n *memNode) restart() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.vals, n.ttl, n.marker = map[string]string{}, map[string]time.Duration{}, ""
}

func (n *memNode) Extend(ctx context.Context, key, token string, ttl time.Duration, epoch string) (lease, prev time.Duration, err error) {
	if err := n.run(ctx, "extend"); err != nil {
		return 0, 0, err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if epoch != "" && n.marker != epoch {
		return 0, 0, ErrMemoryLost
	}
	if n.vals[key] != token {
		return 0, 0, nil
	}
	prev = n.ttl[key]
	n.ttl[key] = max(n.ttl[key], ttl) // as extendScript: never shorter
	return n.ttl[key], prev, nil
}

func (n *memNode) Restore(ctx context.Context, key, token string, lease time.Duration) (bool, error) {
	if err := n.run(ctx, "restore"); err != nil {
		return false, err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.vals[key] != token {
		return false, nil
	}
	n.ttl[key] = min(n.ttl[key], lease)
	return true, nil
}

func (n *memNode) Release(ctx context.Context, key, token string) (bool, error) {
	n.mu.Lock()
	n.releases = append(n.releases, token)
	n.mu.Unlock()
	if err := n.run(ctx, "release"); err != nil {
		return false, err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.vals[key] != token {
		return false, nil
	}
	delete(n.vals, key)
	return true, nil
}

func (n *memNode) TTL(ctx context.Context, key string) (time.Duration, error) {
	if err := n.run(ctx, "ttl"); err != nil {
		return 0, err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if _, ok := n.vals[key]; !ok {
		return 0, nil
	}
	return n.ttl[key], nil
}

func (n *memNode) Ping(ctx context.Context) error { return n.run(ctx, "ping") }

// Epoch reads the marker (see epochReader).
func (n *memNode) Epoch(ctx context.Context) (string, error) {
	if err := n.run(ctx, "epoch"); err != nil {
		return "", err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.marker, nil
}

// set stores key with ttl, or deletes it when val is "".
func (n *memNode) set(key, val string, ttl time.Duration) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if val == "" {
		delete(n.vals, key)
		delete(n.ttl, key)
		return
	}
	n.vals[key], n.ttl[key] = val, ttl
}

func (n *memNode) has(key string) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	_, ok := n.vals[key]
	return ok
}

func (n *memNode) released() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]string(nil), n.releases...)
}

// memIssuer is an in-memory Issuer.
type memIssuer struct {
	mu   sync.Mutex
	recs map[string]fencing.Record
	err  error
	hook func()
}

func (m *memIssuer) Issue(ctx context.Context, c fencing.Claim) (fencing.Token, error) {
	if m.hook != nil {
		m.hook()
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.err != nil {
		return 0, m.err
	}
	if m.recs == nil {
		m.recs = map[string]fencing.Record{}
	}
	r := m.recs[c.Key]
	r.Claim, r.Token = c, r.Token+1
	m.recs[c.Key] = r
	return r.Token, nil
}

func (m *memIssuer) Last(ctx context.Context, key string) (fencing.Record, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.err != nil {
		return fencing.Record{}, m.err
	}
	return m.recs[key], nil
}

// clock is a manual clock; the monotonic reading is irrelevant to the Locker
// as long as Now is consistent.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// settle waits until every node has answered one Acquire.
func settle(ms []*memNode) {
	for _, m := range ms {
		<-m.acquired
	}
}

// countOps sets a hook on each of ms that counts its op operations.
func countOps(ms []*memNode, op string) *atomic.Int32 {
	var n atomic.Int32
	for _, m := range ms {
		m.hook = func(_ context.Context, o string) error {
			if o == op {
				n.Add(1)
			}
			return nil
		}
	}
	return &n
}

func nodes(n int) ([]Node, []*memNode) {
	ns := make([]Node, n)
	ms := make([]*memNode, n)
	for i := range n {
		ms[i] = newMem(fmt.Sprintf("node%d", i))
		ns[i] = ms[i]
	}
	return ns, ms
}

// newLocker is New with a seeded Rand. Unless opts sets one, a locker on the
// real clock without a registry gets a per-node timeout no scheduler stall
// reaches: in-memory nodes answer at once, and a busy machine running -race
// must not make them time out (a test of timeouts sets its own). With a
// fake clock or a registry the default stays, as quarantines last MaxTTL
// plus drift plus the node timeout.
func newLocker(t *testing.T, ns []Node, iss Issuer, opts Options) *Locker {
	t.Helper()
	if opts.NodeTimeout == 0 && opts.Now == nil && opts.Registry == nil {
		opts.NodeTimeout = time.Minute
	}
	if opts.Rand == nil {
		opts.Rand = mathrand.NewPCG(1, 2)
	}
	l, err := New(ns, iss, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Close)
	return l
}

const key = "orders"

var rkey = "redfence:lock:" + key

func TestLocker_Acquire(t *testing.T) {
	t.Run("Quorum", func(t *testing.T) {
		for _, n := range []int{1, 3, 5, 7} {
			for free := 0; free <= n; free++ {
				ns, ms := nodes(n)
				for _, m := range ms[free:] { // the rest are held by someone else
					m.vals[rkey] = "other"
					m.ttl[rkey] = time.Second
				}
				l := newLocker(t, ns, &memIssuer{}, Options{})
				g, err := l.Acquire(context.Background(), key, Request{TTL: time.Second})
				want := free >= n/2+1
				if (err == nil) != want {
					t.Errorf("N=%d free=%d: Acquire err = %v; want granted=%v", n, free, err, want)
				}
				if !want && !errors.Is(err, ErrHeld) {
					t.Errorf("N=%d free=%d: Acquire err = %v; want ErrHeld", n, free, err)
				}
				if want && g.Fencing != 1 {
					t.Errorf("N=%d: fencing = %d; want 1", n, g.Fencing)
				}
			}
		}
	})

	t.Run("StragglerNotAwaited", func(t *testing.T) {
		ns, ms := nodes(5)
		stuck := make(chan struct{})
		defer close(stuck)
		// Two nodes never answer (they ignore even their context); with a
		// per-node timeout of an hour, Acquire could only return by not
		// waiting for them once three said yes.
		for _, m := range ms[3:] {
			m.hook = func(ctx context.Context, op string) error {
				if op == "acquire" {
					<-stuck
				}
				return nil
			}
		}
		l := newLocker(t, ns, &memIssuer{}, Options{NodeTimeout: time.Hour})
		if _, err := l.Acquire(context.Background(), key, Request{TTL: time.Second}); err != nil {
			t.Fatalf("Acquire = %v; want granted", err)
		}
	})

	t.Run("TimeoutCountsAsNo", func(t *testing.T) {
		ns, ms := nodes(3)
		ms[0].vals[rkey] = "other"
		ms[2].hook = func(ctx context.Context, op string) error {
			if op == "acquire" {
				<-ctx.Done() // blocks until the per-node timeout
				return ctx.Err()
			}
			return nil
		}
		l := newLocker(t, ns, &memIssuer{}, Options{NodeTimeout: 20 * time.Millisecond})
		_, err := l.Acquire(context.Background(), key, Request{TTL: time.Second})
		var e *Error
		if !errors.As(err, &e) || !errors.Is(err, ErrQuorum) {
			t.Fatalf("Acquire = %v; want *Error matching ErrQuorum", err)
		}
		got := []Outcome{e.Nodes[0].Outcome, e.Nodes[1].Outcome, e.Nodes[2].Outcome}
		if want := []Outcome{No, Yes, Timeout}; fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("outcomes = %v; want %v", got, want)
		}
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Acquire = %v; want the node's deadline error in the chain", err)
		}
		if ms[1].has(rkey) {
			t.Error("node1 still holds the key after a failed attempt")
		}
		// The timed-out node may have set the key: it is released there too
		// (in the background: see FrozenNodesNotAwaited); node0 refused, so
		// it is not.
		testutil.WaitFor(t, 10*time.Second, "the timed-out node's release", func() (bool, error) {
			return len(ms[2].released()) == 1, nil
		})
		if r0 := len(ms[0].released()); r0 != 0 {
			t.Errorf("releases on node0 = %d; want 0", r0)
		}
	})

	t.Run("OverrunNotAwaited", func(t *testing.T) {
		// Three nodes' requests overrun the node timeout (as a pipelined
		// batch carrying a later caller's deadline does): each gets a
		// timeout vote at the round's deadline, and the refusal does not
		// wait for them to return.
		ns, ms := nodes(5)
		thaw := make(chan struct{})
		var returned atomic.Int32
		for _, m := range ms[2:] {
			m.hook = func(_ context.Context, op string) error {
				if op == "acquire" {
					defer returned.Add(1)
					select { // ignores its context
					case <-thaw:
					case <-time.After(20 * time.Second):
					}
					return errors.New("answered too late")
				}
				return nil
			}
		}
		l := newLocker(t, ns, &memIssuer{}, Options{NodeTimeout: 20 * time.Millisecond})
		_, err := l.Acquire(context.Background(), key, Request{TTL: time.Second})
		if n := returned.Load(); n != 0 {
			t.Errorf("Acquire returned after %d overrunning requests did; want 0", n)
		}
		close(thaw)
		var e *Error
		if !errors.As(err, &e) || !errors.Is(err, ErrQuorum) {
			t.Fatalf("Acquire = %v; want ErrQuorum", err)
		}
		for i, r := range e.Nodes[2:] {
			if r.Outcome != Timeout {
				t.Errorf("node %d: outcome %v; want %v", i+2, r.Outcome, Timeout)
			}
		}
	})

	t.Run("FrozenNodesNotAwaited", func(t *testing.T) {
		// Three of five nodes frozen: their SETs get no answer, and neither
		// would the deletes that follow until the node timeout. The refusal
		// comes once the SETs timed out, without waiting for those deletes
		// (another node timeout): the acquire returns while they still
		// block. The two nodes that answered have deleted the key by then.
		ns, ms := nodes(5)
		thaw := make(chan struct{})
		var blocked sync.WaitGroup
		blocked.Add(3)
		var finished, deletes atomic.Int32
		for _, m := range ms[2:] {
			m.hook = func(ctx context.Context, op string) error {
				switch op {
				case "acquire":
					return context.DeadlineExceeded // no answer in time
				case "release":
					if deletes.Add(1) <= 3 { // not the redeliveries (Close sends them once more)
						blocked.Done()
					}
					defer finished.Add(1)
					select {
					case <-thaw:
					case <-ctx.Done():
					}
					return context.DeadlineExceeded
				}
				return nil
			}
		}
		// A long node timeout: waiting for the deletes would show as all
		// three finished (by their timeout) when Acquire returns.
		l := newLocker(t, ns, &memIssuer{}, Options{NodeTimeout: 20 * time.Second})
		_, err := l.Acquire(context.Background(), key, Request{TTL: time.Second})
		if n := finished.Load(); n != 0 {
			t.Errorf("Acquire returned after %d deletes on frozen nodes ended; want 0", n)
		}
		close(thaw)
		if !errors.Is(err, ErrQuorum) {
			t.Fatalf("Acquire = %v; want ErrQuorum", err)
		}
		if ms[0].has(rkey) || ms[1].has(rkey) {
			t.Error("a node that answered still holds the key of the refused acquire")
		}
		blocked.Wait() // every frozen node was still sent its delete
	})

	t.Run("HeldNotWaitingForSlowNodes", func(t *testing.T) {
		// Three nodes hold the name for someone else and say so at once;
		// two are frozen. The refusal is decided by the three: it comes
		// without waiting for the frozen two (a long node timeout would
		// show as both finished), which are reported pending.
		ns, ms := nodes(5)
		for _, m := range ms[:3] {
			m.vals[rkey] = "other"
			m.ttl[rkey] = time.Minute
		}
		thaw := make(chan struct{})
		var finished atomic.Int32
		for _, m := range ms[3:] {
			m.hook = func(ctx context.Context, op string) error {
				if op != "acquire" {
					return nil
				}
				defer finished.Add(1)
				select {
				case <-thaw:
				case <-ctx.Done():
				}
				return context.DeadlineExceeded
			}
		}
		l := newLocker(t, ns, &memIssuer{}, Options{NodeTimeout: 20 * time.Second})
		_, err := l.Acquire(context.Background(), key, Request{TTL: time.Second})
		if n := finished.Load(); n != 0 {
			t.Errorf("Acquire returned after %d frozen nodes answered; want 0", n)
		}
		close(thaw)
		var e *Error
		if !errors.As(err, &e) || !errors.Is(err, ErrHeld) || e.RetryAfter <= 0 {
			t.Fatalf("Acquire = %v; want ErrHeld with a retry-after", err)
		}
		for i, r := range e.Nodes {
			want := "no"
			if i >= 3 {
				want = "pending"
			}
			if r.Outcome.String() != want || r.Addr != ns[i].Addr() {
				t.Errorf("node %d: %s %s; want %s %s", i, r.Addr, r.Outcome, ns[i].Addr(), want)
			}
		}
	})

	t.Run("FailedAttemptReleasesEverywhere", func(t *testing.T) {
		ns, ms := nodes(5)
		for _, m := range ms[2:] {
			m.vals[rkey] = "other"
			m.ttl[rkey] = 700 * time.Millisecond
		}
		ms[3].ttl[rkey] = 300 * time.Millisecond
		ms[4].ttl[rkey] = 900 * time.Millisecond
		l := newLocker(t, ns, &memIssuer{}, Options{})
		_, err := l.Acquire(context.Background(), key, Request{TTL: time.Second})
		var e *Error
		if !errors.As(err, &e) || !errors.Is(err, ErrHeld) {
			t.Fatalf("Acquire = %v; want ErrHeld", err)
		}
		// Majority free once the 3rd longest of {700, 300, 900} ms has passed.
		if e.RetryAfter != 300*time.Millisecond {
			t.Errorf("RetryAfter = %v; want 300ms", e.RetryAfter)
		}
		// Released where it said yes (the refusal does not wait for a yes
		// that comes after the three no: wait for the round to end); the
		// nodes that said no hold another token, so a compare-and-delete
		// there would change nothing.
		l.ops.Wait(t.Context())
		for i, m := range ms {
			want := 0
			if i < 2 {
				want = 1
			}
			if r := m.released(); len(r) != want {
				t.Errorf("node%d: %d releases; want %d", i, len(r), want)
			}
		}
		for i, m := range ms[:2] {
			if m.has(rkey) {
				t.Errorf("node%d still holds the key", i)
			}
		}
		for i, m := range ms[2:] {
			if m.vals[rkey] != "other" { // all attempts are over: no race
				t.Errorf("node%d: other holder's key was touched", i+2)
			}
		}
	})

	t.Run("ValidityExhausted", func(t *testing.T) {
		ns, ms := nodes(3)
		clk := &clock{t: time.Unix(1000, 0)}
		for _, m := range ms {
			m.hook = func(ctx context.Context, op string) error {
				if op == "acquire" {
					clk.Advance(600 * time.Millisecond) // any 2 x 600ms > 1s TTL
				}
				return nil
			}
		}
		iss := &memIssuer{}
		l := newLocker(t, ns, iss, Options{Now: clk.Now})
		_, err := l.Acquire(context.Background(), key, Request{TTL: time.Second})
		if !errors.Is(err, ErrExpired) {
			t.Fatalf("Acquire = %v; want ErrExpired", err)
		}
		for i, m := range ms {
			if m.has(rkey) || len(m.released()) != 1 {
				t.Errorf("node%d: holds=%v releases=%d; want released", i, m.has(rkey), len(m.released()))
			}
		}
		if r, _ := iss.Last(context.Background(), key); r.Token != 0 {
			t.Errorf("token %d issued for an expired quorum; want none", r.Token)
		}
	})

	t.Run("StallBeforeIssuance", func(t *testing.T) {
		ns, ms := nodes(5)
		clk := &clock{t: time.Unix(1000, 0)}
		iss := &memIssuer{}
		l := newLocker(t, ns, iss, Options{Now: clk.Now, AfterQuorum: func(ctx context.Context, key string) {
			clk.Advance(2 * time.Second) // a GC pause longer than the TTL
		}})
		_, err := l.Acquire(context.Background(), key, Request{TTL: time.Second})
		if !errors.Is(err, ErrExpired) {
			t.Fatalf("Acquire = %v; want ErrExpired", err)
		}
		for i, m := range ms {
			if m.has(rkey) {
				t.Errorf("node%d still holds the key", i)
			}
		}
	})

	t.Run("IssuerDown", func(t *testing.T) {
		ns, ms := nodes(5)
		pgErr := errors.New("connection refused")
		l := newLocker(t, ns, &memIssuer{err: pgErr}, Options{})
		_, err := l.Acquire(context.Background(), key, Request{TTL: time.Second})
		if !errors.Is(err, ErrFencing) || !errors.Is(err, pgErr) {
			t.Fatalf("Acquire = %v; want ErrFencing wrapping the issuer's error", err)
		}
		for i, m := range ms {
			if m.has(rkey) {
				t.Errorf("node%d still holds the key", i)
			}
		}
	})

	t.Run("RetriesUntilWaitEnds", func(t *testing.T) {
		ns, ms := nodes(3)
		var mu sync.Mutex
		attempts := 0
		for _, m := range ms {
			m.vals[rkey] = "other"
			m.ttl[rkey] = time.Hour
		}
		ms[0].hook = func(ctx context.Context, op string) error {
			if op == "acquire" {
				mu.Lock()
				attempts++
				mu.Unlock()
			}
			return nil
		}
		l := newLocker(t, ns, &memIssuer{}, Options{RetryDelayMin: time.Millisecond, RetryDelayMax: 5 * time.Millisecond})
		_, err := l.Acquire(context.Background(), key, Request{TTL: time.Second, Wait: 100 * time.Millisecond})
		if !errors.Is(err, ErrWaitTimeout) || !errors.Is(err, ErrHeld) {
			t.Fatalf("Acquire = %v; want ErrWaitTimeout and ErrHeld", err)
		}
		mu.Lock()
		defer mu.Unlock()
		if attempts < 2 {
			t.Errorf("%d attempts; want retries until the wait ran out", attempts)
		}
	})

	t.Run("Jitter", func(t *testing.T) {
		ns, _ := nodes(1)
		l := newLocker(t, ns, &memIssuer{}, Options{RetryDelayMin: 10 * time.Millisecond, RetryDelayMax: 100 * time.Millisecond})
		seen := map[time.Duration]bool{}
		for range 100 {
			d := l.jitter(&Error{})
			if d < 10*time.Millisecond || d >= 100*time.Millisecond {
				t.Fatalf("jitter = %v; want in [10ms, 100ms)", d)
			}
			seen[d] = true
		}
		if len(seen) < 50 {
			t.Errorf("%d distinct delays in 100; want random delays", len(seen))
		}
		if d := l.jitter(&Error{RetryAfter: 2 * time.Millisecond}); d > 12*time.Millisecond {
			t.Errorf("jitter with RetryAfter 2ms = %v; want at most 2ms + RetryDelayMin", d)
		}
	})

	t.Run("CancelEndsWait", func(t *testing.T) {
		ns, ms := nodes(3)
		for _, m := range ms {
			m.vals[rkey] = "other"
		}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		ms[0].hook = func(_ context.Context, op string) error {
			if op == "acquire" {
				cancel() // the client goes away during the first attempt
			}
			return nil
		}
		l := newLocker(t, ns, &memIssuer{}, Options{RetryDelayMin: time.Hour, RetryDelayMax: time.Hour})
		_, err := l.Acquire(ctx, key, Request{TTL: time.Second, Wait: time.Minute})
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("Acquire = %v; want context.Canceled", err)
		}
		if errors.Is(err, ErrWaitTimeout) {
			t.Errorf("Acquire = %v; cancellation must not look like a wait timeout", err)
		}
	})

	// A caller gone before its first try (or before the try after a
	// refresh) gets no round: its SETs would hold the free name for nobody
	// until their clean-up, refusing live callers meanwhile.
	t.Run("GoneBeforeTry", func(t *testing.T) {
		ns, ms := nodes(5)
		sets := countOps(ms, "acquire")
		l := newLocker(t, ns, &memIssuer{}, Options{})
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		for _, wait := range []time.Duration{0, time.Minute} {
			_, err := l.Acquire(ctx, key, Request{TTL: time.Second, Wait: wait})
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("Acquire (wait %v) = %v; want context.Canceled", wait, err)
			}
		}
		if n := sets.Load(); n != 0 {
			t.Errorf("Acquires of a caller already gone sent %d SETs; want none", n)
		}
		if _, err := l.Acquire(context.Background(), key, Request{TTL: time.Second}); err != nil {
			t.Errorf("Acquire of the free name after them = %v", err)
		}
	})

	t.Run("StopEndsWait", func(t *testing.T) {
		ns, ms := nodes(3)
		for _, m := range ms {
			m.vals[rkey] = "other"
			m.ttl[rkey] = time.Hour
		}
		obs := &waitObserver{started: make(chan struct{}, 1)}
		l := newLocker(t, ns, &memIssuer{}, Options{RetryDelayMin: time.Hour, RetryDelayMax: time.Hour, Observer: obs})
		stop := make(chan struct{})
		done := make(chan error, 1)
		go func() {
			_, err := l.Acquire(context.Background(), key, Request{TTL: time.Second, Wait: time.Minute, Stop: stop})
			done <- err
		}()
		<-obs.started // refused once, now waiting an hour
		close(stop)
		err := <-done
		if !errors.Is(err, ErrWaitStopped) || !errors.Is(err, ErrHeld) || errors.Is(err, ErrWaitTimeout) {
			t.Fatalf("Acquire = %v; want ErrWaitStopped and ErrHeld, not ErrWaitTimeout", err)
		}
		// Stopped before it starts: one try, then no wait at all.
		_, err = l.Acquire(context.Background(), key, Request{TTL: time.Second, Wait: time.Minute, Stop: stop})
		if !errors.Is(err, ErrWaitStopped) || !errors.Is(err, ErrHeld) {
			t.Fatalf("Acquire with Stop closed = %v; want ErrWaitStopped and ErrHeld", err)
		}
		select {
		case <-obs.started:
			t.Error("Acquire with Stop closed started a wait")
		default:
		}
		// A free lock is still granted: Stop ends waits, not tries.
		l.ops.Wait(t.Context()) // the refusals' last nodes answered
		for _, m := range ms {
			delete(m.vals, rkey)
		}
		if _, err := l.Acquire(context.Background(), key, Request{TTL: time.Second, Wait: time.Minute, Stop: stop}); err != nil {
			t.Fatalf("Acquire of a free lock with Stop closed = %v; want a grant", err)
		}
	})

	t.Run("WokenByRelease", func(t *testing.T) {
		ns, _ := nodes(3)
		l := newLocker(t, ns, &memIssuer{}, Options{RetryDelayMin: time.Hour, RetryDelayMax: time.Hour})
		g, err := l.Acquire(context.Background(), key, Request{TTL: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		started := make(chan struct{})
		done := make(chan error, 1)
		go func() {
			close(started)
			g2, err := l.Acquire(context.Background(), key, Request{TTL: time.Second, Wait: time.Minute})
			if err == nil && g2.Fencing != 2 {
				err = fmt.Errorf("fencing = %d; want 2", g2.Fencing)
			}
			done <- err
		}()
		<-started
		if err := l.Release(context.Background(), key, g.Token); err != nil {
			t.Fatal(err)
		}
		// With an hour between retries, only the in-process wake-up can
		// grant the waiter before the test times out.
		if err := <-done; err != nil {
			t.Fatalf("waiter: %v", err)
		}
	})

	t.Run("InvalidTTL", func(t *testing.T) {
		ns, _ := nodes(1)
		l := newLocker(t, ns, &memIssuer{}, Options{MaxTTL: time.Minute})
		for _, r := range []Request{{TTL: 0}, {TTL: time.Hour}, {TTL: time.Second, Wait: -1}, {TTL: time.Second, Wait: time.Hour}} {
			if _, err := l.Acquire(context.Background(), key, r); !errors.Is(err, ErrInvalid) {
				t.Errorf("Acquire(%+v) = %v; want ErrInvalid", r, err)
			}
		}
	})
}

func TestLocker_Extend(t *testing.T) {
	ctx := context.Background()
	t.Run("KeepsFencingToken", func(t *testing.T) {
		ns, ms := nodes(5)
		l := newLocker(t, ns, &memIssuer{}, Options{})
		g, err := l.Acquire(ctx, key, Request{TTL: time.Second, Owner: "a"})
		if err != nil {
			t.Fatal(err)
		}
		settle(ms)
		g2, err := l.Extend(ctx, key, g.Token, 5*time.Second)
		if err != nil {
			t.Fatalf("Extend = %v", err)
		}
		if g2.Fencing != g.Fencing || g2.Owner != "a" {
			t.Errorf("Extend fencing, owner = %d, %q; want %d, a", g2.Fencing, g2.Owner, g.Fencing)
		}
		renewed := 0
		for _, m := range ms {
			m.mu.Lock()
			if m.ttl[rkey] == 5*time.Second {
				renewed++
			}
			m.mu.Unlock()
		}
		if renewed < 3 {
			t.Errorf("%d nodes renewed to 5s; want at least a majority", renewed)
		}
	})
	t.Run("ReportsTheLeaseKept", func(t *testing.T) {
		// A renewal shorter than the lease keeps the lease, and the grant
		// says so: its deadline is the majority's, not the one asked for
		// (up to MaxTTL: see TestLocker_ExtendClockSteppedBack).
		ns, ms := nodes(5)
		l := newLocker(t, ns, &memIssuer{}, Options{MaxTTL: 10 * time.Minute})
		g, err := l.Acquire(ctx, key, Request{TTL: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		settle(ms)
		// The nodes hold leases of 2 to 5 minutes: whichever three answer
		// first, a majority keeps between 2 and 3 minutes.
		for i, d := range []time.Duration{5 * time.Minute, 4 * time.Minute, 3 * time.Minute, 2 * time.Minute, 2 * time.Minute} {
			ms[i].mu.Lock()
			ms[i].ttl[rkey] = d
			ms[i].mu.Unlock()
		}
		g2, err := l.Extend(ctx, key, g.Token, time.Second)
		if err != nil {
			t.Fatalf("Extend = %v", err)
		}
		if lease := g2.Expires.Sub(g2.Start); lease < 2*time.Minute-l.drift(2*time.Minute) || lease > 3*time.Minute {
			t.Errorf("Extend to 1s of leases of 2 to 5 minutes reports %v; want 2 to 3 minutes less the drift allowance", lease)
		}
		if g2.TTL != time.Second {
			t.Errorf("Extend TTL = %v; want the 1s asked for", g2.TTL)
		}
	})
	t.Run("LostOnMajority", func(t *testing.T) {
		ns, ms := nodes(5)
		l := newLocker(t, ns, &memIssuer{}, Options{})
		g, err := l.Acquire(ctx, key, Request{TTL: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		settle(ms)
		for _, m := range ms[:3] { // expired early on 3 of 5 (a clock jump)
			m.set(rkey, "", 0)
		}
		_, err = l.Extend(ctx, key, g.Token, 10*time.Second)
		if !errors.Is(err, ErrLost) {
			t.Fatalf("Extend = %v; want ErrLost", err)
		}
		// The two nodes that renewed get their earlier lease back: not
		// deleted (the "no"s may be wrong: see undoRenewals), not renewed.
		for i, m := range ms {
			m.mu.Lock()
			v, ttl := m.vals[rkey], m.ttl[rkey]
			m.mu.Unlock()
			if want := (i >= 3); (v == g.Token) != want || want && ttl != time.Second {
				t.Errorf("node%d after a lost extend: %q for %v; want A's key with its 1s lease on node3 and node4 only", i, v, ttl)
			}
		}
	})
	t.Run("NewerTokenExists", func(t *testing.T) {
		// A newer token was issued (here for a try that is never granted,
		// as when a stalled try's issuance commits late): the grant is
		// fenced out and cannot be renewed, but its lease still runs until
		// its deadline, or until its holder releases it. Ending it early
		// would let another client win the name before the holder has
		// heard that it lost it.
		ns, ms := nodes(3)
		iss := &memIssuer{}
		// Every node's release is awaited below: a node timeout no slow
		// moment of a loaded machine reaches (at the default 50ms, a
		// straggler's delete under -race timed out and was left to the
		// sweeper).
		l := newLocker(t, ns, iss, Options{NodeTimeout: time.Minute})
		g, err := l.Acquire(ctx, key, Request{TTL: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		settle(ms)
		if _, err := iss.Issue(ctx, fencing.Claim{Key: key, Holder: "someone else"}); err != nil {
			t.Fatal(err)
		}
		if _, err := l.Extend(ctx, key, g.Token, time.Second); !errors.Is(err, ErrLost) {
			t.Fatalf("Extend = %v; want ErrLost", err)
		}
		for i, m := range ms {
			if !m.has(rkey) {
				t.Errorf("node%d: the fenced-out grant's lease was ended before its deadline", i)
			}
		}
		if _, err := l.Acquire(ctx, key, Request{TTL: time.Second}); !errors.Is(err, ErrHeld) {
			t.Errorf("another acquire during the lease = %v; want ErrHeld", err)
		}
		if err := l.Release(ctx, key, g.Token); err != nil {
			t.Errorf("the holder's release after the refused extend = %v", err)
		}
		// The release returned once a majority answered; the others follow.
		// (A node may also have been sent the refused acquire's cleanup, with
		// that try's token: only the holder's release counts here.)
		// (Release notes the token before it deletes.)
		for i, m := range ms {
			testutil.WaitFor(t, 10*time.Second, fmt.Sprintf("node%d's release to delete the key", i), func() (bool, error) {
				return slices.Contains(m.released(), g.Token) && !m.has(rkey), nil
			})
		}
	})
	t.Run("NoQuorum", func(t *testing.T) {
		ns, ms := nodes(3)
		l := newLocker(t, ns, &memIssuer{}, Options{})
		g, err := l.Acquire(ctx, key, Request{TTL: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		settle(ms)
		down := errors.New("connection refused")
		for _, m := range ms[1:] {
			m.hook = func(context.Context, string) error { return down }
		}
		if _, err := l.Extend(ctx, key, g.Token, time.Second); !errors.Is(err, ErrQuorum) || !errors.Is(err, down) {
			t.Fatalf("Extend = %v; want ErrQuorum wrapping the node error", err)
		}
		if !ms[0].has(rkey) {
			t.Error("an undecided extend released the lock")
		}
	})
}

func TestLocker_Release(t *testing.T) {
	ctx := context.Background()
	ns, ms := nodes(5)
	l := newLocker(t, ns, &memIssuer{}, Options{})
	g, err := l.Acquire(ctx, key, Request{TTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	settle(ms)
	if err := l.Release(ctx, key, "wrong"); !errors.Is(err, ErrNotHolder) {
		t.Errorf("Release(wrong token) = %v; want ErrNotHolder", err)
	}
	for i, m := range ms {
		if !m.has(rkey) {
			t.Errorf("node%d: a wrong token deleted the key", i)
		}
	}
	if err := l.Release(ctx, key, g.Token); err != nil {
		t.Errorf("Release = %v; want nil", err)
	}
	if err := l.Release(ctx, key, g.Token); !errors.Is(err, ErrNotHolder) {
		t.Errorf("second Release = %v; want ErrNotHolder", err)
	}
	down := errors.New("down")
	for _, m := range ms {
		m.hook = func(context.Context, string) error { return down }
	}
	if err := l.Release(ctx, key, g.Token); !errors.Is(err, ErrQuorum) {
		t.Errorf("Release with every node down = %v; want ErrQuorum", err)
	}
}

// TestLocker_ConcurrentReleases: releases of one token run one after the
// other, so of two sent at once exactly one deletes the lock and the other
// finds it gone (ErrNotHolder), rather than both deleting part of it.
func TestLocker_ConcurrentReleases(t *testing.T) {
	ctx := context.Background()
	ns, ms := nodes(5)
	l := newLocker(t, ns, &memIssuer{}, Options{})
	for trial := range 20 {
		name := fmt.Sprintf("%s-%d", key, trial)
		g, err := l.Acquire(ctx, name, Request{TTL: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		settle(ms) // every node holds it
		errs := make(chan error, 2)
		for range 2 {
			go func() { errs <- l.Release(ctx, name, g.Token) }()
		}
		var ok, notHolder int
		for range 2 {
			switch err := <-errs; {
			case err == nil:
				ok++
			case errors.Is(err, ErrNotHolder):
				notHolder++
			default:
				t.Fatalf("trial %d: Release = %v", trial, err)
			}
		}
		if ok != 1 || notHolder != 1 {
			t.Fatalf("trial %d: two concurrent releases: %d released, %d not holder; want 1 and 1", trial, ok, notHolder)
		}
	}
}

// TestLocker_ReleaseAfterStraggler: a release must not be undone by the late
// SET of the round that granted the lock. Release does not wait for that
// straggler; the straggler deletes what it set once it lands.
func TestLocker_ReleaseAfterStraggler(t *testing.T) {
	ctx := context.Background()
	ns, ms := nodes(5)
	land := make(chan struct{})
	releases := make(chan struct{}, 8)
	ms[4].hook = func(_ context.Context, op string) error {
		switch op {
		case "acquire": // a straggler: its SET lands only when the test says
			<-land
		case "release":
			releases <- struct{}{}
		}
		return nil
	}
	l := newLocker(t, ns, &memIssuer{}, Options{NodeTimeout: time.Hour})
	g, err := l.Acquire(ctx, key, Request{TTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	// With an hour of per-node timeout, Release could not return if it
	// waited for the straggler.
	if err := l.Release(ctx, key, g.Token); err != nil {
		t.Fatalf("Release = %v", err)
	}
	<-releases // the release round's DEL reached node 4 (before the SET)
	close(land)
	<-ms[4].acquired
	select { // the straggler undoes its own late SET
	case <-releases:
	case <-time.After(10 * time.Second): // a guard against hanging, not a timing assertion
		t.Fatal("the late SET was never undone")
	}
	if ms[4].has(rkey) {
		t.Error("node 4 holds the key after the release: the late SET outlived it")
	}
	if err := l.Release(ctx, key, g.Token); !errors.Is(err, ErrNotHolder) {
		t.Errorf("second Release = %v; want ErrNotHolder", err)
	}
}

func TestLocker_Status(t *testing.T) {
	ctx := context.Background()
	ns, ms := nodes(5)
	l := newLocker(t, ns, &memIssuer{}, Options{})
	st, err := l.Status(ctx, key)
	if err != nil || st.Held || st.Last.Token != 0 {
		t.Fatalf("Status = %+v, %v; want free, no token", st, err)
	}
	if _, err := l.Acquire(ctx, key, Request{TTL: time.Second, Owner: "me"}); err != nil {
		t.Fatal(err)
	}
	settle(ms)
	for i, m := range ms {
		m.set(rkey, "x", time.Duration(i+1)*100*time.Millisecond)
	}
	st, err = l.Status(ctx, key)
	if err != nil || !st.Held || st.Last.Token != 1 || st.Last.Owner != "me" {
		t.Fatalf("Status = %+v, %v; want held by me with token 1", st, err)
	}
	if st.Remaining != 300*time.Millisecond {
		t.Errorf("Remaining = %v; want 300ms (the quorum-th longest)", st.Remaining)
	}
}

// memRegistry is an in-memory Registry on a manual clock.
type memRegistry struct {
	clk     *clock
	mu      sync.Mutex
	epochs  map[string]string
	until   map[string]time.Time
	runIDs  map[string]string        // the process on record ("" none)
	durable map[string]bool          // it fsyncs every write
	servers map[string]time.Duration // server id -> the quarantine it needs
}

func newRegistry(clk *clock) *memRegistry {
	return &memRegistry{clk: clk, epochs: map[string]string{}, until: map[string]time.Time{}, runIDs: map[string]string{}, durable: map[string]bool{}}
}

// marked returns a channel that receives each time n is marked: the last step
// of handling a lost memory, after the Locker adopted the quarantine.
func marked(n *memNode) <-chan struct{} {
	ch := make(chan struct{}, 16)
	n.hook = func(_ context.Context, op string) error {
		if op == "mark" {
			ch <- struct{}{}
		}
		return nil
	}
	return ch
}

func (r *memRegistry) RegisterNode(ctx context.Context, addr, epoch string, check func(context.Context) error) (string, time.Duration, bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if cur, ok := r.epochs[addr]; ok {
		return cur, r.left(addr), false, nil
	}
	if check != nil {
		if err := check(ctx); err != nil {
			return "", 0, false, err
		}
	}
	r.epochs[addr] = epoch
	var need time.Duration // as store: quarantined if servers may hold leases
	for _, q := range r.servers {
		need = max(need, q)
	}
	if need > 0 {
		r.until[addr] = r.clk.Now().Add(need)
	}
	return epoch, r.left(addr), true, nil
}

func (r *memRegistry) QuarantineNode(ctx context.Context, addr, expected, next, runID string, durable bool, d time.Duration) (string, time.Duration, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.epochs[addr] == expected || (runID != "" && r.runIDs[addr] != runID) {
		r.quarantine(addr, next, d)
		if runID != "" {
			r.runIDs[addr], r.durable[addr] = runID, durable
		}
	}
	return r.epochs[addr], r.left(addr), nil
}

func (r *memRegistry) NodeProcess(ctx context.Context, addr, runID, next string, durable bool) (string, time.Duration, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var need time.Duration // as store: only if servers may hold leases
	for _, q := range r.servers {
		need = max(need, q)
	}
	was := r.runIDs[addr]
	restarted := was != "" && was != runID && !(durable && r.durable[addr]) && need > 0
	if restarted {
		r.quarantine(addr, next, 0)
	}
	r.runIDs[addr], r.durable[addr] = runID, durable
	return r.epochs[addr], r.left(addr), nil
}

// quarantine moves addr to epoch next and quarantines it for at least d and
// the longest quarantine any server needs, never shortening one. r.mu is
// held.
func (r *memRegistry) quarantine(addr, next string, d time.Duration) {
	for _, q := range r.servers { // as store: the longest any server needs
		d = max(d, q)
	}
	r.epochs[addr] = next
	if end := r.clk.Now().Add(d); end.After(r.until[addr]) {
		r.until[addr] = end
	}
}

func (r *memRegistry) Heartbeat(ctx context.Context, id string, quarantine, grace time.Duration, _ []string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.servers == nil {
		r.servers = map[string]time.Duration{}
	}
	r.servers[id] = quarantine
	return nil
}

// left is the time left of addr's quarantine on r's clock. r.mu is held.
func (r *memRegistry) left(addr string) time.Duration {
	return max(r.until[addr].Sub(r.clk.Now()), 0)
}

func TestLocker_Quarantine(t *testing.T) {
	ctx := context.Background()
	// setup: A holds the lock on nodes 0-2 only (3 and 4 were held by
	// someone else whose keys then expired); node 0 restarts without data.
	setup := func(t *testing.T, reg Registry, clk *clock) (*Locker, []*memNode) {
		ns, ms := nodes(5)
		l := newLocker(t, ns, &memIssuer{}, Options{Registry: reg, Now: clk.Now, MaxTTL: time.Minute})
		if err := l.Init(ctx); err != nil {
			t.Fatal(err)
		}
		for _, m := range ms[3:] {
			m.set(rkey, "other", time.Second)
		}
		if _, err := l.Acquire(ctx, key, Request{TTL: 30 * time.Second}); err != nil {
			t.Fatalf("A: %v", err)
		}
		settle(ms)
		for _, m := range ms[3:] {
			m.set(rkey, "", 0)
		}
		ms[0].restart()
		return l, ms
	}

	t.Run("NoSecondHolder", func(t *testing.T) {
		clk := &clock{t: time.Unix(1000, 0)}
		reg := newRegistry(clk)
		l, ms := setup(t, reg, clk)
		recovered := marked(ms[0])
		_, err := l.Acquire(ctx, key, Request{TTL: time.Second})
		var e *Error
		if !errors.As(err, &e) {
			t.Fatalf("B = %v; want refused while A's lease is live", err)
		}
		if e.Nodes[0].Outcome != Quarantined {
			t.Errorf("restarted node's outcome = %v; want quarantined", e.Nodes[0].Outcome)
		}
		<-recovered
		// The recorded quarantine covers every lease the node may have held.
		_, until := l.members[0].state()
		if want := clk.Now().Add(time.Minute); until.Before(want) {
			t.Errorf("quarantined until %v; want at least MaxTTL later, %v", until, want)
		}
		if st := l.Nodes(ctx); st[0].QuarantinedUntil.IsZero() || st[0].QuarantineReason != QuarantineLostMemory {
			t.Errorf("Nodes shows %+v; want quarantined as %q", st[0], QuarantineLostMemory)
		}
		// Even once re-marked, its yes does not count until the end.
		if _, err := l.Acquire(ctx, "other-name", Request{TTL: time.Second}); err != nil {
			t.Errorf("other names still get a majority of 4 counted nodes: %v", err)
		}
		clk.Advance(time.Minute + time.Second)
		if !l.counts(0, clk.Now()) {
			t.Error("node still not counted after the quarantine ended")
		}
	})

	t.Run("RegistryClockOffset", func(t *testing.T) {
		// The registry's clock (Postgres') is set 10 s behind this
		// server's: the quarantine still lasts MaxTTL on this server.
		clk := &clock{t: time.Unix(1000, 0)}
		reg := newRegistry(&clock{t: time.Unix(990, 0)})
		l, ms := setup(t, reg, clk)
		recovered := marked(ms[0])
		if _, err := l.Acquire(ctx, key, Request{TTL: time.Second}); err == nil {
			t.Fatal("B granted while A's lease is live")
		}
		<-recovered
		clk.Advance(time.Minute - time.Second)
		if l.counts(0, clk.Now()) {
			t.Error("node counted again before MaxTTL passed on this server's clock")
		}
	})

	t.Run("LongestMaxTTLWins", func(t *testing.T) {
		// Another server sharing the nodes grants leases of up to 5
		// minutes: the quarantine this server starts covers them.
		clk := &clock{t: time.Unix(1000, 0)}
		reg := newRegistry(clk)
		l, ms := setup(t, reg, clk)
		var ons []Node // nodes of its own: only its heartbeat matters here
		for i := range 3 {
			ons = append(ons, newMem(fmt.Sprintf("other%d", i)))
		}
		other := newLocker(t, ons, &memIssuer{}, Options{Registry: reg, Now: clk.Now, MaxTTL: 5 * time.Minute})
		if err := other.Init(ctx); err != nil {
			t.Fatal(err)
		}
		recovered := marked(ms[0])
		if _, err := l.Acquire(ctx, key, Request{TTL: time.Second}); err == nil {
			t.Fatal("B granted while A's lease is live")
		}
		<-recovered
		if _, until := l.members[0].state(); until.Before(clk.Now().Add(5 * time.Minute)) {
			t.Errorf("quarantined until %v; want at least the other server's 5m MaxTTL later, %v", until, clk.Now().Add(5*time.Minute))
		}
	})

	t.Run("NegativeControl", func(t *testing.T) {
		clk := &clock{t: time.Unix(1000, 0)}
		l, _ := setup(t, nil, clk)
		if _, err := l.Acquire(ctx, key, Request{TTL: time.Second}); err != nil {
			t.Fatalf("without a registry B = %v; want granted (two holders: what quarantine prevents)", err)
		}
	})

	t.Run("NewClusterNotQuarantined", func(t *testing.T) {
		clk := &clock{t: time.Unix(1000, 0)}
		ns, ms := nodes(5)
		l := newLocker(t, ns, &memIssuer{}, Options{Registry: newRegistry(clk), Now: clk.Now})
		if err := l.Init(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := l.Acquire(ctx, key, Request{TTL: time.Second}); err != nil {
			t.Fatal(err)
		}
		settle(ms)
		for i, st := range l.Nodes(ctx) {
			if !st.QuarantinedUntil.IsZero() || !st.Up {
				t.Errorf("node %d = %+v; want up, not quarantined", i, st)
			}
		}
	})

	t.Run("NoGrantBeforeInit", func(t *testing.T) {
		clk := &clock{t: time.Unix(1000, 0)}
		ns, ms := nodes(3)
		l := newLocker(t, ns, &memIssuer{}, Options{Registry: newRegistry(clk), Now: clk.Now})
		if _, err := l.Acquire(ctx, key, Request{TTL: time.Second}); !errors.Is(err, ErrFencing) || !strings.Contains(err.Error(), "Init") {
			t.Fatalf("Acquire before Init = %v; want ErrFencing naming Init (no restart would be found)", err)
		}
		for i, m := range ms {
			if m.has(rkey) {
				t.Errorf("node %d holds the key of a refused acquire", i)
			}
		}
		if err := l.Init(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := l.Acquire(ctx, key, Request{TTL: time.Second}); err != nil {
			t.Fatalf("Acquire after Init = %v; want a grant", err)
		}
	})

	t.Run("ServersAgree", func(t *testing.T) {
		clk := &clock{t: time.Unix(1000, 0)}
		reg := newRegistry(clk)
		ns, ms := nodes(3)
		l1 := newLocker(t, ns, &memIssuer{}, Options{Registry: reg, Now: clk.Now, MaxTTL: time.Minute})
		l2 := newLocker(t, ns, &memIssuer{}, Options{Registry: reg, Now: clk.Now, MaxTTL: time.Minute})
		for _, l := range []*Locker{l1, l2} {
			if err := l.Init(ctx); err != nil {
				t.Fatal(err)
			}
		}
		ms[0].restart()
		recovered := marked(ms[0])
		if _, err := l1.Acquire(ctx, "a", Request{TTL: time.Second}); err != nil {
			t.Fatal(err)
		}
		<-recovered
		_, until1 := l1.members[0].state()
		clk.Advance(10 * time.Second)
		// l2 still expects the old epoch: the node's new marker tells it to
		// look the quarantine up, and it adopts the same end.
		if _, err := l2.Acquire(ctx, "b", Request{TTL: time.Second}); err != nil {
			t.Fatal(err)
		}
		<-recovered
		_, until2 := l2.members[0].state()
		if !until2.Equal(until1) {
			t.Errorf("second server's quarantine ends %v; want the first's %v", until2, until1)
		}
	})
}

// blockingRegistry is a Registry whose QuarantineNode waits for its context
// to end.
type blockingRegistry struct {
	*memRegistry
	entered  chan struct{}
	returned atomic.Bool
}

func (r *blockingRegistry) QuarantineNode(ctx context.Context, addr, expected, next, runID string, durable bool, d time.Duration) (string, time.Duration, error) {
	r.entered <- struct{}{}
	<-ctx.Done()
	r.returned.Store(true)
	return "", 0, ctx.Err()
}

// TestLocker_CloseWaitsForRecovery: Close ends the recording of a node
// restart that is under way and waits for it, so nothing touches the
// registry or the nodes after Close.
func TestLocker_CloseWaitsForRecovery(t *testing.T) {
	ctx := context.Background()
	clk := &clock{t: time.Unix(1000, 0)}
	reg := &blockingRegistry{memRegistry: newRegistry(clk), entered: make(chan struct{}, 1)}
	ns, ms := nodes(5)
	l := newLocker(t, ns, &memIssuer{}, Options{Registry: reg, Now: clk.Now, MaxTTL: time.Minute, IssueTimeout: time.Hour})
	if err := l.Init(ctx); err != nil {
		t.Fatal(err)
	}
	ms[0].restart()
	if _, err := l.Acquire(ctx, key, Request{TTL: time.Second}); err != nil {
		t.Fatalf("acquire with 4 of 5 nodes counted = %v", err)
	}
	<-reg.entered
	l.Close()
	if !reg.returned.Load() {
		t.Error("Close returned while the recovery still ran")
	}
}

// flakyBeats is a Registry whose heartbeats fail when fail says so, given
// the heartbeat's number (1 for the first).
type flakyBeats struct {
	*memRegistry
	beats atomic.Int32
	fail  func(n int32) bool
}

func (r *flakyBeats) Heartbeat(ctx context.Context, id string, quarantine, grace time.Duration, nodes []string) error {
	if r.fail(r.beats.Add(1)) {
		return errors.New("postgres is down")
	}
	return r.memRegistry.Heartbeat(ctx, id, quarantine, grace, nodes)
}

// beatOnceLocker is an initialised Locker on 5 nodes, reading the time from
// now, whose heartbeats fail after the first, and its grant of key (TTL a
// minute).
func beatOnceLocker(t *testing.T, clk *clock, now func() time.Time) (*Locker, *Grant) {
	t.Helper()
	ns, _ := nodes(5)
	l := newLocker(t, ns, &memIssuer{}, Options{Registry: &flakyBeats{memRegistry: newRegistry(clk), fail: func(n int32) bool { return n > 1 }}, Now: now})
	if err := l.Init(context.Background()); err != nil {
		t.Fatal(err)
	}
	g, err := l.Acquire(context.Background(), key, Request{TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	return l, g
}

// TestLocker_StaleHeartbeat: a Locker whose last successful heartbeat is
// half the grace old grants and extends nothing (the registry could stop
// counting it before such a lease ended), and resumes once one succeeds.
func TestLocker_StaleHeartbeat(t *testing.T) {
	ctx := context.Background()
	clk := &clock{t: time.Unix(1000, 0)}
	l, g := beatOnceLocker(t, clk, clk.Now)
	l.beatMu.Lock()
	fresh := l.lastBeat
	l.lastBeat = time.Now().Add(-heartbeatGrace / 2)
	l.beatMu.Unlock()
	if _, err := l.Acquire(ctx, "other", Request{TTL: time.Second}); !errors.Is(err, ErrFencing) {
		t.Errorf("acquire with a stale heartbeat = %v; want ErrFencing", err)
	}
	if _, err := l.Extend(ctx, key, g.Token, time.Minute); !errors.Is(err, ErrFencing) {
		t.Errorf("extend with a stale heartbeat = %v; want ErrFencing", err)
	}
	if err := l.Release(ctx, key, g.Token); err != nil {
		t.Errorf("release with a stale heartbeat = %v; want it to work (it shortens nothing)", err)
	}
	l.beatMu.Lock()
	l.lastBeat = fresh.Add(heartbeatGrace) // as a success would
	l.beatMu.Unlock()
	if _, err := l.Acquire(ctx, "other", Request{TTL: time.Second}); err != nil {
		t.Errorf("acquire once the heartbeat is fresh = %v", err)
	}
}

// TestLocker_StaleHeartbeatAtStart: a lease runs from the time its round
// starts, so the heartbeat must be fresh then, not only at an earlier check:
// a server paused between the two (a stopped process, a stalled VM) could
// otherwise grant or extend long after the registry stopped counting it,
// beside a server of another node list. The pause is played by the clock:
// the Now call that reads a round's start makes the heartbeat stale first.
func TestLocker_StaleHeartbeatAtStart(t *testing.T) {
	ctx := context.Background()
	clk := &clock{t: time.Unix(1000, 0)}
	var l *Locker
	var calls, pauseAt atomic.Int32 // pause at the pauseAt-th Now call (0: never)
	now := func() time.Time {
		if n := calls.Add(1); n == pauseAt.Load() {
			l.beatMu.Lock()
			l.lastBeat = time.Now().Add(-heartbeatGrace)
			l.beatMu.Unlock()
		}
		return clk.Now()
	}
	l, g := beatOnceLocker(t, clk, now)
	l.beatMu.Lock()
	fresh := l.lastBeat
	l.beatMu.Unlock()

	// Extend reads its start first (Now call 1); Acquire reads its
	// deadline, then its start (call 2).
	calls.Store(0)
	pauseAt.Store(1)
	if _, err := l.Extend(ctx, key, g.Token, time.Minute); !errors.Is(err, ErrFencing) {
		t.Errorf("extend paused before its start until the heartbeat was stale = %v; want ErrFencing", err)
	}
	l.beatMu.Lock()
	l.lastBeat = fresh
	l.beatMu.Unlock()
	calls.Store(0)
	pauseAt.Store(2)
	if _, err := l.Acquire(ctx, "other", Request{TTL: time.Second}); !errors.Is(err, ErrFencing) {
		t.Errorf("acquire paused before its start until the heartbeat was stale = %v; want ErrFencing", err)
	}
}

// TestLocker_InitRetried: an Init that failed on its heartbeat can be
// retried, and the retry starts the heartbeat (a Locker must not serve
// unrecorded in the registry).
func TestLocker_InitRetried(t *testing.T) {
	ctx := context.Background()
	clk := &clock{t: time.Unix(1000, 0)}
	reg := &flakyBeats{memRegistry: newRegistry(clk), fail: func(n int32) bool { return n == 1 }}
	ns, _ := nodes(5)
	l := newLocker(t, ns, &memIssuer{}, Options{Registry: reg, Now: clk.Now})
	if err := l.Init(ctx); err == nil {
		t.Fatal("Init with a failing heartbeat = nil; want its error")
	}
	if err := l.Init(ctx); err != nil {
		t.Fatalf("Init retried = %v", err)
	}
	reg.mu.Lock()
	n := len(reg.servers)
	reg.mu.Unlock()
	if n != 1 {
		t.Errorf("%d servers recorded after the retried Init; want 1", n)
	}
}

// TestLocker_HeartbeatOutageLogged: the log says when this server stops
// granting for want of a recorded heartbeat (once), and when a heartbeat is
// recorded again.
func TestLocker_HeartbeatOutageLogged(t *testing.T) {
	ctx := context.Background()
	clk := &clock{t: time.Unix(1000, 0)}
	var down atomic.Bool
	reg := &flakyBeats{memRegistry: newRegistry(clk), fail: func(int32) bool { return down.Load() }}
	logs := &testutil.Buffer{}
	ns, _ := nodes(5)
	l := newLocker(t, ns, &memIssuer{}, Options{Registry: reg, Now: clk.Now, Logger: slog.New(slog.NewJSONHandler(logs, nil))})
	if err := l.Init(ctx); err != nil {
		t.Fatal(err)
	}
	down.Store(true)
	l.beatMu.Lock()
	l.lastBeat = time.Now().Add(-heartbeatGrace / 2) // as after 10 s of failures
	l.beatMu.Unlock()
	has := func(msg string, n int) func() (bool, error) {
		return func() (bool, error) { return strings.Count(logs.String(), msg) >= n, nil }
	}
	const stopped = "grants and extends no lock until Postgres records its heartbeat again"
	testutil.WaitFor(t, time.Minute, "the stop to be logged", has(stopped, 1))
	testutil.WaitFor(t, time.Minute, "a second failed heartbeat", has("could not renew this server's heartbeat", 2))
	down.Store(false)
	testutil.WaitFor(t, time.Minute, "the recovery to be logged", has("heartbeat is recorded again", 1))
	if n := strings.Count(logs.String(), stopped); n != 1 {
		t.Errorf("the stop was logged %d times; want once:\n%s", n, logs)
	}
	if _, err := l.Acquire(ctx, key, Request{TTL: time.Second}); err != nil {
		t.Errorf("acquire after the recovery = %v", err)
	}
}

// TestLocker_RemarkAfterFailedMark: a node whose mark failed at the start of
// its quarantine (a node out of memory refuses writes during an eviction
// spell) is marked again once it accepts writes, within the quarantine, so
// that the first acquire after the cause passed does not find it "restarted"
// and quarantine it anew.
func TestLocker_RemarkAfterFailedMark(t *testing.T) {
	ctx := context.Background()
	clk := &clock{t: time.Unix(1000, 0)}
	ns, ms := nodes(5)
	l := newLocker(t, ns, &memIssuer{}, Options{Registry: newRegistry(clk), Now: clk.Now, MaxTTL: time.Minute, IssueTimeout: time.Hour})
	if err := l.Init(ctx); err != nil {
		t.Fatal(err)
	}
	var refuse atomic.Bool
	refuse.Store(true)
	ms[0].hook = func(ctx context.Context, op string) error {
		if op == "mark" && refuse.Load() {
			return errors.New("OOM command not allowed when used memory > 'maxmemory'")
		}
		return nil
	}
	ms[0].restart()
	if _, err := l.Acquire(ctx, key, Request{TTL: time.Second}); err != nil {
		t.Fatalf("acquire with 4 of 5 nodes counted = %v", err)
	}
	marker := func() string {
		ms[0].mu.Lock()
		defer ms[0].mu.Unlock()
		return ms[0].marker
	}
	testutil.WaitFor(t, 30*time.Second, "the node's quarantine to be recorded", func() (bool, error) {
		m := l.members[0]
		m.mu.Lock()
		defer m.mu.Unlock()
		return m.epoch != "" && !m.until.IsZero(), nil
	})
	refuse.Store(false) // the spell is over: the node takes writes again
	testutil.WaitFor(t, 30*time.Second, "the node to be marked again", func() (bool, error) {
		return marker() != "", nil
	})
	l.members[0].mu.Lock()
	epoch := l.members[0].epoch
	l.members[0].mu.Unlock()
	if got := marker(); got != epoch {
		t.Errorf("node 0's marker = %q; want the epoch of its quarantine, %q", got, epoch)
	}
}

// TestLocker_ExtendAfterOneNodeLostTheKey: a lease held on exactly 3 of 5
// nodes (2 were busy when it was granted), and one of the 3 loses its key.
// The extend that finds this must not free the name before the deadline
// its client was given:
//   - a node that lost its memory (marker gone) is found by the extend
//     itself: it does not count, the extend answers ErrQuorum (the lease
//     stands), and a competing acquire is refused;
//   - a node that lost the key alone (evicted) makes a majority answer
//     "no": the extend answers ErrLost, and the nodes that renewed get
//     their earlier lease back rather than losing the key.
func TestLocker_ExtendAfterOneNodeLostTheKey(t *testing.T) {
	ctx := context.Background()
	setup := func(t *testing.T) (*Locker, []*memNode, *Grant) {
		clk := &clock{t: time.Unix(1000, 0)}
		ns, ms := nodes(5)
		l := newLocker(t, ns, &memIssuer{}, Options{Registry: newRegistry(clk), Now: clk.Now, MaxTTL: time.Minute})
		if err := l.Init(ctx); err != nil {
			t.Fatal(err)
		}
		for _, m := range ms[3:] {
			m.set(rkey, "other", time.Second)
		}
		a, err := l.Acquire(ctx, key, Request{TTL: 20 * time.Second})
		if err != nil {
			t.Fatalf("A: %v", err)
		}
		settle(ms)
		for _, m := range ms[3:] {
			m.set(rkey, "", 0)
		}
		return l, ms, a
	}

	t.Run("MemoryLost", func(t *testing.T) {
		l, ms, a := setup(t)
		recovered := marked(ms[0])
		ms[0].restart()
		_, err := l.Extend(ctx, key, a.Token, 40*time.Second)
		if !errors.Is(err, ErrQuorum) {
			t.Fatalf("extend = %v; want ErrQuorum (the node that lost its memory does not count)", err)
		}
		<-recovered
		for i, m := range ms[1:3] {
			m.mu.Lock()
			v := m.vals[rkey]
			m.mu.Unlock()
			if v != a.Token {
				t.Errorf("node %d lost A's key", i+1)
			}
		}
		if b, err := l.Acquire(ctx, key, Request{TTL: time.Second}); err == nil {
			t.Fatalf("B granted (token %d) while A (token %d) holds the lease: two holders", b.Fencing, a.Fencing)
		}
	})

	t.Run("KeyEvicted", func(t *testing.T) {
		l, ms, a := setup(t)
		ms[0].set(rkey, "", 0)
		_, err := l.Extend(ctx, key, a.Token, 40*time.Second)
		if !errors.Is(err, ErrLost) {
			t.Fatalf("extend = %v; want ErrLost (a majority answered no)", err)
		}
		for i, m := range ms[1:3] {
			m.mu.Lock()
			v, ttl := m.vals[rkey], m.ttl[rkey]
			m.mu.Unlock()
			if v != a.Token || ttl != 20*time.Second {
				t.Errorf("node %d after the failed extend: %q for %v; want A's key with its earlier 20s lease", i+1, v, ttl)
			}
		}
	})
}

// TestLocker_ExtendSlowerThanTheLease: a renewal whose round took longer
// than the lease it got answers ErrLost, and leaves the renewed keys as they
// are (they run out about now): shortening them back could cut short a
// renewal of the same token that succeeded meanwhile through another server.
func TestLocker_ExtendSlowerThanTheLease(t *testing.T) {
	ctx := context.Background()
	clk := &clock{t: time.Unix(1000, 0)}
	ns, ms := nodes(5)
	l := newLocker(t, ns, &memIssuer{}, Options{Now: clk.Now, NodeTimeout: time.Minute})
	g, err := l.Acquire(ctx, key, Request{TTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	settle(ms)
	for _, m := range ms {
		m.hook = func(_ context.Context, op string) error {
			if op == "extend" {
				clk.Advance(time.Second) // each answer takes the whole lease
			}
			return nil
		}
	}
	if _, err := l.Extend(ctx, key, g.Token, 2*time.Second); !errors.Is(err, ErrLost) {
		t.Fatalf("extend = %v; want ErrLost (the round took longer than the lease)", err)
	}
	for i, m := range ms {
		m.mu.Lock()
		v, ttl := m.vals[rkey], m.ttl[rkey]
		m.mu.Unlock()
		if v != g.Token || ttl != 2*time.Second {
			t.Errorf("node%d after the slow extend: %q for %v; want the key as renewed (2s)", i, v, ttl)
		}
	}
}
