package service_test

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redfence/redfence/internal/keyspace"
	"github.com/redfence/redfence/internal/testutil"
	"github.com/redfence/redfence/service"
)

// TestLocker_FailedTryNotAnnounced: a waiter's try that fails after
// setting the key on a node (the holder's key is missing there: deleted,
// or the node restarted) deletes it again without announcing a release.
// An announcement would wake the waiter itself, and every waiter of the
// name, to try again at once instead of after the retry delay, in a loop
// as long as the holder holds. The holder's release is announced, and
// wakes the waiter.
func TestLocker_FailedTryNotAnnounced(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	waiting := waitStarts{make(chan struct{}, 1)}
	l := e.lockerWith(t, nil, service.Options{
		Registry: e.db, MaxTTL: time.Minute,
		RetryDelayMin: time.Hour, RetryDelayMax: time.Hour, Observer: waiting,
	})
	ctx := t.Context()
	const key = "failed-try"
	g, err := l.Acquire(ctx, key, service.Request{TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	// The holder's key is gone from node 0.
	if err := e.raw[0].Del(ctx, keyspace.RedisKey(key)).Err(); err != nil {
		t.Fatal(err)
	}
	sub := e.raw[0].Subscribe(ctx, keyspace.ReleasedPrefix+key)
	t.Cleanup(func() { sub.Close() })
	if _, err := sub.Receive(ctx); err != nil { // the subscription's confirmation
		t.Fatal(err)
	}

	done := make(chan error, 1)
	go func() {
		w, err := l.Acquire(ctx, key, service.Request{TTL: time.Minute, Wait: 50 * time.Second})
		if err == nil {
			err = l.Release(ctx, key, w.Token)
		}
		done <- err
	}()
	<-waiting.started // its first try failed (4 of 5 nodes held)
	// Cleaned up: at once if node 0 answered before the refusal was
	// decided, else when it answers (a refusal does not wait for it).
	testutil.WaitFor(t, 10*time.Second, "the failed try's key on node 0 to be deleted", func() (bool, error) {
		n, err := e.raw[0].Exists(ctx, keyspace.RedisKey(key)).Result()
		return n == 0, err
	})
	// A message published after the clean-up comes after anything the
	// clean-up published on this node.
	if err := e.raw[0].Publish(ctx, keyspace.ReleasedPrefix+key, "marker").Err(); err != nil {
		t.Fatal(err)
	}
	for {
		m, err := sub.ReceiveMessage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if m.Payload == "marker" {
			break
		}
		t.Errorf("a failed try's clean-up announced a release on node 0 (%s)", m.Payload)
	}
	if err := l.Release(ctx, key, g.Token); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("waiter after the holder's release: %v", err)
	}
}

// acquireCounter counts the acquire requests sent to one node.
type acquireCounter struct {
	addr string
	n    atomic.Int64
}

func (c *acquireCounter) NodeOp(addr, op string, _ service.Outcome, _ time.Duration) {
	if addr == c.addr && op == "acquire" {
		c.n.Add(1)
	}
}
func (*acquireCounter) Waiting(int)                  {}
func (*acquireCounter) Quarantine(string, time.Time) {}

// TestLocker_HeldWaiterDoesNotPoll: a waiter for a lock held for longer
// than its wait, on nodes that announce releases, does not poll them every
// retry delay (10-100ms): it tries again after a second at most, as a
// release would wake it. Over a 4.5 s wait that is at most 6 tries (the
// first, one per second, one as the wait ends), and one more request the
// node may answer only after the holder's grant (counted late), where
// polling made about 80.
func TestLocker_HeldWaiterDoesNotPoll(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	obs := &acquireCounter{addr: e.nodes[0].Addr()}
	l := e.lockerWith(t, nil, service.Options{Registry: e.db, MaxTTL: time.Minute, Observer: obs})
	ctx := t.Context()
	const key = "held-long"
	if _, err := l.Acquire(ctx, key, service.Request{TTL: time.Minute}); err != nil {
		t.Fatal(err)
	}
	before := obs.n.Load()
	_, err := l.Acquire(ctx, key, service.Request{TTL: time.Minute, Wait: 4500 * time.Millisecond})
	if !errors.Is(err, service.ErrWaitTimeout) {
		t.Fatalf("waiter for a lock held a minute = %v; want ErrWaitTimeout", err)
	}
	if tries := obs.n.Load() - before; tries > 7 {
		t.Errorf("the waiter tried %d times in a 4.5 s wait; want at most 7 (a release wakes it)", tries)
	}
}
