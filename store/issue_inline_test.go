package store

import (
	"context"
	"errors"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/redfence/redfence/fencing"
)

// Who ran a batch, as batchRunner tells from the stack.
const (
	byIssue     = "Issue"     // inline, on the goroutine of the Issue call
	byCommitter = "committer" // a committer goroutine
)

// ranBatch is one batch seen by a stall.
type ranBatch struct {
	claims []fencing.Claim
	by     string // byIssue or byCommitter
}

// stall watches a DB's issuance through its hooks: it records every queued
// claim and every batch with who ran it, and holds the first batch holding
// each of the keys it was given until that key is released.
type stall struct {
	queued  chan queuedClaim
	batches chan ranBatch

	mu    sync.Mutex
	holds map[string]*heldKey // keys not held yet
	all   map[string]*heldKey
}

type heldKey struct {
	held    chan struct{} // closed once a batch holding the key is held
	gate    chan struct{} // closed by release
	release func()
}

// newStall installs a stall holding keys on db, which must not have issued
// yet. Held batches are released at the latest when the test ends (before db
// closes).
func newStall(t *testing.T, db *DB, keys ...string) *stall {
	t.Helper()
	s := &stall{
		queued:  make(chan queuedClaim, 1024),
		batches: make(chan ranBatch, 1024),
		holds:   make(map[string]*heldKey),
		all:     make(map[string]*heldKey),
	}
	for _, k := range keys {
		h := &heldKey{held: make(chan struct{}), gate: make(chan struct{})}
		var once sync.Once
		h.release = func() { once.Do(func() { close(h.gate) }) }
		s.holds[k], s.all[k] = h, h
		t.Cleanup(h.release)
	}
	db.issuer.hooks = issueHooks{
		enqueued: func(c fencing.Claim, n int) { s.queued <- queuedClaim{c, n} },
		batch: func(claims []fencing.Claim) {
			s.batches <- ranBatch{claims: claims, by: batchRunner()}
			var hold []*heldKey
			s.mu.Lock()
			for _, c := range claims {
				if h, ok := s.holds[c.Key]; ok {
					delete(s.holds, c.Key)
					hold = append(hold, h)
				}
			}
			s.mu.Unlock()
			for _, h := range hold {
				close(h.held)
			}
			for _, h := range hold {
				<-h.gate
			}
		},
	}
	return s
}

// batchRunner tells from the stack who runs the batch hook calling it.
func batchRunner() string {
	pcs := make([]uintptr, 64)
	frames := runtime.CallersFrames(pcs[:runtime.Callers(1, pcs)])
	for {
		f, more := frames.Next()
		switch {
		case strings.HasSuffix(f.Function, "store.(*DB).Issue"):
			return byIssue
		case strings.HasSuffix(f.Function, "store.(*issuer).committer"):
			return byCommitter
		}
		if !more {
			return "unknown"
		}
	}
}

// waitHeld waits until a batch holding key is held.
func (s *stall) waitHeld(t *testing.T, key string) {
	t.Helper()
	recv(t, s.all[key].held, "the batch of "+key+" to be held")
}

// release lets the held batch of key (or the next one holding it) go on.
func (s *stall) release(key string) { s.all[key].release() }

// wantQueued checks that the next claim queued is c, with the queue at n.
func (s *stall) wantQueued(t *testing.T, c fencing.Claim, n int) {
	t.Helper()
	if q := recv(t, s.queued, "a claim to be queued"); q.claim != c || q.n != n {
		t.Fatalf("queued %+v with %d queued; want %+v with %d", q.claim, q.n, c, n)
	}
}

// wantBatch checks that the next batch is of the claims want (in statement
// order), run by by.
func (s *stall) wantBatch(t *testing.T, by string, want ...fencing.Claim) {
	t.Helper()
	b := recv(t, s.batches, "a batch")
	if !slices.Equal(b.claims, want) || b.by != by {
		t.Fatalf("batch %+v run by %s; want %+v run by %s", b.claims, b.by, want, by)
	}
}

// issuerState returns the busy slots and the queue length of db's issuer.
func issuerState(db *DB) (busy, queued int) {
	q := db.issuer
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.busy, len(q.queue)
}

// wantIssued checks the outcome of an issueAsync.
func wantIssued(t *testing.T, ch <-chan issued, want fencing.Token) {
	t.Helper()
	if r := recv(t, ch, "an Issue"); r.err != nil || r.tok != want {
		t.Errorf("Issue(%+v) = %d, %v; want %d", r.claim, r.tok, r.err, want)
	}
}

// TestDB_Issue_InlineLone checks that a lone Issue runs its statement on its
// own goroutine, as a batch of one, and frees its slot before returning.
func TestDB_Issue_InlineLone(t *testing.T) {
	t.Parallel()
	db, _ := newDB(t, Options{})
	s := newStall(t, db)
	for i := range 3 {
		c := fencing.Claim{Key: "k", Owner: "o"}
		if tok, err := db.Issue(t.Context(), c); err != nil || tok != fencing.Token(i+1) {
			t.Fatalf("Issue #%d = %d, %v; want %d", i, tok, err, i+1)
		}
		s.wantQueued(t, c, 1)
		s.wantBatch(t, byIssue, c)
		if busy, queued := issuerState(db); busy != 0 || queued != 0 {
			t.Fatalf("after Issue #%d: %d busy slots, %d queued; want none", i, busy, queued)
		}
	}
	if st, cl := db.issuer.statements.Load(), db.issuer.claims.Load(); st != 3 || cl != 3 {
		t.Errorf("statements, claims = %d, %d; want 3, 3", st, cl)
	}
}

// TestDB_Issue_InlineSlotsFull checks that with every slot busy with an
// inline batch, further claims queue; once a slot frees up, a committer
// issues them together (one per key, none for a key in flight), and claims
// for one key keep their queue order.
func TestDB_Issue_InlineSlotsFull(t *testing.T) {
	t.Parallel()
	db, _ := newDB(t, Options{IssueCommitters: 2})
	s := newStall(t, db, "a", "b")
	a1, b1 := fencing.Claim{Key: "a", Owner: "1"}, fencing.Claim{Key: "b", Owner: "1"}
	ra1 := issueAsync(t.Context(), db, a1)
	s.waitHeld(t, "a")
	rb1 := issueAsync(t.Context(), db, b1)
	s.waitHeld(t, "b")
	s.wantQueued(t, a1, 1)
	s.wantQueued(t, b1, 1)
	s.wantBatch(t, byIssue, a1)
	s.wantBatch(t, byIssue, b1)

	k1x, a2, k2 := fencing.Claim{Key: "k1", Owner: "x"}, fencing.Claim{Key: "a", Owner: "2"}, fencing.Claim{Key: "k2"}
	k1y, b2 := fencing.Claim{Key: "k1", Owner: "y"}, fencing.Claim{Key: "b", Owner: "2"}
	want := map[fencing.Claim]fencing.Token{k1x: 1, a2: 2, k2: 1, k1y: 2, b2: 2}
	var results []<-chan issued
	for i, c := range []fencing.Claim{k1x, a2, k2, k1y, b2} {
		results = append(results, issueAsync(t.Context(), db, c))
		s.wantQueued(t, c, i+1) // fix the queue order
	}
	if busy, queued := issuerState(db); busy != 2 || queued != 5 {
		t.Fatalf("with both slots held: %d busy, %d queued; want 2, 5", busy, queued)
	}
	if st := db.issuer.statements.Load(); st != 0 {
		t.Fatalf("statements with both slots held = %d; want 0", st)
	}

	s.release("a")
	wantIssued(t, ra1, 1)
	s.wantBatch(t, byCommitter, a2, k1x, k2) // b is in flight, k1 once
	s.wantBatch(t, byCommitter, k1y)         // b is still in flight
	s.release("b")
	wantIssued(t, rb1, 1)
	s.wantBatch(t, byCommitter, b2)
	for _, ch := range results {
		r := recv(t, ch, "an Issue")
		if r.err != nil || r.tok != want[r.claim] {
			t.Errorf("Issue(%+v) = %d, %v; want %d", r.claim, r.tok, r.err, want[r.claim])
		}
	}
	for key, tok := range map[string]fencing.Token{"a": 2, "b": 2, "k1": 2, "k2": 1} {
		if last, err := db.Last(t.Context(), key); err != nil || last.Token != tok {
			t.Errorf("Last(%q) = %+v, %v; want token %d", key, last, err, tok)
		}
	}
	if last, _ := db.Last(t.Context(), "k1"); last.Owner != "y" {
		t.Errorf("Last(k1).Owner = %q; want y (queue order)", last.Owner)
	}
}

// TestDB_Issue_InlineKeyInFlight checks that an Issue whose key is in flight
// takes no slot, however free: its claim waits, and a committer issues it
// after the batch holding the key.
func TestDB_Issue_InlineKeyInFlight(t *testing.T) {
	t.Parallel()
	db, _ := newDB(t, Options{IssueCommitters: 2})
	s := newStall(t, db, "k")
	k1, k2 := fencing.Claim{Key: "k", Owner: "1"}, fencing.Claim{Key: "k", Owner: "2"}
	r1 := issueAsync(t.Context(), db, k1)
	s.waitHeld(t, "k")
	s.wantQueued(t, k1, 1)
	r2 := issueAsync(t.Context(), db, k2)
	s.wantQueued(t, k2, 1)
	if busy, queued := issuerState(db); busy != 1 || queued != 1 {
		t.Fatalf("with k in flight: %d busy, %d queued; want 1, 1", busy, queued)
	}
	s.release("k")
	wantIssued(t, r1, 1)
	wantIssued(t, r2, 2)
	s.wantBatch(t, byIssue, k1)
	s.wantBatch(t, byCommitter, k2)
}

// TestDB_Issue_InlineCancel checks that a caller whose context ends while it
// runs a batch inline finishes the batch and returns its token.
func TestDB_Issue_InlineCancel(t *testing.T) {
	t.Parallel()
	db, _ := newDB(t, Options{IssueCommitters: 1})
	s := newStall(t, db, "k")
	ctx, cancel := context.WithCancel(t.Context())
	r := issueAsync(ctx, db, fencing.Claim{Key: "k"})
	s.waitHeld(t, "k")
	cancel()
	s.release("k")
	wantIssued(t, r, 1)
	s.wantBatch(t, byIssue, fencing.Claim{Key: "k"})
	if last, err := db.Last(t.Context(), "k"); err != nil || last.Token != 1 {
		t.Errorf("Last(k) = %+v, %v; want token 1", last, err)
	}
}

// TestDB_Issue_InlineClose checks that Close, with an inline batch and a
// committer's batch running, fails queued claims, ends both batches with
// ErrClosed and returns only once both ended.
func TestDB_Issue_InlineClose(t *testing.T) {
	t.Parallel()
	_, url := newDB(t, Options{})
	db := open(t, url, Options{IssueCommitters: 2})
	s := newStall(t, db, "inline", "x", "committed")
	inline := issueAsync(t.Context(), db, fencing.Claim{Key: "inline"})
	s.waitHeld(t, "inline")
	x := issueAsync(t.Context(), db, fencing.Claim{Key: "x"})
	s.waitHeld(t, "x")
	committed := issueAsync(t.Context(), db, fencing.Claim{Key: "committed"})
	s.wantQueued(t, fencing.Claim{Key: "inline"}, 1)
	s.wantQueued(t, fencing.Claim{Key: "x"}, 1)
	s.wantQueued(t, fencing.Claim{Key: "committed"}, 1)
	s.release("x")
	wantIssued(t, x, 1)
	s.waitHeld(t, "committed")
	s.wantBatch(t, byIssue, fencing.Claim{Key: "inline"})
	s.wantBatch(t, byIssue, fencing.Claim{Key: "x"})
	s.wantBatch(t, byCommitter, fencing.Claim{Key: "committed"})
	queued := issueAsync(t.Context(), db, fencing.Claim{Key: "queued"})
	s.wantQueued(t, fencing.Claim{Key: "queued"}, 1)

	closed := make(chan struct{})
	go func() {
		db.Close()
		close(closed)
	}()
	wantClosed := func(r issued) {
		t.Helper()
		if !errors.Is(r.err, ErrClosed) || r.tok != 0 {
			t.Errorf("Issue(%q) across Close = %d, %v; want ErrClosed", r.claim.Key, r.tok, r.err)
		}
	}
	wantClosed(recv(t, queued, "the queued Issue to fail"))
	select {
	case <-closed:
		t.Fatal("Close returned while batches were still running")
	default:
	}
	s.release("inline")
	wantClosed(recv(t, inline, "the inline Issue to fail"))
	s.release("committed")
	wantClosed(recv(t, committed, "the committer's Issue to fail"))
	recv(t, closed, "Close to return")
	_, err := db.Issue(t.Context(), fencing.Claim{Key: "after"})
	wantClosed(issued{claim: fencing.Claim{Key: "after"}, err: err})
}
