package store

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/redfence/redfence/fencing"
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

// TestDB_Issue_LateClaimInBatch: a claim whose caller gave up (its lease
// ended) while its batch waited on another key's row is not issued when the
// batch reaches its row later. Committed then, its token would come after
// the one another server issued meanwhile for a newer grant, and fence that
// live holder out. (A review found it: the batch runs until the latest
// deadline of its claims.)
func TestDB_Issue_LateClaimInBatch(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{IssueCommitters: 1})
	other := open(t, url, Options{}) // a second server on the same database
	issue(t, db, "a")
	issue(t, db, "b")

	p := newProbe(t, db)
	// Something else holds a's row for a while (another server's issuance
	// for a, a document write whose COMMIT is slow...).
	tx := holdRow(t, url, "a")

	z := holdFirst(t, t.Context(), db, p, "z") // takes the only slot
	aCh := issueAsync(t.Context(), db, fencing.Claim{Key: "a", Holder: "A"})
	p.waitQueued(t, 1)
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

// TestDB_Issue_LateClaimAlone: a statement that waited on its row past its
// caller's deadline issues nothing when the row frees up, although its
// client stopped waiting and Postgres went on with it.
func TestDB_Issue_LateClaimAlone(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{})
	issue(t, db, "b")
	tx := holdRow(t, url, "b")
	conn := tx.Conn()
	// The claim's lease: long enough for its statement to reach the row.
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	defer cancel()
	ch := issueAsync(ctx, db, fencing.Claim{Key: "b", Holder: "late"})
	obs := connect(t, url)
	testutil.WaitFor(t, waitTimeout, "the issuance to wait on the row lock", func() (bool, error) {
		n, err := blockedBy(t.Context(), obs, conn.PgConn().PID())
		return n > 0, err
	})
	// The caller leaves while its statement waits (its lease is over).
	if r := recv(t, ch, "the Issue"); !errors.Is(r.err, context.DeadlineExceeded) {
		t.Fatalf("Issue = %d, %v; want its deadline's error", r.tok, r.err)
	}
	// The row frees up once the statement has waited longer than the
	// caller's whole lease, by Postgres' clock (the budget counts from the
	// statement's arrival).
	testutil.WaitFor(t, waitTimeout, "the statement to wait past its budget", func() (bool, error) {
		var n int
		err := obs.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
			WHERE $1::int = ANY(pg_blocking_pids(pid)) AND clock_timestamp() - query_start <= interval '2 s'`,
			int64(conn.PgConn().PID())).Scan(&n)
		return n == 0, err
	})
	if err := tx.Rollback(t.Context()); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, waitTimeout, "the issuance statement to end", func() (bool, error) {
		var n int
		err := obs.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
			WHERE state <> 'idle' AND pid <> pg_backend_pid() AND position('redfence_fencing AS f' in query) > 0`).Scan(&n)
		return n == 0, err
	})
	if last, err := db.Last(t.Context(), "b"); err != nil || last.Token != 1 {
		t.Fatalf("Last(b) = %+v, %v; want token 1: nothing issued for the claim whose caller left", last, err)
	}
}
