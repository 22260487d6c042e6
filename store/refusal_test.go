package store

import (
	"encoding/json"
	"errors"
	"fmt"
	"testing"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/testutil"
)

// TestDB_PutResource_RefusalNamesTheNewerToken: a write with token T is
// refused because a speculative T+1 was issued (a try that then lost); the
// withdrawal of T+1, queued behind the write's share lock on the token row,
// puts T back as soon as the write's statement ends. The refusal must name
// T+1, the token that refused it, not T, the write's own (which a reader of
// the record after the statement finds). The trigger holds the write's
// statement open (a busy Postgres), long enough to see the withdrawal
// queue behind it.
func TestDB_PutResource_RefusalNamesTheNewerToken(t *testing.T) {
	db, url := newDB(t, Options{})
	admin := connect(t, url)
	if _, err := admin.Exec(t.Context(), `
CREATE FUNCTION slow_put() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(0.2); RETURN NULL; END $$;
CREATE TRIGGER slow_put AFTER INSERT ON redfence_resources FOR EACH STATEMENT EXECUTE FUNCTION slow_put();`); err != nil {
		t.Fatal(err)
	}
	obs := connect(t, url)
	same := 0
	const tries = 10
	for i := range tries {
		key := fmt.Sprintf("refusal-%d", i)
		old := issue(t, db, key)
		s := speculate(t, db, fencing.Claim{Key: key, Owner: "spec"}, old)
		waitToken(t, db, key, old+1)
		res := make(chan error, 1)
		go func() {
			_, err := db.PutResource(t.Context(), key, old, json.RawMessage(`"x"`))
			res <- err
		}()
		// The write holds its share lock (its statement sleeps in the trigger).
		testutil.WaitFor(t, waitTimeout, "the write's statement", func() (bool, error) {
			var n int
			err := obs.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%INSERT INTO redfence_resources%' AND wait_event = 'PgSleep'`).Scan(&n)
			return n > 0, err
		})
		done := make(chan error, 1)
		go func() { done <- s.Abandon(t.Context()) }()
		testutil.WaitFor(t, waitTimeout, "the withdrawal to wait for the write's share lock", func() (bool, error) {
			var n int
			err := obs.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%redfence_fencing%'`).Scan(&n)
			return n > 0, err
		})
		err := <-res
		if aerr := <-done; aerr != nil {
			t.Fatal(aerr)
		}
		var se *fencing.StaleError
		if !errors.As(err, &se) {
			t.Fatalf("try %d: PutResource = %v; want a StaleError", i, err)
		}
		if se.Current != old+1 {
			same++
			t.Logf("try %d: refusal names %d; want %d", i, se.Current, old+1)
		}
	}
	if same > 0 {
		t.Errorf("%d of %d refusals did not name the token that refused them", same, tries)
	}
}
