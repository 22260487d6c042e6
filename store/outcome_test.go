package store

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/redfence/redfence/internal/testutil"
)

// busyDocSessions counts the documents' sessions of the database that are
// not idle (a statement running, or a transaction open).
func busyDocSessions(t *testing.T, url string) func() (bool, error) {
	obs := connect(t, url)
	return func() (bool, error) {
		var n int
		err := obs.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend' AND state <> 'idle'`).Scan(&n)
		return n == 0, err
	}
}

// TestDB_PutResource_OutcomeUnknownOnlyOnceCommitSent: a write that failed
// before its COMMIT was sent (here, its statement waited for the document's
// row past the call's deadline) says so: it is not ErrOutcomeUnknown, and
// it is indeed not applied once the row is free. One whose COMMIT was sent
// and went unanswered (here, held up by a deferred trigger) is
// ErrOutcomeUnknown, and indeed lands afterwards.
func TestDB_PutResource_OutcomeUnknownOnlyOnceCommitSent(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{})
	tok := issue(t, db, "doc")
	put(t, db, "doc", tok, `{"by":"w0"}`)

	t.Run("StatementHeldUp", func(t *testing.T) {
		tx, err := connect(t, url).Begin(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(context.Background())
		if _, err := tx.Exec(t.Context(), `SELECT 1 FROM redfence_resources WHERE key = 'doc' FOR UPDATE`); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
		_, err = db.PutResource(ctx, "doc", tok, []byte(`{"by":"w1"}`))
		cancel()
		if !errors.Is(err, ErrUnavailable) || errors.Is(err, ErrOutcomeUnknown) {
			t.Fatalf("PutResource held up on the row = %v; want ErrUnavailable without ErrOutcomeUnknown", err)
		}
		if err := tx.Rollback(t.Context()); err != nil {
			t.Fatal(err)
		}
		testutil.WaitFor(t, waitTimeout, "the held-up write's session to end its transaction", busyDocSessions(t, url))
		wantResource(t, db, "doc", `{"by":"w0"}`, tok, 1)
	})

	t.Run("CommitHeldUp", func(t *testing.T) {
		// The write goes through a proxy: once its COMMIT waits in the
		// trigger, the proxy refuses new connections, so the cancel
		// request pgx sends as it gives the connection up (asyncClose)
		// never reaches Postgres, and the COMMIT, left waiting, lands when
		// the trigger lets it go. Without that the test raced the cancel
		// request against its own unlock below: the COMMIT was cancelled
		// (rolled back) when the request came first, and the write did not
		// land (2 runs in 3 under -race).
		_, hostPort, _ := strings.Cut(strings.TrimPrefix(url, "postgres://"), "@")
		hostPort, _, _ = strings.Cut(hostPort, "/")
		proxy := newHeldProxy(t, hostPort)
		a := open(t, strings.Replace(url, hostPort, proxy.ln.Addr().String(), 1), Options{MaxConns: 1, DocMaxConns: 1})
		setup := connect(t, url)
		for _, q := range []string{
			`CREATE FUNCTION test_hold_commit() RETURNS trigger LANGUAGE plpgsql AS
			   $$ BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NULL; END $$`,
			`CREATE CONSTRAINT TRIGGER test_hold_commit AFTER INSERT OR UPDATE ON redfence_resources
			   DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION test_hold_commit()`,
			`SELECT pg_advisory_lock(4242)`,
		} {
			if _, err := setup.Exec(t.Context(), q); err != nil {
				t.Fatal(err)
			}
		}
		// The call is given up only once its COMMIT waits in the trigger: a
		// deadline could also pass while the COMMIT is being sent, and
		// then it may not land (an outcome that is unknown too).
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() {
			_, err := a.PutResource(ctx, "doc", tok, []byte(`{"by":"w2"}`))
			done <- err
		}()
		obs := connect(t, url)
		testutil.WaitFor(t, waitTimeout, "the write's COMMIT to wait in its trigger", func() (bool, error) {
			var n int
			err := obs.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
				WHERE datname = current_database() AND wait_event_type = 'Lock' AND wait_event = 'advisory'`).Scan(&n)
			return n > 0, err
		})
		proxy.hold()
		defer proxy.release() // A's Terminate and close, kept back until now
		cancel()
		if err := <-done; !errors.Is(err, ErrOutcomeUnknown) {
			t.Fatalf("PutResource whose COMMIT went unanswered = %v; want ErrOutcomeUnknown", err)
		}
		if _, err := setup.Exec(t.Context(), `SELECT pg_advisory_unlock(4242)`); err != nil {
			t.Fatal(err)
		}
		testutil.WaitFor(t, waitTimeout, "the write's COMMIT to end", busyDocSessions(t, url))
		wantResource(t, db, "doc", `{"by":"w2"}`, tok, 2) // it did land
	})
}
