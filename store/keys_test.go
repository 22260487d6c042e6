package store

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redfence/redfence/internal/apikey"
)

func TestDB_Keys(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{})
	ctx := t.Context()

	t.Run("CreateRefuses", func(t *testing.T) {
		for _, tc := range []struct {
			name, tenant string
			scopes       []string
		}{
			{"EmptyTenant", "", apikey.DefaultScopes()},
			{"SlashInTenant", "a/b", apikey.DefaultScopes()},
			{"DotDotTenant", "..", apikey.DefaultScopes()},
			{"LongTenant", strings.Repeat("t", 201), apikey.DefaultScopes()},
			{"NoScope", "acme", nil},
			{"UnknownScope", "acme", []string{"locks", "root"}},
		} {
			if key, k, err := db.CreateKey(ctx, tc.tenant, tc.scopes); err == nil {
				t.Errorf("%s: CreateKey(%q, %v) = %q, %+v; want an error", tc.name, tc.tenant, tc.scopes, key, k)
			}
		}
		if keys, err := db.Keys(ctx); err != nil || len(keys) != 0 {
			t.Errorf("Keys after refused creations = %d keys, %v; want none", len(keys), err)
		}
	})

	key, k, err := db.CreateKey(ctx, "acme", []string{apikey.ScopeAdmin, apikey.ScopeLocks})
	if err != nil {
		t.Fatalf("CreateKey: %v", err)
	}
	if id, ok := apikey.ParseID(key); !ok || id != k.ID {
		t.Fatalf("CreateKey returned key %q with id %q; ParseID says %q, %v", key, k.ID, id, ok)
	}
	if k.Tenant != "acme" || !slices.Equal(k.Scopes, []string{apikey.ScopeLocks, apikey.ScopeAdmin}) || k.CreatedAt.IsZero() || k.Revoked() {
		t.Errorf("CreateKey = %+v; want tenant acme, scopes [locks admin], created, not revoked", k)
	}

	t.Run("OnlyTheHashIsStored", func(t *testing.T) {
		conn := connect(t, url)
		var row string
		if err := conn.QueryRow(ctx, `SELECT r::text FROM redfence_api_keys r WHERE id = $1`, k.ID).Scan(&row); err != nil {
			t.Fatal(err)
		}
		secret := key[len(apikey.Prefix)+16+1:]
		if strings.Contains(row, secret) || strings.Contains(row, key) {
			t.Errorf("the stored row %s contains the key's secret", row)
		}
	})

	t.Run("Lookup", func(t *testing.T) {
		got, err := db.Key(ctx, k.ID)
		if err != nil {
			t.Fatalf("Key(%s): %v", k.ID, err)
		}
		if !bytes.Equal(got.Hash, apikey.Hash(key)) || got.Tenant != "acme" || !slices.Equal(got.Scopes, k.Scopes) {
			t.Errorf("Key(%s) = %+v; want the created key", k.ID, got)
		}
		if !got.Verify(key) {
			t.Errorf("Verify(the key) = false; want true")
		}
		last := byte('A')
		if key[len(key)-1] == 'A' {
			last = 'B'
		}
		wrong := key[:len(key)-1] + string(last)
		if got.Verify(wrong) {
			t.Errorf("Verify(%q) = true for a key with another secret; want false", wrong)
		}
		for _, id := range []string{"0000000000000000", "not-an-id", ""} {
			if _, err := db.Key(ctx, id); !errors.Is(err, ErrKeyNotFound) {
				t.Errorf("Key(%q) = %v; want ErrKeyNotFound", id, err)
			}
		}
	})

	t.Run("Revoke", func(t *testing.T) {
		key2, k2, err := db.CreateKey(ctx, "other", apikey.DefaultScopes())
		if err != nil {
			t.Fatal(err)
		}
		r, err := db.RevokeKey(ctx, k2.ID)
		if err != nil || !r.Revoked() || r.ID != k2.ID {
			t.Fatalf("RevokeKey(%s) = %+v, %v; want it revoked", k2.ID, r, err)
		}
		again, err := db.RevokeKey(ctx, k2.ID)
		if err != nil || !again.RevokedAt.Equal(r.RevokedAt) {
			t.Errorf("second RevokeKey = %v, %v; want the first revocation time %v", again.RevokedAt, err, r.RevokedAt)
		}
		if got, err := db.Key(ctx, k2.ID); err != nil || !got.Revoked() || !got.Verify(key2) {
			t.Errorf("Key(%s) after revocation = %+v, %v; want it revoked (and still verifiable)", k2.ID, got, err)
		}
		if _, err := db.RevokeKey(ctx, "0000000000000000"); !errors.Is(err, ErrKeyNotFound) {
			t.Errorf("RevokeKey(unknown) = %v; want ErrKeyNotFound", err)
		}
		keys, err := db.Keys(ctx)
		if err != nil || len(keys) != 2 || keys[0].ID != k.ID || keys[0].Revoked() || keys[1].ID != k2.ID || !keys[1].Revoked() {
			t.Errorf("Keys = %v, %v; want the active key, then the revoked one", keys, err)
		}
	})
}

// watchRecorder collects the changes a KeyWatcher delivers.
type watchRecorder chan KeyChange

func (w watchRecorder) changed(c KeyChange) { w <- c }

// next returns the next change, failing the test after waitTimeout.
func (w watchRecorder) next(t *testing.T, what string) KeyChange {
	t.Helper()
	select {
	case c := <-w:
		return c
	case <-time.After(waitTimeout):
		t.Fatalf("no key change for %s after %v", what, waitTimeout)
		return KeyChange{}
	}
}

func (w watchRecorder) want(t *testing.T, what string, want KeyChange) {
	t.Helper()
	if got := w.next(t, what); got != want {
		t.Errorf("change after %s = %+v; want %+v", what, got, want)
	}
}

func TestDB_WatchKeys(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{})
	ctx := t.Context()
	rec := make(watchRecorder, 100)
	w, err := db.WatchKeys(ctx, rec.changed)
	if err != nil {
		t.Fatalf("WatchKeys: %v", err)
	}
	t.Cleanup(w.Close)
	// Delivered before WatchKeys returned: an entry cached after it
	// returns must not be dropped by a late first flush.
	select {
	case c := <-rec:
		if c != (KeyChange{}) {
			t.Fatalf("first change %+v; want everything (KeyChange{})", c)
		}
	default:
		t.Fatal("WatchKeys returned before telling that everything may have changed")
	}

	_, k, err := db.CreateKey(ctx, "acme", apikey.DefaultScopes())
	if err != nil {
		t.Fatal(err)
	}
	rec.want(t, "CreateKey", KeyChange{ID: k.ID})
	if _, err := db.RevokeKey(ctx, k.ID); err != nil {
		t.Fatal(err)
	}
	rec.want(t, "RevokeKey", KeyChange{ID: k.ID})

	// Changes made by hand are announced too.
	conn := connect(t, url)
	if _, err := conn.Exec(ctx, `DELETE FROM redfence_api_keys WHERE id = $1`, k.ID); err != nil {
		t.Fatal(err)
	}
	rec.want(t, "DELETE", KeyChange{ID: k.ID})
	if _, err := conn.Exec(ctx, `TRUNCATE redfence_api_keys`); err != nil {
		t.Fatal(err)
	}
	rec.want(t, "TRUNCATE", KeyChange{})

	// Kill the watcher's connection: it reconnects, says "everything may
	// have changed", and delivers later changes again.
	var killed bool
	if err := conn.QueryRow(ctx, `
SELECT pg_terminate_backend(pid) FROM pg_stat_activity
 WHERE datname = current_database() AND query = 'LISTEN `+KeysChannel+`'`).Scan(&killed); err != nil || !killed {
		t.Fatalf("terminating the LISTEN connection: %v, %v", killed, err)
	}
	rec.want(t, "the connection was killed", KeyChange{})
	_, k2, err := db.CreateKey(ctx, "acme", apikey.DefaultScopes())
	if err != nil {
		t.Fatal(err)
	}
	rec.want(t, "CreateKey after reconnecting", KeyChange{ID: k2.ID})

	w.Close()
	select {
	case c := <-rec:
		t.Errorf("change %+v delivered after Close", c)
	default:
	}
}

func TestDB_WatchKeys_Unreachable(t *testing.T) {
	t.Parallel()
	db, _ := newDB(t, Options{})
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if w, err := db.WatchKeys(ctx, func(KeyChange) {}); err == nil {
		w.Close()
		t.Fatal("WatchKeys with a cancelled context succeeded; want an error")
	}
}
