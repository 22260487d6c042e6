package store

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redfence/redfence/fencing"
)

// speculate starts a speculation and fails the test on error.
func speculate(t *testing.T, db *DB, c fencing.Claim, last fencing.Token) fencing.Speculation {
	t.Helper()
	s, err := db.Speculate(t.Context(), c, last)
	if err != nil {
		t.Fatalf("Speculate(%q, %d): %v", c.Key, last, err)
	}
	// A test that fails half-way still gives the connection back (Abandon
	// after Confirm or Abandon is a no-op).
	t.Cleanup(func() { _ = s.Abandon(context.Background()) })
	return s
}

// waitToken waits until key's newest token is tok: a speculation's
// statement is sent, not awaited, so this is how a test orders it before
// what it does next.
func waitToken(t *testing.T, db *DB, key string, tok fencing.Token) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		r, err := db.Last(t.Context(), key)
		if err != nil {
			t.Fatal(err)
		}
		if r.Token == tok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("newest token of %q is %d after %v; want %d", key, r.Token, waitTimeout, tok)
		}
	}
}

// wantLast checks the newest record of key.
func wantLast(t *testing.T, db *DB, key string, tok fencing.Token, owner, holder string) fencing.Record {
	t.Helper()
	r, err := db.Last(t.Context(), key)
	if err != nil {
		t.Fatal(err)
	}
	if r.Token != tok || r.Owner != owner || r.Holder != holder {
		t.Errorf("Last(%q) = token %d owner %q holder %q; want %d %q %q", key, r.Token, r.Owner, r.Holder, tok, owner, holder)
	}
	return r
}

func TestDB_Speculate(t *testing.T) {
	t.Parallel()
	db, _ := newDB(t, Options{})
	ctx := t.Context()
	// Every speculation gives its connection back.
	t.Cleanup(func() {
		if n := db.pool.Stat().AcquiredConns(); n != 0 {
			t.Errorf("%d connections still acquired", n)
		}
	})
	run := func(name string, f func(t *testing.T)) {
		t.Run(name, func(t *testing.T) {
			f(t)
			if n := db.pool.Stat().AcquiredConns(); n != 0 {
				t.Errorf("%d connections still acquired after %s", n, name)
			}
		})
	}

	run("FirstToken", func(t *testing.T) {
		s := speculate(t, db, fencing.Claim{Key: "first", Owner: "A", Holder: "ha"}, 0)
		tok, err := s.Confirm(ctx)
		if err != nil || tok != 1 {
			t.Fatalf("Confirm = %d, %v; want 1", tok, err)
		}
		wantLast(t, db, "first", 1, "A", "ha")
		// Issue goes on from it.
		if got := issue(t, db, "first"); got != 2 {
			t.Errorf("Issue after a confirmed speculation = %d; want 2", got)
		}
	})

	run("NextToken", func(t *testing.T) {
		for range 3 {
			issue(t, db, "next")
		}
		s := speculate(t, db, fencing.Claim{Key: "next", Owner: "B", Holder: "hb"}, 3)
		if tok, err := s.Confirm(ctx); err != nil || tok != 4 {
			t.Fatalf("Confirm = %d, %v; want 4", tok, err)
		}
		wantLast(t, db, "next", 4, "B", "hb")
	})

	// The condition: a speculation naming a token that is not the newest
	// issues nothing, so it cannot fence out a grant it does not know of.
	run("NotNewest", func(t *testing.T) {
		issue(t, db, "held")
		issue(t, db, "held") // 2: a grant the speculating server did not see
		for _, last := range []fencing.Token{0, 1, 3} {
			s := speculate(t, db, fencing.Claim{Key: "held", Owner: "C"}, last)
			tok, err := s.Confirm(ctx)
			if !errors.Is(err, fencing.ErrNotConfirmed) {
				t.Fatalf("Confirm (last %d) = %d, %v; want ErrNotConfirmed", last, tok, err)
			}
		}
		wantLast(t, db, "held", 2, "", "")
	})

	// A token issued between the speculation and its confirmation (by a
	// grant that won its quorum before this one) makes it ungrantable.
	run("Superseded", func(t *testing.T) {
		s := speculate(t, db, fencing.Claim{Key: "raced", Owner: "D"}, 0)
		waitToken(t, db, "raced", 1)
		newer := issue(t, db, "raced")
		if newer != 2 {
			t.Fatalf("Issue during the speculation = %d; want 2", newer)
		}
		tok, err := s.Confirm(ctx)
		if !errors.Is(err, fencing.ErrNotConfirmed) {
			t.Fatalf("Confirm = %d, %v; want ErrNotConfirmed", tok, err)
		}
		// Abandoning after Confirm changes nothing.
		if err := s.Abandon(ctx); err != nil {
			t.Errorf("Abandon after Confirm: %v", err)
		}
		wantLast(t, db, "raced", 2, "", "")
	})

	// An abandoned token stays unused: never withdrawn, so the key's token
	// never goes back and no number is issued twice.
	run("AbandonFirst", func(t *testing.T) {
		s := speculate(t, db, fencing.Claim{Key: "gone", Owner: "E"}, 0)
		if err := s.Abandon(ctx); err != nil {
			t.Fatal(err)
		}
		wantLast(t, db, "gone", 1, "E", "")
		if got := issue(t, db, "gone"); got != 2 {
			t.Errorf("Issue after an abandoned first token = %d; want 2", got)
		}
	})

	run("AbandonNext", func(t *testing.T) {
		if _, err := db.Issue(ctx, fencing.Claim{Key: "back", Owner: "F", Holder: "hf"}); err != nil {
			t.Fatal(err)
		}
		s := speculate(t, db, fencing.Claim{Key: "back", Owner: "G", Holder: "hg"}, 1)
		if err := s.Abandon(ctx); err != nil {
			t.Fatal(err)
		}
		wantLast(t, db, "back", 2, "G", "hg")
		if got := s.(*speculation).Issued(); got != 2 {
			t.Errorf("Issued after Abandon = %d; want 2 (the burned token, for the metrics)", got)
		}
		// A second call is a no-op.
		if err := s.Abandon(ctx); err != nil {
			t.Errorf("second Abandon: %v", err)
		}
		wantLast(t, db, "back", 2, "G", "hg")
		if got := issue(t, db, "back"); got != 3 {
			t.Errorf("Issue after an abandoned token = %d; want 3", got)
		}
	})

	// An abandoned speculation whose condition did not hold issued nothing.
	run("AbandonNotIssued", func(t *testing.T) {
		issue(t, db, "moved")
		issue(t, db, "moved")
		s := speculate(t, db, fencing.Claim{Key: "moved", Owner: "J"}, 1)
		if err := s.Abandon(ctx); err != nil {
			t.Fatal(err)
		}
		wantLast(t, db, "moved", 2, "", "")
		if got := s.(*speculation).Issued(); got != 0 {
			t.Errorf("Issued after Abandon = %d; want 0", got)
		}
	})

	// Abandoning never undoes a newer token.
	run("AbandonSuperseded", func(t *testing.T) {
		issue(t, db, "kept")
		s := speculate(t, db, fencing.Claim{Key: "kept"}, 1)
		waitToken(t, db, "kept", 2)
		if got := issue(t, db, "kept"); got != 3 {
			t.Fatalf("Issue during the speculation = %d; want 3", got)
		}
		if err := s.Abandon(ctx); err != nil {
			t.Fatal(err)
		}
		wantLast(t, db, "kept", 3, "", "")
	})

	// A token a write carried stays the newest once abandoned: no later
	// grant gets it again and no older token is accepted after it.
	run("AbandonWritten", func(t *testing.T) {
		issue(t, db, "written")
		s := speculate(t, db, fencing.Claim{Key: "written", Owner: "H"}, 1)
		waitToken(t, db, "written", 2)
		if _, err := db.PutResource(ctx, "written", 2, []byte(`"with the speculative token"`)); err != nil {
			t.Fatalf("write with the newest token: %v", err)
		}
		if err := s.Abandon(ctx); err != nil {
			t.Fatal(err)
		}
		wantLast(t, db, "written", 2, "H", "")
		if _, err := db.PutResource(ctx, "written", 1, []byte(`"older"`)); !errors.Is(err, fencing.ErrStale) {
			t.Errorf("write with token 1 after token 2 was written = %v; want stale", err)
		}
		if got := issue(t, db, "written"); got != 3 {
			t.Errorf("Issue after the written token = %d; want 3", got)
		}
		// The first token too.
		s = speculate(t, db, fencing.Claim{Key: "written-first", Owner: "I"}, 0)
		waitToken(t, db, "written-first", 1)
		if _, err := db.PutResource(ctx, "written-first", 1, []byte(`1`)); err != nil {
			t.Fatalf("write with the first token: %v", err)
		}
		if err := s.Abandon(ctx); err != nil {
			t.Fatal(err)
		}
		wantLast(t, db, "written-first", 1, "I", "")
		// And a document's token never goes back, even if the token row
		// did (lowered by hand, or by a build that withdrew tokens).
		issue(t, db, "regress")
		issue(t, db, "regress")
		if _, err := db.PutResource(ctx, "regress", 2, []byte(`2`)); err != nil {
			t.Fatal(err)
		}
		if _, err := db.pool.Exec(ctx, `UPDATE redfence_fencing SET token = 1 WHERE key = 'regress'`); err != nil {
			t.Fatal(err)
		}
		_, err := db.PutResource(ctx, "regress", 1, []byte(`1`))
		if se := (*fencing.StaleError)(nil); !errors.As(err, &se) || se.Current != 2 {
			t.Errorf("write with token 1 over a document written with 2 = %v; want stale, newest 2", err)
		}
		if r, err := db.GetResource(ctx, "regress"); err != nil || r.FencingToken != 2 || string(r.Data) != "2" {
			t.Errorf("document = %+v, %v; want token 2's", r, err)
		}
	})

	// The connection goes back to the pool in a usable state each time:
	// many speculations in a row on a small pool.
	run("Reuse", func(t *testing.T) {
		var last fencing.Token
		for i := range 50 {
			s := speculate(t, db, fencing.Claim{Key: "reuse"}, last)
			if i%2 == 1 {
				if err := s.Abandon(ctx); err != nil {
					t.Fatal(err)
				}
				last++ // its token, unused, is the newest
				continue
			}
			tok, err := s.Confirm(ctx)
			if err != nil || tok != last+1 {
				t.Fatalf("round %d: Confirm = %d, %v; want %d", i, tok, err, last+1)
			}
			last = tok
		}
		wantLast(t, db, "reuse", last, "", "")
	})
}

// TestDB_Speculate_HeldRow: a speculation whose key's row another
// transaction holds (an operator's SELECT ... FOR UPDATE, a slow document
// write) waits for it no longer than an issuance does (IssueLockWait), and
// issues nothing: a try that lost ends at once (Abandon), and one that won
// hears ErrNotConfirmed and issues its token the ordinary way, where a held
// row waits alone. The connection goes back to the pool, usable. (Found by
// fault injection: a try-lock of a name held through another server, alone
// on its server, answered 409 lock-held only after REDFENCE_ISSUE_TIMEOUT,
// its Abandon waiting for the row an operator held, on a connection of the
// locks' pool.)
func TestDB_Speculate_HeldRow(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{IssueTimeout: time.Hour, StatementTimeout: time.Hour, IssueLockWait: time.Millisecond})
	issue(t, db, "a")
	row := holdRow(t, url, "a")
	ctx, cancel := context.WithTimeout(t.Context(), waitTimeout) // a guard against a hang
	defer cancel()

	lost := speculate(t, db, fencing.Claim{Key: "a", Holder: "lost"}, 1)
	if err := lost.Abandon(ctx); err != nil {
		t.Fatalf("Abandon while a's row is held: %v; want it to end without waiting for the row", err)
	}
	if got := lost.(*speculation).Issued(); got != 0 {
		t.Errorf("Issued after Abandon = %d; want 0: the row was held", got)
	}
	won := speculate(t, db, fencing.Claim{Key: "a", Holder: "won"}, 1)
	if tok, err := won.Confirm(ctx); !errors.Is(err, fencing.ErrNotConfirmed) {
		t.Fatalf("Confirm while a's row is held = %d, %v; want ErrNotConfirmed without waiting for the row", tok, err)
	}
	if n := db.pool.Stat().AcquiredConns(); n != 0 {
		t.Errorf("%d connections still acquired", n)
	}

	if err := row.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	wantLast(t, db, "a", 1, "", "")
	s := speculate(t, db, fencing.Claim{Key: "a", Holder: "next"}, 1)
	if tok, err := s.Confirm(ctx); err != nil || tok != 2 {
		t.Fatalf("Confirm once a's row is free = %d, %v; want 2: nothing was issued while it was held", tok, err)
	}
}
