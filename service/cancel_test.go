package service_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
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

// opCounter counts the node requests reported for each op.
type opCounter struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *opCounter) NodeOp(_, op string, _ service.Outcome, _ time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[op]++
}
func (*opCounter) Waiting(int)                  {}
func (*opCounter) Quarantine(string, time.Time) {}

func (c *opCounter) get(op string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[op]
}

// TestLocker_CallerLeftIsNoOutage: a caller that has left (its context
// ended) gets context.Canceled from Status and Extend, not ErrQuorum or
// ErrFencing, and its cut-short node requests are not reported: they are
// no news of the nodes or of Postgres, which answer normally.
func TestLocker_CallerLeftIsNoOutage(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	obs := &opCounter{}
	l := e.lockerWith(t, nil, service.Options{Registry: e.db, Observer: obs})
	ctx := t.Context()
	const key = "caller-left"
	g, err := l.Acquire(ctx, key, service.Request{TTL: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ttls := obs.get("ttl")
	gone, leave := context.WithCancel(ctx)
	leave()
	for _, tc := range []struct {
		op string
		f  func() error
	}{
		{"Status", func() error { _, err := l.Status(gone, key); return err }},
		{"Extend", func() error { _, err := l.Extend(gone, key, g.Token, 3*time.Second); return err }},
	} {
		err := tc.f()
		if !errors.Is(err, context.Canceled) || errors.Is(err, service.ErrQuorum) || errors.Is(err, service.ErrFencing) {
			t.Errorf("%s of a caller that left = %v; want context.Canceled, neither ErrQuorum nor ErrFencing", tc.op, err)
		}
	}
	if n := obs.get("ttl") - ttls; n != 0 {
		t.Errorf("%d ttl requests reported for a caller that left; want none", n)
	}
	// The nodes and Postgres were fine all along.
	if st, err := l.Status(ctx, key); err != nil || !st.Held {
		t.Errorf("Status = %+v, %v; want held", st, err)
	}
	if n := obs.get("ttl") - ttls; n != len(e.nodes) {
		t.Errorf("%d ttl requests reported for a caller that stayed; want %d", n, len(e.nodes))
	}
	if err := l.Release(ctx, key, g.Token); err != nil {
		t.Fatal(err)
	}
}
