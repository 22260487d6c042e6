package service

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/rs/zerolog"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
)

// slowLink starts one redis-server behind a toxiproxy proxy that delays
// every chunk by oneWay in each direction, and returns the proxy's address
// and a client of the server itself.
func slowLink(t *testing.T, oneWay time.Duration) (string, *redis.Client) {
	t.Helper()
	srv := clustertest.Redis(t, 1, cluster.RedisOptions{})[0]
	toxics := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop())
	p := toxiproxy.NewProxy(toxics, "redis", "127.0.0.1:0", srv.Addr())
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Stop)
	for _, stream := range []string{"upstream", "downstream"} {
		js := `{"name":"lat-` + stream + `","type":"latency","stream":"` + stream + `","attributes":{"latency":` + strconv.FormatInt(oneWay.Milliseconds(), 10) + `}}`
		if _, err := p.Toxics.AddToxicJson(strings.NewReader(js)); err != nil {
			t.Fatal(err)
		}
	}
	raw := redis.NewClient(&redis.Options{Addr: srv.Addr(), MaxRetries: -1})
	t.Cleanup(func() { raw.Close() })
	return p.Listen, raw
}

// TestRedisNode_ReconnectsOverSlowLink: a node whose round trip is a good
// part of the per-node timeout gets a connection again after losing the
// ones it had. Setting one up takes four round trips (HELLO, and the INFO
// and CONFIG GET a Locker's restart watch asks on every new connection),
// more than a command's deadline allows here; go-redis would run them
// under that deadline and drop the connection when it passed, every time.
// The node sets up a connection in the background under the dial timeout,
// and the commands after it succeed, through the pipeline and outside it.
func TestRedisNode_ReconnectsOverSlowLink(t *testing.T) {
	t.Parallel()
	const oneWay = 20 * time.Millisecond
	// 2.5 round trips: a command fits, the set-up of a connection does not.
	const deadline = 5 * oneWay
	addr, raw := slowLink(t, oneWay)
	n := NewRedisNode(addr, RedisOptions{})
	t.Cleanup(func() { n.Close() })
	var mu sync.Mutex
	watched := 0
	if err := n.WatchRestarts(t, func(context.Context, string, bool) error {
		mu.Lock()
		watched++
		mu.Unlock()
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	acquire := func(d time.Duration) error {
		ctx, cancel := context.WithTimeout(t.Context(), d)
		defer cancel()
		_, _, err := n.Acquire(ctx, "redfence:lock:k", "tok", time.Minute, "")
		return err
	}
	ping := func(d time.Duration) error {
		ctx, cancel := context.WithTimeout(t.Context(), d)
		defer cancel()
		return n.Ping(ctx)
	}
	for _, c := range []struct {
		what string
		call func(time.Duration) error
	}{{"an acquire (pipelined)", acquire}, {"a ping", ping}} {
		if err := c.call(10 * time.Second); err != nil {
			t.Fatalf("%s with time to connect: %v", c.what, err)
		}
		if err := c.call(deadline); err != nil {
			t.Fatalf("%s on the connection set up: %v", c.what, err)
		}
		killed, err := raw.ClientKillByFilter(t.Context(), "TYPE", "normal").Result()
		if err != nil || killed == 0 {
			t.Fatalf("CLIENT KILL TYPE normal = %d, %v; want the node's connections killed", killed, err)
		}
		failed := 0
		for limit := time.Now().Add(10 * time.Second); ; {
			err := c.call(deadline)
			if err == nil {
				break
			}
			if isReply(err) {
				t.Fatalf("%s after its connections were killed: the node's error reply %v; want a timeout or a connection error until it reconnects", c.what, err)
			}
			failed++
			if time.Now().After(limit) {
				t.Fatalf("%s still failing 10s after the node's connections were killed (%d tries, the last: %v): it never gets a connection set up", c.what, failed, err)
			}
		}
		if failed == 0 {
			t.Errorf("%s succeeded at once after its connections were killed; want the first try to fail on its dead connection", c.what)
		}
		t.Logf("%s: %d tries failed before the node reconnected", c.what, failed)
	}
	mu.Lock()
	defer mu.Unlock()
	if watched < 3 {
		t.Errorf("the restart watch saw %d new connections; want every one (at least 3)", watched)
	}
}

// TestRedisNode_PingRefusedStillConnects: the set-up of a connection ends
// with a PING, which a node refuses while it loads its data (LOADING), as
// here an ACL without +ping refuses it (NOPERM): the connection is set up
// all the same, and the commands that work (INFO, the lock scripts) go
// through. The refusal is not reported as the node refusing INFO.
func TestRedisNode_PingRefusedStillConnects(t *testing.T) {
	t.Parallel()
	srv := clustertest.Redis(t, 1, cluster.RedisOptions{})[0]
	raw := redis.NewClient(&redis.Options{Addr: srv.Addr(), MaxRetries: -1})
	t.Cleanup(func() { raw.Close() })
	args := []any{"acl", "setuser", "noping", "reset", "on", ">pw"}
	for r := range strings.FieldsSeq(RedisACL) {
		if r != "+ping" {
			args = append(args, r)
		}
	}
	if err := raw.Do(t.Context(), args...).Err(); err != nil {
		t.Fatal(err)
	}
	n := NewRedisNode(srv.Addr(), RedisOptions{Username: "noping", Password: "pw"})
	t.Cleanup(func() { n.Close() })
	if err := n.WatchRestarts(t, func(context.Context, string, bool) error { return nil }); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if id, _, err := n.ServerID(ctx); err != nil || id == "" {
		t.Fatalf("ServerID with PING refused = %q, %v; want the run_id", id, err)
	}
	if _, _, err := n.Eviction(ctx); err != nil {
		t.Errorf("Eviction with PING refused = %v; want an answer", err)
	}
	if ok, _, err := n.Acquire(ctx, "redfence:lock:k", "tok", time.Minute, ""); err != nil || !ok {
		t.Errorf("Acquire with PING refused = %v, %v; want granted", ok, err)
	}
}
