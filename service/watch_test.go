package service

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/internal/keyspace"
	"github.com/redfence/redfence/internal/testutil"
)

// TestLocker_WokenByOtherServer: a waiter is woken by a release made through
// another Locker (another server) on the same nodes, announced over Redis
// Pub/Sub: with an hour between its retries, nothing else could grant it.
// Once no waiter is left, the server stops watching the lock.
func TestLocker_WokenByOtherServer(t *testing.T) {
	rs := clustertest.Redis(t, 3, cluster.RedisOptions{})
	iss := &memIssuer{}
	server := func() *Locker {
		var ns []Node
		for _, r := range rs {
			n := NewRedisNode(r.Addr(), RedisOptions{})
			t.Cleanup(func() { _ = n.Close() })
			ns = append(ns, n)
		}
		return newLocker(t, ns, iss, Options{NodeTimeout: 5 * time.Second, RetryDelayMin: time.Hour, RetryDelayMax: time.Hour})
	}
	a, b := server(), server()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	g, err := a.Acquire(ctx, key, Request{TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		g2, err := b.Acquire(ctx, key, Request{TTL: time.Minute, Wait: 50 * time.Second})
		if err == nil {
			err = b.Release(ctx, key, g2.Token)
		}
		done <- err
	}()
	admins := make([]*redis.Client, len(rs))
	for i, r := range rs {
		admins[i] = redis.NewClient(&redis.Options{Addr: r.Addr()})
		t.Cleanup(func() { _ = admins[i].Close() })
	}
	channel := keyspace.ReleasedPrefix + key
	subscribers := func(want int64) func() (bool, error) {
		return func() (bool, error) {
			for _, c := range admins {
				n, err := c.PubSubNumSub(ctx, channel).Result()
				if err != nil {
					return false, err
				}
				if n[channel] != want {
					return false, nil
				}
			}
			return true, nil
		}
	}
	testutil.WaitFor(t, time.Minute, "server b watching the lock on every node", subscribers(1))
	if err := a.Release(ctx, key, g.Token); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("waiter on server b: %v", err)
	}
	testutil.WaitFor(t, time.Minute, "server b no longer watching the lock", subscribers(0))
}
