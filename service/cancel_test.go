package service_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/redfence/redfence/internal/testutil"
	"github.com/redfence/redfence/service"
)

// TestLocker_CallerLeftDuringIssuance: a caller that leaves while its
// fencing token is being issued (Postgres slow for the name: another
// session holds its row) gets no grant, even though issuance completes
// afterwards: nobody would learn the lock token, and the name would stay
// held for the whole TTL. The lease is deleted at once, so the next caller
// is granted (a newer token: the abandoned one is spent).
func TestLocker_CallerLeftDuringIssuance(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	l := e.lockerWith(t, nil, service.Options{Registry: e.db, NoSpeculation: true, MaxTTL: time.Minute})
	ctx := t.Context()
	const key = "left-during-issuance"
	g, err := l.Acquire(ctx, key, service.Request{TTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx, key, g.Token); err != nil {
		t.Fatal(err)
	}

	conn, err := pgx.Connect(ctx, e.url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback(context.Background()) })
	if _, err := tx.Exec(ctx, `SELECT token FROM redfence_fencing WHERE key = $1 FOR UPDATE`, key); err != nil {
		t.Fatal(err)
	}

	actx, leave := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		g, err := l.Acquire(actx, key, service.Request{TTL: time.Minute})
		if err == nil {
			err = fmt.Errorf("granted (token %d)", g.Fencing)
		}
		done <- err
	}()
	// The acquire has its quorum and waits for the row.
	testutil.WaitFor(t, 10*time.Second, "issuance waiting for the row lock", func() (bool, error) {
		select {
		case err := <-done:
			t.Fatalf("acquire ended before it waited for the row: %v", err)
		default:
		}
		var n int
		err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()`).Scan(&n)
		return n > 0, err
	})
	leave()
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("acquire whose caller left during issuance = %v; want an error matching context.Canceled", err)
	}
	st, err := l.Status(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if st.Held {
		t.Errorf("the abandoned lease is still held (%v left): nobody can release it", st.Remaining)
	}
	g2, err := l.Acquire(ctx, key, service.Request{TTL: time.Second})
	if err != nil {
		t.Fatalf("next acquire after the caller left: %v", err)
	}
	if g2.Fencing <= g.Fencing+1 {
		t.Errorf("next token %d; want above %d (the abandoned grant's token is spent)", g2.Fencing, g.Fencing+1)
	}
}
