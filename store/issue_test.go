package store

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/testutil"
)

// probe watches a DB's issuance through its hooks and holds the first batch
// (before its statement runs) until release is called.
type probe struct {
	// queued receives each queued claim with the queue length then.
	queued chan queuedClaim
	// batches receives the claims of each batch, in statement order.
	batches chan []fencing.Claim
	// held is closed once the first batch is being held.
	held    chan struct{}
	release func()
}

type queuedClaim struct {
	claim fencing.Claim
	n     int
}

// newProbe installs a probe on db, which must not have issued yet. The held
// batch is released at the latest when the test ends (before db closes).
func newProbe(t *testing.T, db *DB) *probe {
	t.Helper()
	p := &probe{
		queued:  make(chan queuedClaim, 1024),
		batches: make(chan []fencing.Claim, 1024),
		held:    make(chan struct{}),
	}
	gate := make(chan struct{})
	var once sync.Once
	p.release = func() { once.Do(func() { close(gate) }) }
	t.Cleanup(p.release)
	var first atomic.Bool
	db.issuer.hooks = issueHooks{
		enqueued: func(c fencing.Claim, n int) { p.queued <- queuedClaim{c, n} },
		batch: func(claims []fencing.Claim) {
			p.batches <- claims
			if first.CompareAndSwap(false, true) {
				close(p.held)
				<-gate
			}
		},
	}
	return p
}

// recv returns the next value from ch, failing the test if none comes within
// waitTimeout (a guard against hangs, not a timing assertion).
func recv[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(waitTimeout):
		t.Fatalf("gave up waiting for %s after %v", what, waitTimeout)
		panic("unreachable")
	}
}

// waitQueued waits until the probe saw a claim queued with the queue at n.
func (p *probe) waitQueued(t *testing.T, n int) {
	t.Helper()
	for {
		if q := recv(t, p.queued, fmt.Sprintf("%d queued claims", n)); q.n == n {
			return
		}
	}
}

// issued is the outcome of one Issue call.
type issued struct {
	claim fencing.Claim
	tok   fencing.Token
	err   error
}

// issueAsync calls Issue in a goroutine and returns where its outcome goes.
func issueAsync(ctx context.Context, db *DB, c fencing.Claim) <-chan issued {
	ch := make(chan issued, 1)
	go func() {
		tok, err := db.Issue(ctx, c)
		ch <- issued{c, tok, err}
	}()
	return ch
}

// holdFirst starts an Issue for key and waits until its batch is held.
func holdFirst(t *testing.T, ctx context.Context, db *DB, p *probe, key string) <-chan issued {
	t.Helper()
	ch := issueAsync(ctx, db, fencing.Claim{Key: key})
	recv(t, p.held, "the first batch to be held")
	recv(t, p.queued, "the first claim to be queued")
	return ch
}

// keysOf returns the keys of claims.
func keysOf(claims []fencing.Claim) []string {
	keys := make([]string, len(claims))
	for i, c := range claims {
		keys[i] = c.Key
	}
	return keys
}

// TestDB_Issue_ConcurrentKeys issues from many goroutines on a few keys,
// through two DBs sharing the database (as two servers would): per key the
// tokens are exactly 1..n, every token is committed (visible to Last) by the
// time Issue returns it, and overlapping batches never deadlock.
func TestDB_Issue_ConcurrentKeys(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{})
	dbs := []*DB{db, open(t, url, Options{})}
	const (
		keys       = 4
		goroutines = 64
		each       = 10
	)
	tokens := make([][]fencing.Token, keys)
	var mu sync.Mutex
	errs := make(chan error, goroutines*each)
	var wg sync.WaitGroup
	for g := range goroutines {
		db := dbs[g%len(dbs)]
		wg.Go(func() {
			for i := range each {
				k := (g + i) % keys
				key := fmt.Sprintf("k%d", k)
				tok, err := db.Issue(t.Context(), fencing.Claim{Key: key, Owner: fmt.Sprintf("g%d-%d", g, i)})
				if err != nil {
					errs <- fmt.Errorf("Issue(%q): %w", key, err)
					return
				}
				last, err := db.Last(t.Context(), key)
				if err != nil {
					errs <- fmt.Errorf("Last(%q): %w", key, err)
					return
				}
				if last.Token < tok {
					errs <- fmt.Errorf("Issue(%q) returned %d but the committed token is %d", key, tok, last.Token)
				}
				mu.Lock()
				tokens[k] = append(tokens[k], tok)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		t.FailNow()
	}
	for k, toks := range tokens {
		slices.Sort(toks)
		for i, tok := range toks {
			if tok != fencing.Token(i+1) {
				t.Fatalf("key k%d: sorted tokens[%d] = %d; want %d (tokens: %v)", k, i, tok, i+1, toks)
			}
		}
		key := fmt.Sprintf("k%d", k)
		last, err := db.Last(t.Context(), key)
		if err != nil {
			t.Fatal(err)
		}
		if last.Token != fencing.Token(len(toks)) {
			t.Errorf("Last(%q).Token = %d; want %d", key, last.Token, len(toks))
		}
	}
	var st, cl int64
	for _, db := range dbs {
		st += db.issuer.statements.Load()
		cl += db.issuer.claims.Load()
	}
	if cl != goroutines*each {
		t.Errorf("claims served = %d; want %d", cl, goroutines*each)
	}
	t.Logf("%d claims in %d statements", cl, st)
}

// TestDB_Issue_Batches checks that claims queued while the only slot is busy
// share one statement, whose keys are sorted.
func TestDB_Issue_Batches(t *testing.T) {
	t.Parallel()
	db, _ := newDB(t, Options{IssueCommitters: 1})
	p := newProbe(t, db)
	first := holdFirst(t, t.Context(), db, p, "first")

	const n = 50
	results := make([]<-chan issued, n)
	for i := range n {
		// Keys out of order, so the batch has to sort them.
		results[i] = issueAsync(t.Context(), db, fencing.Claim{Key: fmt.Sprintf("k%02d", (i*7)%n)})
	}
	p.waitQueued(t, n)
	if got := db.issuer.statements.Load(); got != 0 {
		t.Fatalf("statements before release = %d; want 0", got)
	}
	p.release()

	if r := recv(t, first, "the first Issue"); r.err != nil || r.tok != 1 {
		t.Fatalf("Issue(first) = %d, %v; want 1", r.tok, r.err)
	}
	for i, ch := range results {
		if r := recv(t, ch, "an Issue"); r.err != nil || r.tok != 1 {
			t.Errorf("Issue #%d (%q) = %d, %v; want 1", i, r.claim.Key, r.tok, r.err)
		}
	}
	if b := recv(t, p.batches, "the first batch"); !slices.Equal(keysOf(b), []string{"first"}) {
		t.Errorf("first batch = %v; want [first]", keysOf(b))
	}
	b := recv(t, p.batches, "the second batch")
	if len(b) != n || !slices.IsSorted(keysOf(b)) {
		t.Errorf("second batch = %v; want all %d keys, sorted", keysOf(b), n)
	}
	if st, cl := db.issuer.statements.Load(), db.issuer.claims.Load(); st != 2 || cl != n+1 {
		t.Errorf("statements, claims = %d, %d; want 2, %d", st, cl, n+1)
	}
	for i := range n {
		key := fmt.Sprintf("k%02d", i)
		if last, err := db.Last(t.Context(), key); err != nil || last.Token != 1 {
			t.Errorf("Last(%q) = %+v, %v; want token 1", key, last, err)
		}
	}
}

// TestDB_Issue_BatchMax checks that a batch takes at most IssueBatchMax
// claims and the rest go in the next one.
func TestDB_Issue_BatchMax(t *testing.T) {
	t.Parallel()
	db, _ := newDB(t, Options{IssueCommitters: 1, IssueBatchMax: 3})
	p := newProbe(t, db)
	first := holdFirst(t, t.Context(), db, p, "first")
	var results []<-chan issued
	for i := range 5 {
		results = append(results, issueAsync(t.Context(), db, fencing.Claim{Key: fmt.Sprint("k", i)}))
		p.waitQueued(t, i+1)
	}
	p.release()
	for _, ch := range append(results, first) {
		if r := recv(t, ch, "an Issue"); r.err != nil || r.tok != 1 {
			t.Errorf("Issue(%q) = %d, %v; want 1", r.claim.Key, r.tok, r.err)
		}
	}
	recv(t, p.batches, "the first batch")
	for _, want := range [][]string{{"k0", "k1", "k2"}, {"k3", "k4"}} {
		if got := keysOf(recv(t, p.batches, "a batch")); !slices.Equal(got, want) {
			t.Errorf("batch = %v; want %v", got, want)
		}
	}
}

// TestDB_Issue_DuplicateKeys checks that a key goes at most once in a batch
// and that its claims are issued in the order they were queued.
func TestDB_Issue_DuplicateKeys(t *testing.T) {
	t.Parallel()
	db, _ := newDB(t, Options{IssueCommitters: 1})
	p := newProbe(t, db)
	first := holdFirst(t, t.Context(), db, p, "first")

	claims := []fencing.Claim{
		{Key: "k", Owner: "a"}, {Key: "k", Owner: "b"}, {Key: "j", Owner: "a"}, {Key: "k", Owner: "c"},
	}
	results := make([]<-chan issued, len(claims))
	for i, c := range claims {
		results[i] = issueAsync(t.Context(), db, c)
		p.waitQueued(t, i+1) // fix the queue order
	}
	p.release()
	recv(t, first, "the first Issue")

	want := []fencing.Token{1, 2, 1, 3}
	for i, ch := range results {
		if r := recv(t, ch, "an Issue"); r.err != nil || r.tok != want[i] {
			t.Errorf("Issue(%+v) = %d, %v; want %d", r.claim, r.tok, r.err, want[i])
		}
	}
	recv(t, p.batches, "the first batch")
	for _, want := range [][]fencing.Claim{
		{{Key: "j", Owner: "a"}, {Key: "k", Owner: "a"}},
		{{Key: "k", Owner: "b"}},
		{{Key: "k", Owner: "c"}},
	} {
		if got := recv(t, p.batches, "a batch"); !slices.Equal(got, want) {
			t.Errorf("batch = %+v; want %+v", got, want)
		}
	}
	if last, err := db.Last(t.Context(), "k"); err != nil || last.Token != 3 || last.Owner != "c" {
		t.Errorf("Last(k) = %+v, %v; want token 3 by c", last, err)
	}
}

// TestDB_Issue_KeyOrderAcrossCommitters checks that claims for one key are
// issued in the order they were queued, even with several committers free to
// take them.
func TestDB_Issue_KeyOrderAcrossCommitters(t *testing.T) {
	t.Parallel()
	db, _ := newDB(t, Options{IssueCommitters: 4})
	queued := make(chan string, 1)
	db.issuer.hooks.enqueued = func(c fencing.Claim, _ int) { queued <- c.Owner }
	const n = 40
	results := make([]<-chan issued, n)
	for i := range n {
		owner := fmt.Sprint(i)
		results[i] = issueAsync(t.Context(), db, fencing.Claim{Key: "k", Owner: owner})
		if got := recv(t, queued, "a claim to be queued"); got != owner {
			t.Fatalf("queued claim of %q; want %q", got, owner)
		}
	}
	for i, ch := range results {
		if r := recv(t, ch, "an Issue"); r.err != nil || r.tok != fencing.Token(i+1) {
			t.Errorf("Issue(%+v) = %d, %v; want %d (queue order)", r.claim, r.tok, r.err, i+1)
		}
	}
}

// TestDB_Issue_Cancel checks that a caller waiting on a committer whose
// context is cancelled returns at once if its claim is queued (the claim is
// then dropped), while one whose claim a running batch took waits for that
// batch, which still commits it (its token burned): its caller must not
// free its name before (see TestDB_Issue_CallerLeftInBatch). (A caller
// running its batch inline stays to the end: see TestDB_Issue_InlineCancel.)
func TestDB_Issue_Cancel(t *testing.T) {
	t.Parallel()
	db, _ := newDB(t, Options{IssueCommitters: 1})
	s := newStall(t, db, "blocker", "running")
	// The blocker holds the one slot inline, so "running" queues and a
	// committer takes it once the blocker is done.
	blocker := issueAsync(t.Context(), db, fencing.Claim{Key: "blocker"})
	s.waitHeld(t, "blocker")
	s.wantQueued(t, fencing.Claim{Key: "blocker"}, 1)
	runningCtx, cancelRunning := context.WithCancel(t.Context())
	running := issueAsync(runningCtx, db, fencing.Claim{Key: "running"})
	s.wantQueued(t, fencing.Claim{Key: "running"}, 1)
	s.release("blocker")
	recv(t, blocker, "the blocker's Issue")
	s.waitHeld(t, "running")
	s.wantBatch(t, byIssue, fencing.Claim{Key: "blocker"})
	s.wantBatch(t, byCommitter, fencing.Claim{Key: "running"})

	queuedCtx, cancelQueued := context.WithCancel(t.Context())
	queued := issueAsync(queuedCtx, db, fencing.Claim{Key: "queued"})
	s.wantQueued(t, fencing.Claim{Key: "queued"}, 1)

	// The queued one returns while the batch is still held; the running
	// one waits for its batch.
	cancelQueued()
	cancelRunning()
	if r := recv(t, queued, "the cancelled queued Issue to return"); !errors.Is(r.err, context.Canceled) || r.tok != 0 {
		t.Errorf("cancelled Issue(%q) = %d, %v; want context.Canceled", r.claim.Key, r.tok, r.err)
	}
	// A context that ended before the call fails without queueing.
	if tok, err := db.Issue(queuedCtx, fencing.Claim{Key: "queued"}); !errors.Is(err, context.Canceled) {
		t.Errorf("Issue(cancelled context) = %d, %v; want context.Canceled", tok, err)
	}
	testutil.WaitFor(t, waitTimeout, "the cancelled running Issue to wait for its batch", func() (bool, error) {
		return db.issuer.leftWaits.Load() == 1, nil
	})
	notYet(t, running, "the cancelled Issue(running)")

	s.release("running")
	// The running batch committed token 1 of "running", which its Issue
	// returns (burned: its caller left); the queued claim was dropped.
	if r := recv(t, running, "the cancelled running Issue to return"); r.err != nil || r.tok != 1 {
		t.Errorf("cancelled Issue(running) = %d, %v; want 1, its batch's outcome", r.tok, r.err)
	}
	if tok := issue(t, db, "running"); tok != 2 {
		t.Errorf("Issue(running) after the cancelled one = %d; want 2 (1 was issued to the caller that left)", tok)
	}
	if tok := issue(t, db, "queued"); tok != 1 {
		t.Errorf("Issue(queued) after the cancelled one = %d; want 1 (the cancelled claim was never issued)", tok)
	}
}

// TestDB_Issue_Close checks that Close fails queued and running claims with
// ErrClosed, waits for the running batch (here inline) and the committers,
// and that Issue fails after it.
func TestDB_Issue_Close(t *testing.T) {
	t.Parallel()
	_, url := newDB(t, Options{})
	db := open(t, url, Options{IssueCommitters: 1})
	p := newProbe(t, db)
	running := holdFirst(t, t.Context(), db, p, "running")
	var queued []<-chan issued
	for i := range 3 {
		queued = append(queued, issueAsync(t.Context(), db, fencing.Claim{Key: fmt.Sprint("k", i)}))
		p.waitQueued(t, i+1)
	}

	closed := make(chan struct{})
	go func() {
		db.Close()
		close(closed)
	}()
	wantClosed := func(r issued) {
		t.Helper()
		if !errors.Is(r.err, ErrClosed) || !errors.Is(r.err, ErrUnavailable) || r.tok != 0 {
			t.Errorf("Issue(%q) across Close = %d, %v; want ErrClosed", r.claim.Key, r.tok, r.err)
		}
		if r.err != nil && !strings.Contains(r.err.Error(), fmt.Sprintf("%q", r.claim.Key)) {
			t.Errorf("Issue(%q) error %q does not name the key", r.claim.Key, r.err)
		}
	}
	// Queued claims fail while the running batch is still held.
	for _, ch := range queued {
		wantClosed(recv(t, ch, "a queued Issue to fail"))
	}
	select {
	case <-closed:
		t.Fatal("Close returned while a committer was still running")
	default:
	}
	p.release()
	wantClosed(recv(t, running, "the running Issue to fail"))
	recv(t, closed, "Close to return") // the committers returned
	_, err := db.Issue(t.Context(), fencing.Claim{Key: "after"})
	wantClosed(issued{claim: fencing.Claim{Key: "after"}, err: err})
	db.Close() // again: no effect
}

// TestDB_Issue_BatchFailure checks that a failed statement fails every claim
// of its batch, each with its key and a sentinel for errors.Is.
func TestDB_Issue_BatchFailure(t *testing.T) {
	t.Parallel()
	db, _ := newDB(t, Options{IssueCommitters: 1})
	p := newProbe(t, db)
	first := holdFirst(t, t.Context(), db, p, "first")
	results := []<-chan issued{first}
	for i := range 3 {
		results = append(results, issueAsync(t.Context(), db, fencing.Claim{Key: fmt.Sprint("k", i)}))
		p.waitQueued(t, i+1)
	}
	db.pool.Close() // Postgres is out of reach from now on
	p.release()
	for _, ch := range results {
		r := recv(t, ch, "an Issue to fail")
		if !errors.Is(r.err, ErrUnavailable) || errors.Is(r.err, ErrClosed) || r.tok != 0 {
			t.Errorf("Issue(%q) with the pool closed = %d, %v; want ErrUnavailable (not ErrClosed)", r.claim.Key, r.tok, r.err)
		}
		if r.err != nil && !strings.Contains(r.err.Error(), fmt.Sprintf("store: issue token for %q", r.claim.Key)) {
			t.Errorf("Issue(%q) error %q does not name the key", r.claim.Key, r.err)
		}
	}
	recv(t, p.batches, "the first batch")
	if b := recv(t, p.batches, "the second batch"); len(b) != 3 {
		t.Errorf("second batch = %v; want the 3 queued claims", keysOf(b))
	}
	if st := db.issuer.statements.Load(); st != 2 {
		t.Errorf("statements = %d; want 2", st)
	}
}

// TestDB_Issue_InvalidClaim checks that a claim Postgres refuses fails alone
// with ErrInvalidData, while the others of its batch get their tokens.
func TestDB_Issue_InvalidClaim(t *testing.T) {
	t.Parallel()
	db, _ := newDB(t, Options{IssueCommitters: 1})
	p := newProbe(t, db)
	first := holdFirst(t, t.Context(), db, p, "first")
	claims := []fencing.Claim{{Key: "a"}, {Key: "b", Owner: "nul \x00 inside"}, {Key: "c"}}
	var results []<-chan issued
	for i, c := range claims {
		results = append(results, issueAsync(t.Context(), db, c))
		p.waitQueued(t, i+1)
	}
	p.release()
	recv(t, first, "the first Issue")
	for _, ch := range results {
		r := recv(t, ch, "an Issue")
		if r.claim.Key == "b" {
			if !errors.Is(r.err, ErrInvalidData) || errors.Is(r.err, ErrUnavailable) {
				t.Errorf("Issue(%+v) = %d, %v; want ErrInvalidData only", r.claim, r.tok, r.err)
			}
			continue
		}
		if r.err != nil || r.tok != 1 {
			t.Errorf("Issue(%q) = %d, %v; want 1", r.claim.Key, r.tok, r.err)
		}
	}
	recv(t, p.batches, "the first batch")
	if b := recv(t, p.batches, "the second batch"); len(b) != 3 {
		t.Errorf("second batch = %v; want the 3 queued claims", keysOf(b))
	}
	if last, err := db.Last(t.Context(), "b"); err != nil || last.Token != 0 {
		t.Errorf("Last(b) = %+v, %v; want nothing issued", last, err)
	}
}

// TestDB_Issue_TokenMax checks that fencing tokens stop at 2^53-1 (which
// every JSON parser holds exactly): the claim past it fails alone with
// ErrTokensExhausted, while the others of its batch get their tokens.
func TestDB_Issue_TokenMax(t *testing.T) {
	t.Parallel()
	db, _ := newDB(t, Options{IssueCommitters: 1})
	const max = 1<<53 - 1
	if _, err := db.pool.Exec(t.Context(), `INSERT INTO redfence_fencing (key, token) VALUES ('full', $1)`, max-1); err != nil {
		t.Fatal(err)
	}
	if tok, err := db.Issue(t.Context(), fencing.Claim{Key: "full"}); err != nil || tok != max {
		t.Fatalf("Issue up to 2^53-1 = %d, %v; want %d", tok, err, int64(max))
	}
	p := newProbe(t, db)
	first := holdFirst(t, t.Context(), db, p, "first")
	var results []<-chan issued
	for i, key := range []string{"a", "full", "c"} {
		results = append(results, issueAsync(t.Context(), db, fencing.Claim{Key: key}))
		p.waitQueued(t, i+1)
	}
	p.release()
	recv(t, first, "the first Issue")
	for _, ch := range results {
		r := recv(t, ch, "an Issue")
		if r.claim.Key == "full" {
			if !errors.Is(r.err, ErrTokensExhausted) || !errors.Is(r.err, ErrUnavailable) || r.tok != 0 {
				t.Errorf("Issue past 2^53-1 = %d, %v; want ErrTokensExhausted (and ErrUnavailable)", r.tok, r.err)
			}
			continue
		}
		if r.err != nil || r.tok != 1 {
			t.Errorf("Issue(%q) beside the exhausted name = %d, %v; want 1", r.claim.Key, r.tok, r.err)
		}
	}
	if last, err := db.Last(t.Context(), "full"); err != nil || last.Token != max {
		t.Errorf("Last(full) = %+v, %v; want %d", last, err, int64(max))
	}
}
