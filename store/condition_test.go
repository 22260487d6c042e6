package store

import (
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/refstore"
	"github.com/redfence/redfence/internal/testutil"
)

// TestDB_PutResourceIf: a conditional write applies only to a document in
// the state asked (If-Match, If-None-Match on its version), and otherwise
// changes nothing and names the document's version; a stale token is
// refused first.
func TestDB_PutResourceIf(t *testing.T) {
	t.Parallel()
	db, _ := newDB(t, Options{})
	ctx := t.Context()
	tok := issue(t, db, "c")
	put := func(cond refstore.Condition, data string) (*Resource, error) {
		return db.PutResourceIf(ctx, "c", tok, json.RawMessage(data), cond)
	}
	wantPrecondition := func(step string, err error, version int64) {
		t.Helper()
		var pe *refstore.PreconditionError
		if !errors.As(err, &pe) || !errors.Is(err, refstore.ErrPrecondition) || pe.Version != version {
			t.Fatalf("%s = %v; want a precondition failure at version %d", step, err, version)
		}
	}
	must := func(step string, r *Resource, err error, version int64) {
		t.Helper()
		if err != nil || r.Version != version {
			t.Fatalf("%s = %+v, %v; want version %d", step, r, err, version)
		}
	}

	wantPrecondition("If-Match: * with no document", errOnly(put(refstore.Condition{Exists: true}, `0`)), 0)
	wantPrecondition("If-Match: \"1\" with no document", errOnly(put(refstore.Condition{Exists: true, Versions: []int64{1}}, `0`)), 0)
	if _, err := db.GetResource(ctx, "c"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("document after refused writes: %v; want none", err)
	}
	r, err := put(refstore.Condition{Absent: true}, `1`)
	must("If-None-Match: * with no document", r, err, 1)
	wantPrecondition("If-None-Match: * over version 1", errOnly(put(refstore.Condition{Absent: true}, `"x"`)), 1)
	wantPrecondition("If-None-Match: \"1\" over version 1", errOnly(put(refstore.Condition{NotVersions: []int64{1}}, `"x"`)), 1)
	r, err = put(refstore.Condition{NotVersions: []int64{7}}, `2`)
	must("If-None-Match: \"7\" over version 1", r, err, 2)
	wantPrecondition("If-Match: \"1\" over version 2", errOnly(put(refstore.Condition{Exists: true, Versions: []int64{1}}, `"x"`)), 2)
	wantPrecondition("If-Match with no tag that can match", errOnly(put(refstore.Condition{Exists: true, Versions: []int64{}}, `"x"`)), 2)
	r, err = put(refstore.Condition{Exists: true, Versions: []int64{1, 2}}, `3`)
	must("If-Match: \"1\", \"2\" over version 2", r, err, 3)
	r, err = put(refstore.Condition{Exists: true}, `4`)
	must("If-Match: * over version 3", r, err, 4)
	wantResource(t, db, "c", `4`, tok, 4)

	// A stale token is refused as stale, whatever the condition.
	newer := issue(t, db, "c")
	_, err = put(refstore.Condition{Exists: true, Versions: []int64{1}}, `"stale"`)
	var se *fencing.StaleError
	if !errors.As(err, &se) || se.Current != newer {
		t.Fatalf("stale write with a failing condition = %v; want stale-token naming %d", err, newer)
	}
	wantResource(t, db, "c", `4`, tok, 4)
}

// TestDB_PutResourceIf_Concurrent: of two writes made at once with the same
// If-Match version (a read-modify-write by two workers of one holder),
// exactly one applies.
func TestDB_PutResourceIf_Concurrent(t *testing.T) {
	t.Parallel()
	db, _ := newDB(t, Options{})
	ctx := t.Context()
	tok := issue(t, db, "cas")
	put(t, db, "cas", tok, `0`)
	for round := range 20 {
		version := int64(round + 1)
		var wg sync.WaitGroup
		errs := make([]error, 2)
		for i := range errs {
			wg.Go(func() {
				_, errs[i] = db.PutResourceIf(ctx, "cas", tok, json.RawMessage(fmt.Sprint(i)),
					refstore.Condition{Exists: true, Versions: []int64{version}})
			})
		}
		wg.Wait()
		ok := 0
		for _, err := range errs {
			switch {
			case err == nil:
				ok++
			case !errors.Is(err, refstore.ErrPrecondition):
				t.Fatalf("round %d: %v", round, err)
			}
		}
		if ok != 1 {
			t.Fatalf("round %d: %d of 2 writes at version %d applied (%v); want exactly 1", round, ok, version, errs)
		}
	}
}

// errOnly returns the error of a call that returns a value and an error.
func errOnly[T any](_ T, err error) error { return err }

// TestDB_PutResourceIf_RefusalNamesItsVersion: a write refused by its
// document's version names the version that refused it, even when another
// write is made while the refusal is being answered: the refused write holds
// the document's row until it has read it, so the other write waits for it.
// (Before, the version was read after the refused write's transaction, and
// named the other write's version.)
func TestDB_PutResourceIf_RefusalNamesItsVersion(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{})
	ctx := t.Context()
	tok := issue(t, db, "r")
	put(t, db, "r", tok, `1`)
	other := writeWhenRefused(t, db, lockWaiters(t, url), "r", tok)
	_, err := db.PutResourceIf(ctx, "r", tok, json.RawMessage(`"x"`), refstore.Condition{Exists: true, Versions: []int64{7}})
	var pe *refstore.PreconditionError
	if !errors.As(err, &pe) || pe.Version != 1 {
		t.Fatalf("write refused at version 1 = %v; want a precondition failure naming version 1", err)
	}
	if err := <-other; err != nil {
		t.Fatalf("the other write: %v", err)
	}
	wantResource(t, db, "r", `2`, tok, 2)
}

// TestDB_PutResourceIf_RefusalForNoDocument: a write that asks for an
// existing document (If-Match) and is refused because there is none says
// so (version 0: no document), even when another write creates the
// document while the refusal is being answered. Nothing held a row for the
// refused write (it found none to lock), so the document read after its
// statement was the other write's, version 1: a state the refused write was
// never compared with, which a client could take as the version to write
// over without reading it.
func TestDB_PutResourceIf_RefusalForNoDocument(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{})
	ctx := t.Context()
	waiting := lockWaiters(t, url)
	for key, cond := range map[string]refstore.Condition{
		"any":     {Exists: true},                       // If-Match: *
		"version": {Exists: true, Versions: []int64{7}}, // If-Match: "7"
	} {
		tok := issue(t, db, key)
		other := writeWhenRefused(t, db, waiting, key, tok)
		_, err := db.PutResourceIf(ctx, key, tok, json.RawMessage(`"x"`), cond)
		var pe *refstore.PreconditionError
		if !errors.As(err, &pe) || pe.Version != 0 {
			t.Errorf("write %+v refused for want of a document = %v; want a precondition failure naming no version", cond, err)
		}
		if err := <-other; err != nil {
			t.Fatalf("the other write: %v", err)
		}
		wantResource(t, db, key, `2`, tok, 1)
	}
}

// writeWhenRefused arms db's refusal hook: when a write is next refused by
// its document, another write of `2` under key with tok is made, and the
// refused write goes on once that one has landed or waits for the row
// (waiting counts the store's sessions waiting for a lock). The other
// write's error comes on the channel returned.
func writeWhenRefused(t *testing.T, db *DB, waiting func() (int, error), key string, tok fencing.Token) <-chan error {
	t.Helper()
	other := make(chan error, 1)
	db.putRefused = func() {
		db.putRefused = nil // the other write's own refusals, if any, run free
		go func() {
			_, err := db.PutResource(t.Context(), key, tok, json.RawMessage(`2`))
			other <- err
		}()
		testutil.WaitFor(t, waitTimeout, "the other write to land or wait for the row", func() (bool, error) {
			if len(other) > 0 {
				return true, nil
			}
			n, err := waiting()
			return n > 0, err
		})
	}
	return other
}
