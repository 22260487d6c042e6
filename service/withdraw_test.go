package service_test

import (
	"testing"
	"time"

	"github.com/redfence/redfence/internal/keyspace"
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
	<-waiting.started // its first try failed (4 of 5 nodes held) and was cleaned up
	if n, err := e.raw[0].Exists(ctx, keyspace.RedisKey(key)).Result(); err != nil || n != 0 {
		t.Fatalf("the failed try's key on node 0: exists %d, %v; want deleted", n, err)
	}
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
