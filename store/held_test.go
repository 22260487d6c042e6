package store

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/testutil"
)

// notYet fails the test if ch already has a value: an Issue that must still
// be waiting (on a row held until the test lets it go) returned.
func notYet(t *testing.T, ch <-chan issued, what string) {
	t.Helper()
	select {
	case got := <-ch:
		t.Fatalf("%s returned %d, %v while its row was held", what, got.tok, got.err)
	default:
	}
}

// TestDB_Issue_HeldRowHoldsUpOnlyItsKey: a batch one of whose rows another
// transaction holds (a document's slow write, an outside session) issues
// the other claims, the one of a new key among them, without waiting for
// it; the held claim waits alone and gets its token once the row is free,
// and a later claim for its key stays queued behind it. The issue timeout
// is an hour: were the batch to wait for the row, the others would wait
// until the test gives up.
func TestDB_Issue_HeldRowHoldsUpOnlyItsKey(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{IssueCommitters: 1, IssueTimeout: time.Hour, IssueLockWait: time.Millisecond})
	for _, k := range []string{"a", "b", "c"} {
		issue(t, db, k)
	}
	p := newProbe(t, db)
	row := holdRow(t, url, "a")

	z := holdFirst(t, t.Context(), db, p, "z") // takes the only slot
	var chs []<-chan issued
	for i, k := range []string{"a", "b", "c", "n"} {
		chs = append(chs, issueAsync(t.Context(), db, fencing.Claim{Key: k, Holder: k + "1"}))
		p.waitQueued(t, i+1)
	}
	p.release()
	recv(t, z, "z")
	recv(t, p.batches, "z's batch")
	if got := keysOf(recv(t, p.batches, "the batch of a, b, c, n")); len(got) != 4 {
		t.Fatalf("second batch = %v; want [a b c n]", got)
	}
	for i, want := range map[int]fencing.Token{1: 2, 2: 2, 3: 1} {
		if got := recv(t, chs[i], "the Issue of a free key"); got.err != nil || got.tok != want {
			t.Fatalf("Issue(%s) while a's row is held = %d, %v; want %d", got.claim.Key, got.tok, got.err, want)
		}
	}
	notYet(t, chs[0], "Issue(a)")
	if n := db.issuer.setAsides.Load(); n != 1 {
		t.Errorf("%d claims set aside; want 1 (a's)", n)
	}

	// A later claim for a queues behind the one waiting; other keys go on.
	a2 := issueAsync(t.Context(), db, fencing.Claim{Key: "a", Holder: "a2"})
	if d, err := db.Issue(t.Context(), fencing.Claim{Key: "d"}); err != nil || d != 1 {
		t.Fatalf("Issue(d) while a's row is held = %d, %v; want 1", d, err)
	}
	notYet(t, chs[0], "Issue(a)")
	notYet(t, a2, "the second Issue(a)")

	if err := row.Rollback(t.Context()); err != nil {
		t.Fatal(err)
	}
	if got := recv(t, chs[0], "Issue(a)"); got.err != nil || got.tok != 2 {
		t.Fatalf("Issue(a) once its row is free = %d, %v; want 2", got.tok, got.err)
	}
	if got := recv(t, a2, "the second Issue(a)"); got.err != nil || got.tok != 3 {
		t.Fatalf("second Issue(a) = %d, %v; want 3, after the first", got.tok, got.err)
	}
	if last, err := db.Last(t.Context(), "a"); err != nil || last.Token != 3 || last.Holder != "a2" {
		t.Errorf("newest token of a = %+v, %v; want 3 (holder a2)", last, err)
	}
}

// TestDB_Issue_HeldRowAlone: a lone claim whose row is held frees the only
// committer slot while it waits, so the claims of other keys are issued
// meanwhile.
func TestDB_Issue_HeldRowAlone(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{IssueCommitters: 1, IssueTimeout: time.Hour, IssueLockWait: time.Millisecond})
	issue(t, db, "a")
	row := holdRow(t, url, "a")
	a := issueAsync(t.Context(), db, fencing.Claim{Key: "a"})
	testutil.WaitFor(t, waitTimeout, "a's claim to be set aside", func() (bool, error) {
		return db.issuer.setAsides.Load() == 1, nil
	})
	for _, k := range []string{"x", "y"} {
		if tok, err := db.Issue(t.Context(), fencing.Claim{Key: k}); err != nil || tok != 1 {
			t.Fatalf("Issue(%s) while a's row is held = %d, %v; want 1", k, tok, err)
		}
	}
	notYet(t, a, "Issue(a)")
	if err := row.Rollback(t.Context()); err != nil {
		t.Fatal(err)
	}
	if got := recv(t, a, "Issue(a)"); got.err != nil || got.tok != 2 {
		t.Fatalf("Issue(a) once its row is free = %d, %v; want 2", got.tok, got.err)
	}
}

// TestDB_Issue_HeldRowDeadline: a claim set aside for a held row is not
// issued once its caller's deadline passed, and its caller hears so.
func TestDB_Issue_HeldRowDeadline(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{IssueCommitters: 1, IssueLockWait: time.Millisecond})
	issue(t, db, "a")
	row := holdRow(t, url, "a")
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	if tok, err := db.Issue(ctx, fencing.Claim{Key: "a", Holder: "late"}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Issue(a) with its row held past its deadline = %d, %v; want its deadline's error", tok, err)
	}
	if err := row.Rollback(t.Context()); err != nil {
		t.Fatal(err)
	}
	// The set-aside statement ends by then or soon after, without issuing.
	next := issue(t, db, "a")
	if next != 2 {
		t.Errorf("next token of a = %d; want 2: the claim past its deadline was issued", next)
	}
}

// TestDB_Issue_CloseEndsHeldRowWait: Close ends a claim waiting for a held
// row, which fails with ErrClosed, and waits for it.
func TestDB_Issue_CloseEndsHeldRowWait(t *testing.T) {
	t.Parallel()
	_, url := newDB(t, Options{})
	db := open(t, url, Options{IssueCommitters: 1, IssueTimeout: time.Hour, IssueLockWait: time.Millisecond})
	issue(t, db, "a")
	holdRow(t, url, "a")
	a := issueAsync(t.Context(), db, fencing.Claim{Key: "a"})
	testutil.WaitFor(t, waitTimeout, "a's claim to be set aside", func() (bool, error) {
		return db.issuer.setAsides.Load() == 1, nil
	})
	db.Close()
	if got := recv(t, a, "Issue(a)"); !errors.Is(got.err, ErrClosed) {
		t.Fatalf("Issue(a) after Close = %d, %v; want ErrClosed", got.tok, got.err)
	}
}

// lockWaiters counts the store's sessions (not the test's) waiting for a
// lock.
func lockWaiters(t *testing.T, url string) func() (int, error) {
	conn := connect(t, url)
	return func() (int, error) {
		var n int
		err := conn.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = 'redfence' AND wait_event_type = 'Lock'`).Scan(&n)
		return n, err
	}
}

// TestDB_Issue_HeldRowsLeaveConnections: claims set aside for held rows do
// not take the connections of the locks' pool: with as many rows held as
// the pool has connections, all of them waited for at once, the claims of
// other keys are still issued, and the pool's other users (heartbeats, node
// records, API keys) still get a connection. (A review found it: four slow
// document writes on four names stalled every grant and heartbeat of a
// server with the default pool.)
func TestDB_Issue_HeldRowsLeaveConnections(t *testing.T) {
	t.Parallel()
	const conns = 4 // pgxpool's default on a small host
	db, url := newDB(t, Options{MaxConns: conns, IssueCommitters: 1, IssueTimeout: time.Hour,
		StatementTimeout: time.Hour, IssueLockWait: time.Millisecond})
	keys := []string{"a", "b", "c", "d"}
	var rows []interface{ Rollback(context.Context) error }
	for _, k := range keys {
		issue(t, db, k)
		rows = append(rows, holdRow(t, url, k))
	}
	var chs []<-chan issued
	for _, k := range keys {
		chs = append(chs, issueAsync(t.Context(), db, fencing.Claim{Key: k}))
	}
	testutil.WaitFor(t, waitTimeout, "every claim to be set aside", func() (bool, error) {
		return db.issuer.setAsides.Load() == int64(len(keys)), nil
	})
	waiters := lockWaiters(t, url)
	testutil.WaitFor(t, waitTimeout, "every claim set aside to wait for its row", func() (bool, error) {
		n, err := waiters()
		return n == len(keys), err // at once, each on a connection of the pool kept for them
	})

	ctx, cancel := context.WithTimeout(t.Context(), waitTimeout) // a guard against a hang
	defer cancel()
	if tok, err := db.Issue(ctx, fencing.Claim{Key: "x"}); err != nil || tok != 1 {
		t.Fatalf("Issue(x) while a, b, c and d's rows are held = %d, %v; want 1", tok, err)
	}
	if err := db.Ping(ctx); err != nil {
		t.Fatalf("Ping while a, b, c and d's rows are held: %v", err)
	}
	for i := range chs {
		notYet(t, chs[i], "Issue("+keys[i]+")")
	}
	for _, row := range rows {
		if err := row.Rollback(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	for i, ch := range chs {
		if got := recv(t, ch, "Issue("+keys[i]+")"); got.err != nil || got.tok != 2 {
			t.Fatalf("Issue(%s) once its row is free = %d, %v; want 2", keys[i], got.tok, got.err)
		}
	}
}

// TestDB_Issue_HeldRowCallerLeft: a claim set aside for a held row whose
// caller leaves (no deadline: a cancellation) is not issued once the row
// is free: unlike a batch, its wait serves nobody else.
func TestDB_Issue_HeldRowCallerLeft(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{IssueCommitters: 1, IssueTimeout: time.Hour, IssueLockWait: time.Millisecond})
	issue(t, db, "a")
	row := holdRow(t, url, "a")
	ctx, cancel := context.WithCancel(t.Context())
	a := issueAsync(ctx, db, fencing.Claim{Key: "a", Holder: "gone"})
	testutil.WaitFor(t, waitTimeout, "a's claim to be set aside", func() (bool, error) {
		return db.issuer.setAsides.Load() == 1, nil
	})
	cancel()
	if got := recv(t, a, "Issue(a)"); !errors.Is(got.err, context.Canceled) {
		t.Fatalf("Issue(a) whose caller left = %d, %v; want context.Canceled", got.tok, got.err)
	}
	if err := row.Rollback(t.Context()); err != nil {
		t.Fatal(err)
	}
	// Queued behind the set-aside claim until it ends.
	if next := issue(t, db, "a"); next != 2 {
		t.Errorf("next token of a = %d; want 2: the claim whose caller left was issued", next)
	}
}

// TestDB_Issue_HeldRowCallerLeftCancelLost: a claim set aside for a held
// row whose caller leaves is not issued once the row is free, even when
// the cancel request pgx sends as it gives the connection up does not
// reach Postgres (a network that stalls, a pooler that drops it): the
// statement, already at the server and waiting for the row, must not be
// followed there by its COMMIT. Here the connections go through a proxy
// that, once the claim waits for its row, refuses new connections (the
// cancel request's) and keeps back what the client sends (its Terminate).
func TestDB_Issue_HeldRowCallerLeftCancelLost(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{})
	_, hostPort, _ := strings.Cut(strings.TrimPrefix(url, "postgres://"), "@")
	hostPort, _, _ = strings.Cut(hostPort, "/")
	proxy := newHeldProxy(t, hostPort)
	a := open(t, strings.Replace(url, hostPort, proxy.ln.Addr().String(), 1),
		Options{IssueCommitters: 1, IssueTimeout: time.Hour, IssueLockWait: time.Millisecond})
	issue(t, db, "a")
	row := holdRow(t, url, "a")
	ctx, cancel := context.WithCancel(t.Context())
	ch := issueAsync(ctx, a, fencing.Claim{Key: "a", Holder: "gone"})
	testutil.WaitFor(t, waitTimeout, "a's claim to be set aside", func() (bool, error) {
		return a.issuer.setAsides.Load() == 1, nil
	})
	waiters := lockWaiters(t, url)
	testutil.WaitFor(t, waitTimeout, "the set-aside claim to wait for its row", func() (bool, error) {
		n, err := waiters()
		return n == 1, err
	})
	proxy.hold()
	released := false
	defer func() {
		if !released {
			proxy.release()
		}
	}()
	cancel()
	if got := recv(t, ch, "Issue(a)"); !errors.Is(got.err, context.Canceled) {
		t.Fatalf("Issue(a) whose caller left = %d, %v; want context.Canceled", got.tok, got.err)
	}
	if err := row.Rollback(t.Context()); err != nil {
		t.Fatal(err)
	}
	// The set-aside's session gets the row, and runs what it was sent.
	obs := connect(t, url)
	testutil.WaitFor(t, waitTimeout, "the set-aside's session to run what it was sent", func() (bool, error) {
		var n int
		err := obs.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = 'redfence' AND state = 'active'`).Scan(&n)
		return n == 0, err
	})
	if last, err := db.Last(t.Context(), "a"); err != nil || last.Token != 1 {
		t.Fatalf("newest token of a = %+v, %v; want 1: the claim whose caller left was issued", last, err)
	}
	// Its session's end, once the network delivers it, rolls it back.
	released = true
	proxy.release()
	if next := issue(t, db, "a"); next != 2 {
		t.Errorf("next token of a = %d; want 2", next)
	}
}

// TestDB_Issue_HeldRowOutlastsStatementTimeout: a claim set aside for a
// held row waits for it until its caller's deadline (here the issue
// timeout, an hour), even past the sessions' statement timeout. (Found by
// fault injection: under REDFENCE_ISSUE_TIMEOUT=30s, a grant whose row an
// operator held failed after REDFENCE_STATEMENT_TIMEOUT, 5 s, "canceling
// statement due to statement timeout", where README has it wait up to the
// issue timeout or the lease.)
func TestDB_Issue_HeldRowOutlastsStatementTimeout(t *testing.T) {
	t.Parallel()
	const stmtTimeout = 200 * time.Millisecond
	db, url := newDB(t, Options{IssueCommitters: 1, IssueTimeout: time.Hour, StatementTimeout: stmtTimeout, IssueLockWait: time.Millisecond})
	issue(t, db, "a")
	row := holdRow(t, url, "a")
	a := issueAsync(t.Context(), db, fencing.Claim{Key: "a"})
	waiters := lockWaiters(t, url)
	testutil.WaitFor(t, waitTimeout, "a's claim to be set aside and wait for its row", func() (bool, error) {
		n, err := waiters()
		return n == 1 && db.issuer.setAsides.Load() == 1, err // the batch's statement ended before
	})
	// A witness with the sessions' statement timeout waits for the row
	// since after the claim began to: once it timed out, the claim has
	// waited longer than the statement timeout.
	w := connect(t, url)
	if _, err := w.Exec(t.Context(), fmt.Sprintf("SET statement_timeout = %d", stmtTimeout.Milliseconds())); err != nil {
		t.Fatal(err)
	}
	_, err := w.Exec(t.Context(), `SELECT token FROM redfence_fencing WHERE key = 'a' FOR UPDATE`)
	if pe := (*pgconn.PgError)(nil); !errors.As(err, &pe) || pe.Code != "57014" {
		t.Fatalf("witness waiting for a's row = %v; want a statement timeout (57014)", err)
	}
	notYet(t, a, "Issue(a)")
	if err := row.Rollback(t.Context()); err != nil {
		t.Fatal(err)
	}
	if got := recv(t, a, "Issue(a)"); got.err != nil || got.tok != 2 {
		t.Fatalf("Issue(a) once its row is free, after the statement timeout = %d, %v; want 2", got.tok, got.err)
	}
}
