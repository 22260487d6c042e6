package service_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/testutil"
	"github.com/redfence/redfence/service"
	"github.com/redfence/redfence/store"
)

// TestLocker_CallerLeftDuringIssuance: a caller that leaves while its
// fencing token is being issued (Postgres slow for the name: another
// session holds its row) gets no grant, even though issuance completes
// afterwards: nobody would learn the lock token, and the name would stay
// held for the whole TTL. The lease is deleted once issuance has ended, so
// the next caller is granted, a newer token (the abandoned claim's may or may
// not have been spent: a claim set aside for its row sends no COMMIT once its
// caller left, one still in its batch's statement when the row came free is
// committed with it).
func TestLocker_CallerLeftDuringIssuance(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	l := e.lockerWith(t, nil, service.Options{Registry: e.db, NoSpeculation: true, MaxTTL: time.Minute})
	ctx := t.Context()
	const key = "left-during-issuance"
	tx, g := lockRows(t, e, l, key)

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
	watch := watchConn(t, e.url)
	testutil.WaitFor(t, 10*time.Second, "issuance waiting for the row lock", func() (bool, error) {
		select {
		case err := <-done:
			t.Fatalf("acquire ended before it waited for the row: %v", err)
		default:
		}
		n, err := lockWaiters(ctx, watch)
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
	if g2.Fencing <= g.Fencing {
		t.Errorf("next token %d; want above %d", g2.Fencing, g.Fencing)
	}
}

// TestLocker_LeaseEndsInIssuanceQueue: a grant whose claim is still queued
// for issuance when its lease ends (every committer busy: Postgres slow for
// other names) is refused as expired, and its claim is dropped unissued.
// Issued afterwards, its token would be newer than that of a grant made
// after the lease, and fence that live holder out.
func TestLocker_LeaseEndsInIssuanceQueue(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	// Issuance waits for a held row rather than set its claim aside
	// (IssueLockWait), as it does for a slow Postgres.
	slow, err := store.Open(t.Context(), e.url, store.Options{IssueLockWait: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(slow.Close)
	e.db = slow
	l := e.lockerWith(t, nil, service.Options{Registry: e.db, NoSpeculation: true, MaxTTL: time.Minute, IssueTimeout: time.Minute})
	ctx := t.Context()
	// Both committers of the store (its default) are taken by these names'
	// issuance, which waits for their rows.
	blocked := []string{"queue-blocked-1", "queue-blocked-2"}
	tx, _ := lockRows(t, e, l, blocked...)
	watch := watchConn(t, e.url)
	done := make(chan error, len(blocked))
	for i, k := range blocked {
		// One after the other, so each is a batch of its own.
		go func() {
			_, err := l.Acquire(ctx, k, service.Request{TTL: time.Minute})
			done <- err
		}()
		testutil.WaitFor(t, 10*time.Second, "committers waiting for a row lock", func() (bool, error) {
			n, err := lockWaiters(ctx, watch)
			return n > i, err
		})
	}

	const key = "queue-lease-ends"
	queued := make(chan error, 1)
	go func() {
		g, err := l.Acquire(ctx, key, service.Request{TTL: 300 * time.Millisecond})
		if err == nil {
			err = fmt.Errorf("granted (token %d)", g.Fencing)
		}
		queued <- err
	}()
	select {
	case err := <-queued:
		if !errors.Is(err, service.ErrExpired) {
			t.Errorf("acquire whose lease ended in the issuance queue = %v; want ErrExpired", err)
		}
	case <-time.After(time.Minute): // a hang, not a speed limit: the committers stay busy until the rows are freed
		t.Error("the acquire waited in the issuance queue past its lease")
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	for range blocked {
		if err := <-done; err != nil {
			t.Errorf("acquire of a blocked name: %v", err)
		}
	}
	select {
	case <-queued: // the failing case above
	default:
	}
	// Claims for one name are issued in order: the next grant's token
	// shows whether the dropped claim was issued.
	g, err := l.Acquire(ctx, key, service.Request{TTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if g.Fencing != 1 {
		t.Errorf("first grant of %q after the expired one got token %d; want 1 (the expired grant's claim was issued)", key, g.Fencing)
	}
}

// lockRows grants and releases each of keys once, so each has its row of
// tokens, then locks those rows in a transaction of another session, which
// it returns (rolled back at the end of the test) with the last grant:
// issuance for the keys waits until the transaction ends.
func lockRows(t *testing.T, e *restartEnv, l *service.Locker, keys ...string) (pgx.Tx, *service.Grant) {
	t.Helper()
	ctx := t.Context()
	var g *service.Grant
	for _, k := range keys {
		var err error
		if g, err = l.Acquire(ctx, k, service.Request{TTL: time.Second}); err != nil {
			t.Fatal(err)
		}
		if err := l.Release(ctx, k, g.Token); err != nil {
			t.Fatal(err)
		}
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
	if _, err := tx.Exec(ctx, `SELECT token FROM redfence_fencing WHERE key = ANY($1) FOR UPDATE`, keys); err != nil {
		t.Fatal(err)
	}
	return tx, g
}

// watchConn opens a connection for lockWaiters, outside any transaction.
func watchConn(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	c, err := pgx.Connect(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(context.Background()) })
	return c
}

// lockWaiters counts the sessions of the database that wait for a lock.
// watch must not be in a transaction: there pg_stat_activity is a snapshot
// taken at its first read, and would never change.
func lockWaiters(ctx context.Context, watch *pgx.Conn) (int, error) {
	var n int
	err := watch.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()`).Scan(&n)
	return n, err
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

// specCounter is a store.DB that counts its speculations.
type specCounter struct {
	*store.DB
	n atomic.Int64
}

func (s *specCounter) Speculate(ctx context.Context, c fencing.Claim, last fencing.Token) (fencing.Speculation, error) {
	s.n.Add(1)
	return s.DB.Speculate(ctx, c, last)
}

// TestLocker_RefusedSpeculationHeldRow: a try of a name held through
// another server, running alone on its server (so it speculates), whose
// token row an outside transaction holds (an operator's SELECT ... FOR
// UPDATE), is refused without waiting for the row: the speculative
// statement waits for it no longer than an issuance does, and issues
// nothing. (Found by fault injection: such a try answered 409 lock-held
// only after REDFENCE_ISSUE_TIMEOUT, here an hour.)
func TestLocker_RefusedSpeculationHeldRow(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	holder := e.lockerWith(t, nil, service.Options{Registry: e.db, NoSpeculation: true, MaxTTL: time.Minute})
	ctx := t.Context()
	const key = "held-row-refused"
	g, err := holder.Acquire(ctx, key, service.Request{TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	db, err := store.Open(ctx, e.url, store.Options{IssueTimeout: time.Hour, StatementTimeout: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	spec := &specCounter{DB: db}
	other, err := service.New(e.redisNodes(t), spec, service.Options{IssueTimeout: time.Hour, MaxTTL: time.Minute, NodeTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(other.Close)
	if err := other.Init(ctx); err != nil {
		t.Fatal(err)
	}
	// Held until the test ends at the latest, before other and db close
	// (cleanups run last first).
	conn := watchConn(t, e.url)
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback(context.Background()) })
	if _, err := tx.Exec(ctx, `SELECT token FROM redfence_fencing WHERE key = $1 FOR UPDATE`, key); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := other.Acquire(ctx, key, service.Request{TTL: time.Minute})
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, service.ErrHeld) {
			t.Fatalf("try of a held name = %v; want ErrHeld", err)
		}
	case <-time.After(30 * time.Second): // a hang, not a speed limit: the row stays held until the test ends
		t.Fatal("the refused try waited for the name's row, held by another transaction")
	}
	if n := spec.n.Load(); n != 1 {
		t.Fatalf("%d speculations; want 1 (the try ran alone)", n)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if last, err := db.Last(ctx, key); err != nil || last.Token != g.Fencing {
		t.Errorf("newest token = %+v, %v; want %d, the holder's: the refused speculation issued nothing", last, err, g.Fencing)
	}
}
