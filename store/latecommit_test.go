package store

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/internal/testutil"
)

// holdRow locks key's token row in a transaction of its own, as another
// server's issuance or a document write would, until the test rolls it back
// (or ends).
func holdRow(t *testing.T, url, key string) pgx.Tx {
	t.Helper()
	tx, err := connect(t, url).Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback(context.Background()) })
	if _, err := tx.Exec(t.Context(), `SELECT token FROM redfence_fencing WHERE key = $1 FOR UPDATE`, key); err != nil {
		t.Fatal(err)
	}
	return tx
}

// queueBehindHeldRow sets up the scenario of the tests below: a DB with
// one committer whose batches wait for held rows (IssueLockWait) rather
// than set claims aside, a second DB on the same database (another server),
// a's and b's first tokens issued, a's row held by another transaction
// (another server's issuance, a slow document write's COMMIT...), z's
// claim holding the only slot at the probe, and a's claim queued behind it.
// The test queues b's claim next and releases the probe.
func queueBehindHeldRow(t *testing.T) (db, other *DB, p *probe, tx pgx.Tx, z, aCh <-chan issued) {
	t.Helper()
	db, url := newDB(t, Options{IssueCommitters: 1, IssueLockWait: time.Hour})
	other = open(t, url, Options{})
	issue(t, db, "a")
	issue(t, db, "b")
	p = newProbe(t, db)
	tx = holdRow(t, url, "a")
	z = holdFirst(t, t.Context(), db, p, "z") // takes the only slot
	aCh = issueAsync(t.Context(), db, fencing.Claim{Key: "a", Holder: "A"})
	p.waitQueued(t, 1)
	return db, other, p, tx, z, aCh
}

// TestDB_Issue_LateClaimInBatch: a claim whose caller gave up (its lease
// ended) while its batch waited on another key's row is not issued when the
// batch reaches its row later. Committed then, its token would come after
// the one another server issued meanwhile for a newer grant, and fence that
// live holder out. (A review found it: the batch runs until the latest
// deadline of its claims.)
func TestDB_Issue_LateClaimInBatch(t *testing.T) {
	t.Parallel()
	db, other, p, tx, z, aCh := queueBehindHeldRow(t)
	bctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond) // b's lease
	defer cancel()
	bCh := issueAsync(bctx, db, fencing.Claim{Key: "b", Holder: "old"})
	p.waitQueued(t, 2)
	p.release()
	recv(t, z, "z")
	if got := recv(t, p.batches, "z's batch"); len(got) != 1 {
		t.Fatalf("first batch %v", keysOf(got))
	}
	if got := recv(t, p.batches, "a+b batch"); len(got) != 2 {
		t.Fatalf("second batch = %v; want [a b]", keysOf(got))
	}
	if b := recv(t, bCh, "b's Issue"); !errors.Is(b.err, context.DeadlineExceeded) {
		t.Fatalf("b's Issue = %d, %v; want its deadline's error", b.tok, b.err)
	}
	// b's lease is over: another server grants b and issues its token.
	newer, err := other.Issue(t.Context(), fencing.Claim{Key: "b", Holder: "new"})
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(t.Context()); err != nil {
		t.Fatal(err)
	}
	if a := recv(t, aCh, "a's Issue"); a.err != nil || a.tok != 2 {
		t.Fatalf("a's Issue = %d, %v; want 2", a.tok, a.err)
	}
	last, err := db.Last(t.Context(), "b")
	if err != nil {
		t.Fatal(err)
	}
	if last.Token != newer || last.Holder != "new" {
		t.Errorf("newest token of b = %d (holder %q); want %d, the live grant's (holder \"new\"): the abandoned claim was issued after it",
			last.Token, last.Holder, newer)
	}
}

// TestDB_Issue_CallerLeftInBatch: a caller that leaves (its context
// cancelled, its deadline still ahead) after a batch took its claim, while
// the batch waits for another key's row, does not get Issue back before the
// batch's outcome: once Issue returns, its server frees the name, and
// another server's grant of it would then be issued a token that this
// claim's, issued when the batch goes on, fences out. (Found by fault
// injection: with clients leaving mid-acquire, a holder granted through one
// server got 409 stale-token on its first write; the token after its own
// had been committed on the other server for an acquire whose client had
// left, whose lease that server had deleted at once.)
func TestDB_Issue_CallerLeftInBatch(t *testing.T) {
	t.Parallel()
	db, other, p, tx, z, aCh := queueBehindHeldRow(t)
	bctx, leave := context.WithCancel(t.Context()) // its lease runs on
	bCh := issueAsync(bctx, db, fencing.Claim{Key: "b", Holder: "left"})
	p.waitQueued(t, 2)
	p.release()
	recv(t, z, "z")
	recv(t, p.batches, "z's batch")
	if got := recv(t, p.batches, "a+b batch"); len(got) != 2 {
		t.Fatalf("second batch = %v; want [a b]", keysOf(got))
	}
	leave()
	var early *issued
	testutil.WaitFor(t, waitTimeout, "b's Issue to return or to wait for its batch", func() (bool, error) {
		select {
		case got := <-bCh:
			early = &got
			return true, nil
		default:
		}
		return db.issuer.leftWaits.Load() == 1, nil
	})
	if early != nil {
		// Its server frees b, and another server grants it.
		newer, err := other.Issue(t.Context(), fencing.Claim{Key: "b", Holder: "next"})
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.Rollback(t.Context()); err != nil {
			t.Fatal(err)
		}
		recv(t, aCh, "a's Issue") // the batch's statement ended
		last, err := db.Last(t.Context(), "b")
		t.Fatalf("Issue(b) returned %d, %v while its batch could still issue it; another server then issued %d, and the newest token of b is %+v, %v",
			early.tok, early.err, newer, last, err)
	}
	if err := tx.Rollback(t.Context()); err != nil {
		t.Fatal(err)
	}
	if a := recv(t, aCh, "a's Issue"); a.err != nil || a.tok != 2 {
		t.Fatalf("a's Issue = %d, %v; want 2", a.tok, a.err)
	}
	// b's token was issued for a caller that left: it is burned, and the
	// next grant's comes after it.
	if b := recv(t, bCh, "b's Issue"); b.err != nil || b.tok != 2 {
		t.Fatalf("b's Issue = %d, %v; want 2, the batch's outcome (burned: its caller left)", b.tok, b.err)
	}
	newer, err := other.Issue(t.Context(), fencing.Claim{Key: "b", Holder: "next"})
	if err != nil || newer != 3 {
		t.Fatalf("next token of b = %d, %v; want 3", newer, err)
	}
	wantLast(t, db, "b", 3, "", "next")
}

// runBatch runs batch's statement, in a goroutine, with a context that
// outlasts the test's waits: Postgres, not the client, has to refuse a claim
// whose deadline passed (as it must when another claim of the batch holds
// it open, or when the client's cancel does not reach Postgres).
func runBatch(t *testing.T, db *DB, batch ...*issueReq) <-chan []issueResult {
	ch := make(chan []issueResult, 1)
	go func() {
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute) // a batch always has a deadline
		defer cancel()
		ch <- db.issuer.exec(ctx, batch, false)
	}()
	return ch
}

// claim is a queued claim for key with ctx.
func claim(ctx context.Context, key, holder string) *issueReq {
	return &issueReq{ctx: ctx, claim: fencing.Claim{Key: key, Holder: holder}, done: make(chan issueResult, 1)}
}

// TestDB_Issue_LateClaimAlone: a statement that waited on its row past its
// claim's deadline issues nothing when the row frees up, although Postgres
// went on with it (its client's context was not what ended it).
func TestDB_Issue_LateClaimAlone(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{})
	issue(t, db, "b")
	tx := holdRow(t, url, "b")
	ctx, cancel := context.WithTimeout(t.Context(), time.Second) // the claim's lease
	defer cancel()
	res := runBatch(t, db, claim(ctx, "b", "late"))
	obs := connect(t, url)
	testutil.WaitFor(t, waitTimeout, "the issuance to wait on the row lock", func() (bool, error) {
		n, err := blockedBy(t.Context(), obs, tx.Conn().PgConn().PID())
		return n > 0, err
	})
	<-ctx.Done() // its lease is over
	if err := tx.Rollback(t.Context()); err != nil {
		t.Fatal(err)
	}
	if r := recv(t, res, "the batch")[0]; !errors.Is(r.err, errLate) {
		t.Errorf("the claim's result = %d, %v; want errLate", r.tok, r.err)
	}
	if last, err := db.Last(t.Context(), "b"); err != nil || last.Token != 1 {
		t.Fatalf("Last(b) = %+v, %v; want token 1: nothing issued for the claim whose lease ended", last, err)
	}
}

// TestDB_Issue_LateClaimAfterParseLag: the claim's deadline holds however
// long the statement took to get going, not only while it waits on a row:
// here its Parse waits on a table lock (as an ALTER TABLE, a migration or a
// non-concurrent CREATE INDEX would take; a slow network or a starved
// backend delays it too) past the deadline of claim b; then the batch waits
// on a's row while another server issues b. b's claim must not be issued
// after that newer token. (A review found the deadline counted from the
// statement's start.)
func TestDB_Issue_LateClaimAfterParseLag(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{IssueCommitters: 1})
	other := open(t, url, Options{})
	issue(t, db, "a")
	issue(t, db, "b")
	row := holdRow(t, url, "a")
	table, err := connect(t, url).Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer table.Rollback(context.Background())
	if _, err := table.Exec(t.Context(), `LOCK TABLE redfence_fencing IN SHARE MODE`); err != nil {
		t.Fatal(err)
	}
	bctx, cancel := context.WithTimeout(t.Context(), time.Second) // b's lease
	defer cancel()
	res := runBatch(t, db, claim(t.Context(), "a", "A"), claim(bctx, "b", "old"))
	obs := connect(t, url)
	testutil.WaitFor(t, waitTimeout, "the batch to wait on the table lock", func() (bool, error) {
		n, err := blockedBy(t.Context(), obs, table.Conn().PgConn().PID())
		return n > 0, err
	})
	<-bctx.Done() // b's lease is over
	if err := table.Commit(t.Context()); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, waitTimeout, "the batch to wait on a's row", func() (bool, error) {
		n, err := blockedBy(t.Context(), obs, row.Conn().PgConn().PID())
		return n > 0, err
	})
	newer, err := other.Issue(t.Context(), fencing.Claim{Key: "b", Holder: "new"}) // another server grants b
	if err != nil {
		t.Fatal(err)
	}
	if err := row.Rollback(t.Context()); err != nil {
		t.Fatal(err)
	}
	got := recv(t, res, "the batch")
	if got[0].err != nil || got[0].tok != 2 || !errors.Is(got[1].err, errLate) {
		t.Errorf("batch results a = %d, %v; b = %d, %v; want a 2, b errLate", got[0].tok, got[0].err, got[1].tok, got[1].err)
	}
	if last, err := db.Last(t.Context(), "b"); err != nil || last.Token != newer || last.Holder != "new" {
		t.Errorf("newest token of b = %+v, %v; want %d (holder \"new\"): the claim whose lease ended was issued after it", last, err, newer)
	}
}

// TestDB_Issue_IdleInTransactionRetried: an issuance whose statement came
// so long after its BEGIN (a pause of the process) that Postgres ended the
// idle session (25P03) ran nothing, and is sent again on another
// connection rather than failing.
func TestDB_Issue_IdleInTransactionRetried(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{MaxConns: 2, StatementTimeout: 300 * time.Millisecond})
	issue(t, db, "k")
	obs := connect(t, url)
	idle := func() (int, error) {
		var n int
		err := obs.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND state = 'idle in transaction'`).Scan(&n)
		return n, err
	}
	attempts := 0
	var tok int64
	err := retryPooled(db.pool, func() error {
		attempts++
		return issueTx(t.Context(), db.pool, "BEGIN", issueCommit, issueSQL, func(time.Time) []any {
			if attempts == 1 {
				// Paused after BEGIN until Postgres ends the session.
				testutil.WaitFor(t, waitTimeout, "the session idle in its transaction", func() (bool, error) {
					n, err := idle()
					return n == 1, err
				})
				testutil.WaitFor(t, waitTimeout, "Postgres to end the idle session", func() (bool, error) {
					n, err := idle()
					return n == 0, err
				})
			}
			return []any{"k", "", "h", time.Minute.Microseconds()}
		}, func(rows pgx.Rows) error {
			_, err := pgx.ForEachRow(rows, []any{&tok}, func() error { return nil })
			return err
		})
	})
	if err != nil || attempts != 2 || tok != 2 {
		t.Fatalf("issuance after the idle session was ended = token %d, %v, in %d attempts; want 2, nil, in 2", tok, err, attempts)
	}
}

// TestDB_Issue_IdleSessionEndedRetried: a pooled connection whose session
// Postgres ended for idling (idle_session_timeout, 57P05) ran nothing of
// the statement sent on it next, which is sent again on another connection
// rather than failing.
func TestDB_Issue_IdleSessionEndedRetried(t *testing.T) {
	t.Parallel()
	url := clustertest.Database(t)
	obs := connect(t, url)
	var dbname string
	if err := obs.QueryRow(t.Context(), "SELECT current_database()").Scan(&dbname); err != nil {
		t.Fatal(err)
	}
	db := open(t, url, Options{MaxConns: 2})
	if _, err := db.Migrate(t.Context()); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	if _, err := obs.Exec(t.Context(), fmt.Sprintf("ALTER DATABASE %s SET idle_session_timeout = '200ms'", pgx.Identifier{dbname}.Sanitize())); err != nil {
		t.Fatal(err)
	}
	db.pool.Reset() // new sessions take the setting
	sessions := func() (int, error) {
		var n int
		err := obs.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name <> 'store_test' AND backend_type = 'client backend'`).Scan(&n)
		return n, err
	}
	for i := range 3 {
		testutil.WaitFor(t, waitTimeout, "Postgres to end the pool's idle sessions", func() (bool, error) {
			n, err := sessions()
			return n == 0, err
		})
		if tok := issue(t, db, "k"); tok != fencing.Token(i+1) {
			t.Fatalf("issuance %d after the idle sessions were ended = %d; want %d", i+1, tok, i+1)
		}
	}
}
