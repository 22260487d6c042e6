package service_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/internal/keyspace"
	"github.com/redfence/redfence/internal/testutil"
	"github.com/redfence/redfence/service"
	"github.com/redfence/redfence/store"
)

// restartEnv is 5 real redis-server nodes and a real Postgres registry.
type restartEnv struct {
	nodes []*cluster.Redis
	raw   []*redis.Client
	db    *store.DB
	url   string // db's
}

func newRestartEnv(t *testing.T, persist bool) *restartEnv {
	t.Helper()
	e := &restartEnv{nodes: clustertest.Redis(t, 5, cluster.RedisOptions{Persist: persist}), url: clustertest.Database(t)}
	db, err := store.Open(t.Context(), e.url, store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	if _, err := db.Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}
	e.db = db
	for _, n := range e.nodes {
		c := redis.NewClient(&redis.Options{Addr: n.Addr(), MaxRetries: -1})
		t.Cleanup(func() { c.Close() })
		e.raw = append(e.raw, c)
	}
	return e
}

// locker returns a Locker on the nodes; reg nil disables restart detection.
func (e *restartEnv) locker(t *testing.T, reg service.Registry) *service.Locker {
	t.Helper()
	addrs := make([]string, len(e.nodes))
	for i, n := range e.nodes {
		addrs[i] = n.Addr()
	}
	return e.lockerAt(t, reg, addrs)
}

// lockerAt is locker with the nodes configured as addrs.
func (e *restartEnv) lockerAt(t *testing.T, reg service.Registry, addrs []string) *service.Locker {
	t.Helper()
	return e.lockerWith(t, addrs, service.Options{Registry: reg})
}

// redisNodes returns a RedisNode for each of addrs (e's nodes if none),
// closed when the test ends.
func (e *restartEnv) redisNodes(t *testing.T, addrs ...string) []service.Node {
	t.Helper()
	if len(addrs) == 0 {
		for _, n := range e.nodes {
			addrs = append(addrs, n.Addr())
		}
	}
	var ns []service.Node
	for _, addr := range addrs {
		rn := service.NewRedisNode(addr, service.RedisOptions{})
		t.Cleanup(func() { rn.Close() })
		ns = append(ns, rn)
	}
	return ns
}

// lockerWith is lockerAt with options; MaxTTL and NodeTimeout are the
// suite's (3s, 1s) unless set.
func (e *restartEnv) lockerWith(t *testing.T, addrs []string, opts service.Options) *service.Locker {
	t.Helper()
	return e.start(t, e.redisNodes(t, addrs...), opts)
}

// start is lockerWith on the nodes ns.
func (e *restartEnv) start(t *testing.T, ns []service.Node, opts service.Options) *service.Locker {
	t.Helper()
	if opts.MaxTTL == 0 {
		opts.MaxTTL = 3 * time.Second
	}
	if opts.NodeTimeout == 0 {
		opts.NodeTimeout = time.Second
	}
	l, err := service.New(ns, e.db, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Close)
	if err := l.Init(t.Context()); err != nil {
		t.Fatal(err)
	}
	return l
}

// holdOnFirstThree makes A hold key on nodes 0-2 only, for 3 s: nodes 3 and
// 4 are held by someone else while A acquires, and freed afterwards.
func (e *restartEnv) holdOnFirstThree(t *testing.T, l *service.Locker, key string) *service.Grant {
	t.Helper()
	return e.holdOnFirstThreeFor(t, l, key, 3*time.Second)
}

// holdOnFirstThreeFor is holdOnFirstThree with A's TTL.
func (e *restartEnv) holdOnFirstThreeFor(t *testing.T, l *service.Locker, key string, ttl time.Duration) *service.Grant {
	t.Helper()
	ctx := t.Context()
	rkey := "redfence:lock:" + key
	scripts := make([]int64, len(e.raw))
	for i, c := range e.raw[3:] {
		if err := c.Set(ctx, rkey, "someone-else", time.Minute).Err(); err != nil {
			t.Fatal(err)
		}
		scripts[3+i] = scriptCalls(t, c)
	}
	a, err := l.Acquire(ctx, key, service.Request{TTL: ttl})
	if err != nil {
		t.Fatalf("A: %v", err)
	}
	// A's grant returned once a majority answered: wait until nodes 3 and 4
	// ran A's (refused) acquire script too, so that it cannot land after
	// someone-else's keys are removed.
	for i, c := range e.raw[3:] {
		testutil.WaitFor(t, 30*time.Second, "A's acquire to reach the held nodes", func() (bool, error) {
			return scriptCalls(t, c) > scripts[3+i], nil
		})
	}
	for _, c := range e.raw[3:] {
		if err := c.Del(ctx, rkey).Err(); err != nil {
			t.Fatal(err)
		}
	}
	return a
}

// scriptCalls is how many Lua scripts node c has run to the end. An
// EVALSHA answered NOSCRIPT (a failed call) does not count: the EVAL that
// replaces it is still to come.
func scriptCalls(t *testing.T, c *redis.Client) int64 {
	t.Helper()
	info, err := c.Info(t.Context(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for line := range strings.Lines(info) {
		for _, cmd := range []string{"cmdstat_evalsha:", "cmdstat_eval:"} {
			rest, ok := strings.CutPrefix(strings.TrimSpace(line), cmd)
			if !ok {
				continue
			}
			stats := map[string]int64{}
			for f := range strings.SplitSeq(rest, ",") {
				k, v, _ := strings.Cut(f, "=")
				if i, err := strconv.ParseInt(v, 10, 64); err == nil {
					stats[k] = i
				}
			}
			if _, ok := stats["calls"]; !ok {
				t.Fatalf("commandstats %q: no calls count", line)
			}
			n += stats["calls"] - stats["failed_calls"] - stats["rejected_calls"]
		}
	}
	return n
}

func (e *restartEnv) restartEmpty(t *testing.T, i int) {
	t.Helper()
	if err := e.nodes[i].Kill(); err != nil {
		t.Fatal(err)
	}
	if err := e.nodes[i].Start(t.Context()); err != nil {
		t.Fatal(err)
	}
}

// waitQuarantineOver polls the Locker's view until no node is quarantined.
func waitQuarantineOver(t *testing.T, l *service.Locker) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		quarantined := false
		for _, st := range l.Nodes(t.Context()) {
			quarantined = quarantined || !st.QuarantinedUntil.IsZero()
		}
		if !quarantined {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("quarantine did not end")
		}
		time.Sleep(20 * time.Millisecond) // polling an observable condition
	}
}

// TestLocker_NodeRestart: a node killed and restarted at once without
// persistence while a lock on it is held must not let a second client win.
func TestLocker_NodeRestart(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	l := e.locker(t, e.db)
	for i, st := range l.Nodes(t.Context()) {
		if !st.QuarantinedUntil.IsZero() {
			t.Fatalf("node %d quarantined at a brand-new cluster's first start", i)
		}
	}
	const trials = 3
	for trial := range trials {
		key := fmt.Sprintf("restart-%d", trial)
		a := e.holdOnFirstThree(t, l, key)
		e.restartEmpty(t, 0)
		// Nodes 0, 3 and 4 are now free, a majority: only quarantine
		// stops B.
		b, err := l.Acquire(t.Context(), key, service.Request{TTL: time.Second})
		if err == nil {
			t.Fatalf("trial %d: B granted (token %d) while A (token %d) holds the lock: two holders", trial, b.Fencing, a.Fencing)
		}
		var se *service.Error
		if !errors.As(err, &se) || se.Nodes[0].Outcome != service.Quarantined {
			t.Fatalf("trial %d: B = %v; want refused with node 0 quarantined", trial, err)
		}
		if st := l.Nodes(t.Context()); st[0].QuarantinedUntil.IsZero() {
			// Recording runs in the background; the next status shows it.
			waitQuarantined(t, l, 0)
		}
		// A server started now (a restart of Redfence) agrees.
		l2 := e.locker(t, e.db)
		if st := l2.Nodes(t.Context()); st[0].QuarantinedUntil.IsZero() {
			t.Errorf("trial %d: a second server does not see node 0's quarantine", trial)
		}
		// A's 3 s lease may have run out by now on a loaded machine: the
		// release only tidies up (the quarantine outlasts it anyway).
		if err := l.Release(context.Background(), key, a.Token); err != nil && !errors.Is(err, service.ErrNotHolder) {
			t.Fatal(err)
		}
		waitQuarantineOver(t, l)
		// After the quarantine the node counts again.
		g, err := l.Acquire(t.Context(), key, service.Request{TTL: time.Second})
		if err != nil {
			t.Fatalf("trial %d: acquire after the quarantine: %v", trial, err)
		}
		_ = l.Release(t.Context(), key, g.Token)
	}
}

// TestLocker_NodesFindsRestart: a node restarted without its data is
// reported quarantined by the first Nodes call (GET /v1/nodes, /readyz),
// before any acquire reaches it.
func TestLocker_NodesFindsRestart(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	l := e.locker(t, e.db)
	for i, st := range l.Nodes(t.Context()) {
		if !st.QuarantinedUntil.IsZero() || !st.Up {
			t.Fatalf("node %d: %+v at a brand-new cluster's first start; want up, not quarantined", i, st)
		}
	}
	e.restartEmpty(t, 2)
	st := l.Nodes(t.Context())
	if st[2].QuarantinedUntil.IsZero() {
		t.Fatalf("node 2 restarted empty: %+v; want it quarantined", st[2])
	}
	for i, s := range st {
		if i != 2 && !s.QuarantinedUntil.IsZero() {
			t.Errorf("node %d quarantined too: %+v", i, s)
		}
	}
	// Another server agrees, from the record in Postgres.
	if st := e.locker(t, e.db).Nodes(t.Context()); st[2].QuarantinedUntil.IsZero() {
		t.Error("a second server does not see node 2's quarantine")
	}
}

func waitQuarantined(t *testing.T, l *service.Locker, i int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for l.Nodes(t.Context())[i].QuarantinedUntil.IsZero() {
		if time.Now().After(deadline) {
			t.Fatalf("node %d never quarantined", i)
		}
		time.Sleep(10 * time.Millisecond) // polling an observable condition
	}
}

// TestLocker_NodeRestartNegativeControl shows what quarantine prevents: with
// restart detection off, the same fault gives the lock to a second holder.
func TestLocker_NodeRestartNegativeControl(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	l := e.locker(t, nil)
	a := e.holdOnFirstThree(t, l, "restart")
	e.restartEmpty(t, 0)
	b, err := l.Acquire(t.Context(), "restart", service.Request{TTL: time.Second})
	if err != nil {
		t.Fatalf("without quarantine B = %v; want the (unsafe) grant this fault allows", err)
	}
	t.Logf("negative control: A holds token %d, B was granted token %d at the same time", a.Fencing, b.Fencing)
}

// TestLocker_PersistentRestart: a node with AOF (appendfsync always) that
// restarts with its data kept its marker and locks, so it is not quarantined.
func TestLocker_PersistentRestart(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, true)
	l := e.locker(t, e.db)
	a := e.holdOnFirstThree(t, l, "aof")
	addr := e.nodes[0].Addr()
	epoch, _, _, err := e.db.RegisterNode(t.Context(), addr, "unused", nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.nodes[0].Kill(); err != nil {
		t.Fatal(err)
	}
	if err := e.nodes[0].Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	_, err = l.Acquire(t.Context(), "aof", service.Request{TTL: time.Second})
	var se *service.Error
	if !errors.As(err, &se) || !errors.Is(err, service.ErrHeld) || se.Nodes[0].Outcome != service.No {
		t.Fatalf("B = %v; want ErrHeld with node 0 still holding A's key", err)
	}
	// The new process is counted out only until it is recorded as durable
	// (in the background): no quarantine, so the epoch on record stays.
	testutil.WaitFor(t, 20*time.Second, "node 0's new process recorded", func() (bool, error) {
		return l.Nodes(t.Context())[0].QuarantinedUntil.IsZero(), nil
	})
	if cur, left, _, err := e.db.RegisterNode(t.Context(), addr, "unused", nil); err != nil || cur != epoch || left != 0 {
		t.Errorf("node 0's record after a restart with its data: epoch %q (was %q), quarantine left %v, %v; want unchanged, none", cur, epoch, left, err)
	}
	if _, err := l.Acquire(t.Context(), "other", service.Request{TTL: time.Second}); err != nil {
		t.Errorf("acquire of another name: %v", err)
	}
	_ = l.Release(t.Context(), "aof", a.Token)
}

// TestLocker_SnapshotRestart: a node that restarts from an RDB snapshot
// taken before a lock was granted comes back with its epoch marker but
// without the lock: the new run_id, seen on the first connection to the new
// process, quarantines it, so a second client does not win.
func TestLocker_SnapshotRestart(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	l := e.locker(t, e.db)
	if err := e.raw[0].Save(t.Context()).Err(); err != nil { // a snapshot with the marker
		t.Fatal(err)
	}
	a := e.holdOnFirstThree(t, l, "rdb")
	e.restartEmpty(t, 0) // same directory: it loads the snapshot
	if n, err := e.raw[0].Exists(t.Context(), keyspace.NodeEpochKey(e.nodes[0].Addr())).Result(); err != nil || n != 1 {
		t.Fatalf("node 0 after the restart: marker present = %d, %v; want the snapshot's marker", n, err)
	}
	b, err := l.Acquire(t.Context(), "rdb", service.Request{TTL: time.Second})
	if err == nil {
		t.Fatalf("B granted (token %d) while A (token %d) holds the lock: two holders", b.Fencing, a.Fencing)
	}
	var se *service.Error
	if !errors.As(err, &se) || se.Nodes[0].Outcome != service.Quarantined {
		t.Fatalf("B = %v; want refused with node 0 quarantined", err)
	}
	waitQuarantined(t, l, 0)
	// A server started now agrees, from the record in Postgres.
	if st := e.locker(t, e.db).Nodes(t.Context()); st[0].QuarantinedUntil.IsZero() {
		t.Error("a second server does not see node 0's quarantine")
	}
}

// TestLocker_SnapshotRestartUnseen: server A grants a lock held on nodes
// 0-2 and stops; node 0 then restarts from a snapshot taken before the grant
// (its marker there, the lock gone) while no server runs. Server B, started
// next, finds behind node 0 a Redis process that is not the one on record
// and quarantines the node, so the lock A's client still holds is not
// granted again.
func TestLocker_SnapshotRestartUnseen(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	ctx := t.Context()
	ns := e.redisNodes(t)
	a, err := service.New(ns, e.db, service.Options{Registry: e.db, MaxTTL: 3 * time.Second, NodeTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Init(ctx); err != nil {
		t.Fatal(err)
	}
	if err := e.raw[0].Save(ctx).Err(); err != nil { // a snapshot with the marker
		t.Fatal(err)
	}
	g := e.holdOnFirstThree(t, a, "rdb")
	a.Close() // server A stops; its client still holds the lease
	for _, n := range ns {
		n.(*service.RedisNode).Close()
	}
	e.restartEmpty(t, 0) // same directory: it loads the snapshot
	if n, err := e.raw[0].Exists(ctx, keyspace.NodeEpochKey(e.nodes[0].Addr())).Result(); err != nil || n != 1 {
		t.Fatalf("node 0 after the restart: marker present = %d, %v; want the snapshot's marker", n, err)
	}
	b := e.locker(t, e.db)
	if st := b.Nodes(ctx); st[0].QuarantinedUntil.IsZero() {
		t.Errorf("node 0 restarted from a snapshot while no server ran: %+v; want it quarantined", st[0])
	}
	for i, st := range b.Nodes(ctx)[1:] {
		if !st.QuarantinedUntil.IsZero() {
			t.Errorf("node %d quarantined too: %+v", i+1, st)
		}
	}
	bg, err := b.Acquire(ctx, "rdb", service.Request{TTL: time.Second})
	if err == nil {
		t.Fatalf("B granted (token %d) while A's client (token %d) holds the lock: two holders", bg.Fencing, g.Fencing)
	}
	var se *service.Error
	if !errors.As(err, &se) || se.Nodes[0].Outcome != service.Quarantined {
		t.Fatalf("B = %v; want refused with node 0 quarantined", err)
	}
}

// TestLocker_StaleMarker: a node restarted without its data that then got a
// marker from an older epoch (as when another server's mark lands just after
// the restart) is quarantined once and marked anew by the server that
// started the quarantine, so it counts again when the quarantine ends; it is
// not found "restarted" for good.
func TestLocker_StaleMarker(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	l := e.locker(t, e.db)
	ctx := t.Context()
	e.restartEmpty(t, 0)
	var err error
	for range 3 { // the raw client's pooled connection died with the old process
		if err = e.raw[0].Set(ctx, keyspace.NodeEpochKey(e.nodes[0].Addr()), "an-older-epoch", 0).Err(); err == nil {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	// An acquire finds node 0's marker wrong and starts its quarantine; it
	// is granted on the other four.
	g, err := l.Acquire(ctx, "probe", service.Request{TTL: time.Second})
	if err != nil {
		t.Fatalf("probe: %v", err)
	}
	_ = l.Release(ctx, "probe", g.Token)
	waitQuarantined(t, l, 0)
	waitQuarantineOver(t, l)
	if m, err := e.raw[0].Get(ctx, keyspace.NodeEpochKey(e.nodes[0].Addr())).Result(); err != nil || m == "an-older-epoch" {
		t.Fatalf("node 0's marker = %q, %v; want the epoch of its quarantine", m, err)
	}
	// Node 0 counts again: with nodes 3 and 4 held by someone else, a grant
	// needs it.
	key := "stale-marker"
	for _, c := range e.raw[3:] {
		if err := c.Set(ctx, "redfence:lock:"+key, "someone-else", time.Minute).Err(); err != nil {
			t.Fatal(err)
		}
	}
	g, err = l.Acquire(ctx, key, service.Request{TTL: time.Second})
	if err != nil {
		t.Fatalf("acquire that needs node 0 after its quarantine: %v", err)
	}
	_ = l.Release(ctx, key, g.Token)
}

// TestLocker_AliasedAddress: two servers that spell one node's address
// differently (an IP on one, a host name on the other) keep apart markers
// and registry entries: the new spelling is quarantined once, when first
// registered (it could be a node just restarted), and after that neither
// server takes the other's marks for a memory loss; a real restart is still
// found by both.
func TestLocker_AliasedAddress(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	ctx := t.Context()
	l1 := e.locker(t, e.db)
	addrs := make([]string, len(e.nodes))
	for i, n := range e.nodes {
		addrs[i] = n.Addr()
	}
	_, port, err := net.SplitHostPort(addrs[0])
	if err != nil {
		t.Fatal(err)
	}
	addrs[0] = net.JoinHostPort("localhost", port)
	l2 := e.lockerAt(t, e.db, addrs)
	if st := l2.Nodes(ctx)[0]; st.QuarantinedUntil.IsZero() {
		t.Errorf("a node address first seen while a server runs: %+v; want it quarantined", st)
	}
	if st := l1.Nodes(ctx)[0]; !st.QuarantinedUntil.IsZero() {
		t.Errorf("the first server's node 0: %+v; want not quarantined", st)
	}
	waitQuarantineOver(t, l2)
	for round := range 3 {
		for j, l := range []*service.Locker{l1, l2} {
			if st := l.Nodes(ctx)[0]; !st.QuarantinedUntil.IsZero() || !st.Up {
				t.Fatalf("round %d, server %d: node 0 = %+v; want up, not quarantined", round, j+1, st)
			}
			name := fmt.Sprintf("alias-%d-%d", round, j)
			g, err := l.Acquire(ctx, name, service.Request{TTL: time.Second})
			if err != nil {
				t.Fatalf("round %d, server %d: %v", round, j+1, err)
			}
			if err := l.Release(ctx, name, g.Token); err != nil {
				t.Fatalf("round %d, server %d: release: %v", round, j+1, err)
			}
		}
	}
	e.restartEmpty(t, 0)
	for _, l := range []*service.Locker{l1, l2} {
		waitQuarantined(t, l, 0)
	}
}

// TestLocker_LegacyMarker: a node that holds the epoch on record under the
// marker key of earlier versions (one key for all addresses) has it carried
// over at Init and is not quarantined, so upgrading the servers stops no
// grants; a node with no marker at all is still quarantined.
func TestLocker_LegacyMarker(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	ctx := t.Context()
	_ = e.locker(t, e.db) // registers the nodes and marks them
	for i, n := range e.nodes {
		key := keyspace.NodeEpochKey(n.Addr())
		epoch, err := e.raw[i].Get(ctx, key).Result()
		if err != nil {
			t.Fatal(err)
		}
		// As an earlier version left it: the legacy key only; node 4
		// restarted without its data, so it has none.
		if i < 4 {
			if err := e.raw[i].Set(ctx, keyspace.LegacyNodeEpochKey, epoch, 0).Err(); err != nil {
				t.Fatal(err)
			}
		}
		if err := e.raw[i].Del(ctx, key).Err(); err != nil {
			t.Fatal(err)
		}
	}
	l := e.locker(t, e.db)
	for i, st := range l.Nodes(ctx) {
		if quarantined := !st.QuarantinedUntil.IsZero(); quarantined != (i == 4) {
			t.Errorf("node %d after the upgrade: %+v; want quarantined only for node 4 (no marker at all)", i, st)
		}
	}
	if _, err := l.Acquire(ctx, "after-upgrade", service.Request{TTL: time.Second}); err != nil {
		t.Errorf("acquire after the upgrade = %v; want granted", err)
	}
}

// TestLocker_EvictingNode: a node configured at run time to evict keys (a
// maxmemory limit and an evicting policy) is counted out within the check
// interval, so a lease it then evicts gives no second holder; a second
// server sees the quarantine on record. Once the node stops evicting, it
// counts again after the quarantine.
func TestLocker_EvictingNode(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	logs := &testutil.Buffer{}
	l := e.lockerWith(t, nil, service.Options{Registry: e.db, Logger: slog.New(slog.NewJSONHandler(logs, nil))})
	ctx := t.Context()
	a := e.holdOnFirstThree(t, l, "evicted")
	for _, kv := range [][2]string{{"maxmemory-policy", "volatile-lru"}, {"maxmemory", "1gb"}} {
		if err := e.raw[0].ConfigSet(ctx, kv[0], kv[1]).Err(); err != nil {
			t.Fatal(err)
		}
	}
	waitQuarantined(t, l, 0)
	if r := l.Nodes(ctx)[0].QuarantineReason; r != service.QuarantineEvicting {
		t.Errorf("node 0 quarantined for %q; want %q", r, service.QuarantineEvicting)
	}
	// The log names the cause: no restart happened.
	testutil.WaitFor(t, 20*time.Second, "the log to say node 0 is counted out for eviction", func() (bool, error) {
		return strings.Contains(logs.String(), `"msg":"node counted out for eviction, and recorded for the other servers`), nil
	})
	if strings.Contains(logs.String(), "restarted") {
		t.Errorf("an eviction spell logged as a restart:\n%s", logs)
	}
	if st := e.locker(t, e.db).Nodes(ctx); st[0].QuarantinedUntil.IsZero() || st[0].QuarantineReason != service.QuarantineEvicting {
		t.Errorf("a second server sees node 0 as %+v; want counted out as evicting", st[0])
	}
	// The node evicts A's lease: nodes 1 and 2 alone still hold it.
	if err := e.raw[0].Del(ctx, "redfence:lock:evicted").Err(); err != nil {
		t.Fatal(err)
	}
	if g, err := l.Acquire(ctx, "evicted", service.Request{TTL: 3 * time.Second}); err == nil {
		t.Fatalf("B granted %d while A (%d) holds the lock on 2 nodes and node 0 may evict", g.Fencing, a.Fencing)
	}
	if err := e.raw[0].ConfigSet(ctx, "maxmemory-policy", "noeviction").Err(); err != nil {
		t.Fatal(err)
	}
	// Seen to stop evicting at the next check; quarantined on, as evicted.
	testutil.WaitFor(t, 20*time.Second, "node 0 seen to stop evicting", func() (bool, error) {
		return l.Nodes(ctx)[0].QuarantineReason != service.QuarantineEvicting, nil
	})
	if st := l.Nodes(ctx)[0]; st.QuarantineReason != service.QuarantineEvicted || st.QuarantinedUntil.IsZero() {
		t.Errorf("node 0 once it stopped evicting: %+v; want quarantined as %q", st, service.QuarantineEvicted)
	}
	testutil.WaitFor(t, 60*time.Second, "node 0 to count again", func() (bool, error) {
		return l.Nodes(ctx)[0].QuarantinedUntil.IsZero(), nil
	})
	testutil.WaitFor(t, 60*time.Second, "the log to say node 0's quarantine is over", func() (bool, error) {
		return strings.Contains(logs.String(), `"msg":"node's quarantine is over: its votes count again","node":"`+e.nodes[0].Addr()+`"`), nil
	})
	if _, err := l.Acquire(ctx, "evicted", service.Request{TTL: 3 * time.Second, Wait: 10 * time.Second}); err != nil {
		t.Fatalf("acquire once A's lease ended and node 0 counts: %v", err)
	}
}

// TestLocker_EvictionSpellBetweenChecks: a node that evicts A's lease in a
// spell shorter than any check (a limit set, a write that evicts, the limit
// undone, all in one pipeline) is counted out by its evicted_keys, so B is
// not granted while A holds the lock on the two other nodes; a second
// server sees the quarantine on record.
func TestLocker_EvictionSpellBetweenChecks(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	logs := &testutil.Buffer{}
	// A lease and a quarantine that outlast a slow run of the test.
	l := e.lockerWith(t, nil, service.Options{Registry: e.db, MaxTTL: 30 * time.Second, Logger: slog.New(slog.NewJSONHandler(logs, nil))})
	ctx := t.Context()
	a := e.holdOnFirstThreeFor(t, l, "spell", 30*time.Second)
	cmds, err := e.raw[0].Pipelined(ctx, func(p redis.Pipeliner) error {
		p.ConfigSet(ctx, "maxmemory-policy", "volatile-lru")
		p.ConfigSet(ctx, "maxmemory", "1")
		p.Set(ctx, "spell-trigger", "x", 0) // evicts every key with a TTL, then is refused (OOM)
		p.ConfigSet(ctx, "maxmemory", "0")
		p.ConfigSet(ctx, "maxmemory-policy", "noeviction")
		return nil
	})
	if err != nil && !strings.Contains(err.Error(), "OOM") {
		t.Fatal(err)
	}
	for _, c := range []redis.Cmder{cmds[0], cmds[1], cmds[3], cmds[4]} {
		if c.Err() != nil {
			t.Fatalf("%v: %v", c.Args(), c.Err())
		}
	}
	if n, err := e.raw[0].Exists(ctx, "redfence:lock:spell").Result(); err != nil || n != 0 {
		t.Fatalf("A's key on node 0 after the spell: exists = %d, %v; want evicted", n, err)
	}
	waitQuarantined(t, l, 0)
	if r := l.Nodes(ctx)[0].QuarantineReason; r != service.QuarantineEvicted {
		t.Errorf("node 0 quarantined for %q; want %q", r, service.QuarantineEvicted)
	}
	if g, err := l.Acquire(ctx, "spell", service.Request{TTL: 3 * time.Second}); err == nil {
		t.Fatalf("B granted %d while A (%d) holds the lock on 2 nodes and node 0 evicted its lease", g.Fencing, a.Fencing)
	}
	// Logged once the quarantine is on record.
	testutil.WaitFor(t, 30*time.Second, "the log to say node 0 is counted out for eviction", func() (bool, error) {
		return strings.Contains(logs.String(), `"msg":"node counted out for eviction, and recorded for the other servers`), nil
	})
	if st := e.lockerWith(t, nil, service.Options{Registry: e.db, MaxTTL: 30 * time.Second}).Nodes(ctx); st[0].QuarantinedUntil.IsZero() {
		t.Errorf("a second server sees node 0 as %+v; want it quarantined", st[0])
	}
}

// TestLocker_ExtendQuarantinedNode: A holds a lock on nodes 0-2 and node 2
// restarts empty. Its "not held" does not count: the extend cannot reach a
// majority (503, node 2 quarantined) instead of declaring the lock lost, and
// A's lease stays on nodes 0 and 1 until its deadline, which the quarantine
// keeps exclusive.
func TestLocker_ExtendQuarantinedNode(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	l := e.locker(t, e.db)
	ctx := t.Context()
	a := e.holdOnFirstThree(t, l, "extended")
	e.restartEmpty(t, 2)
	waitQuarantined(t, l, 2)
	_, err := l.Extend(ctx, "extended", a.Token, 3*time.Second)
	var se *service.Error
	if !errors.As(err, &se) || !errors.Is(err, service.ErrQuorum) || errors.Is(err, service.ErrLost) {
		t.Fatalf("Extend with node 2 restarted = %v; want ErrQuorum, not ErrLost", err)
	}
	if o := se.Nodes[2].Outcome; o != service.Quarantined {
		t.Errorf("node 2's outcome = %v; want %v", o, service.Quarantined)
	}
	for i := range 2 {
		if n, err := e.raw[i].Exists(ctx, "redfence:lock:extended").Result(); err != nil || n != 1 {
			t.Errorf("node %d: A's key exists = %d, %v; want kept after a 503", i, n, err)
		}
	}
	if g, err := l.Acquire(ctx, "extended", service.Request{TTL: time.Second}); err == nil {
		t.Fatalf("B granted %d during A's lease (%d)", g.Fencing, a.Fencing)
	}
}

// TestLocker_ExtendClockSteppedBack: A holds a lock on nodes 0-2, whose
// clocks then step back by an hour (Redis expires keys by its wall clock, so
// A's keys there outlive their TTL by the step: PEXPIRE stands in for it).
// An extend reports the lease a majority kept, but never more than MaxTTL:
// node 0 then restarts empty and is quarantined for MaxTTL (plus drift), and
// B, granted by nodes 0, 3 and 4 once that is over, must find A's deadline
// passed. Reporting the hour (as the extend did) gave A a deadline an hour
// past B's grant: two holders, each within its lease.
func TestLocker_ExtendClockSteppedBack(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	l := e.locker(t, e.db)
	ctx := t.Context()
	const key = "stepped"
	a := e.holdOnFirstThree(t, l, key)
	for _, c := range e.raw[:3] {
		if ok, err := c.PExpire(ctx, "redfence:lock:"+key, time.Hour).Result(); err != nil || !ok {
			t.Fatalf("PEXPIRE = %v, %v", ok, err)
		}
	}
	ext, err := l.Extend(ctx, key, a.Token, time.Second)
	if err != nil {
		t.Fatalf("Extend = %v", err)
	}
	if lease, maxTTL := ext.Expires.Sub(ext.Start), 3*time.Second; lease > maxTTL {
		t.Errorf("Extend reports a lease of %v; want at most MaxTTL (%v)", lease, maxTTL)
	}
	e.restartEmpty(t, 0)
	waitQuarantined(t, l, 0)
	waitQuarantineOver(t, l)
	b, err := l.Acquire(ctx, key, service.Request{TTL: time.Second})
	if err != nil {
		t.Fatalf("B after node 0's quarantine: %v", err)
	}
	if now := time.Now(); now.Before(ext.Expires) {
		t.Errorf("B granted token %d while A (token %d) holds the lock for %v more: two holders", b.Fencing, a.Fencing, ext.Expires.Sub(now))
	}
}

// gatedRegistry holds every QuarantineNode until gate is closed.
type gatedRegistry struct {
	*store.DB
	gate chan struct{}
}

func (r gatedRegistry) QuarantineNode(ctx context.Context, addr, expected, next, runID string, durable bool, d time.Duration) (string, time.Duration, error) {
	select {
	case <-r.gate:
	case <-ctx.Done():
		return "", 0, ctx.Err()
	}
	return r.DB.QuarantineNode(ctx, addr, expected, next, runID, durable, d)
}

// quarantinedVotes reports every acquire answer counted as quarantined.
type quarantinedVotes struct {
	votes chan string
}

func (o quarantinedVotes) NodeOp(addr, op string, outcome service.Outcome, _ time.Duration) {
	if op == "acquire" && outcome == service.Quarantined {
		o.votes <- addr
	}
}
func (quarantinedVotes) Waiting(int)                  {}
func (quarantinedVotes) Quarantine(string, time.Time) {}

// TestLocker_RestartHandledElsewhere: three nodes restart empty while server
// B is idle; server A finds it, marks them with a new epoch, and the
// quarantine runs out. B's first acquire afterwards finds them with a marker
// it does not know (and new run_ids), so they do not count until B has read
// the record (held here until their answers came in): the acquire then tries
// again at once and is granted, rather than refused for a quarantine that
// is already over.
func TestLocker_RestartHandledElsewhere(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	a := e.locker(t, e.db)
	reg := gatedRegistry{DB: e.db, gate: make(chan struct{})}
	obs := quarantinedVotes{votes: make(chan string, 16)}
	addrs := make([]string, len(e.nodes))
	for i, n := range e.nodes {
		addrs[i] = n.Addr()
	}
	b := e.lockerWith(t, addrs, service.Options{Registry: reg, Observer: obs}) // B knows the run_ids, and sends nothing yet
	ctx := t.Context()
	for i := range 3 {
		e.restartEmpty(t, i)
	}
	for i := range 3 {
		waitQuarantined(t, a, i)
	}
	waitQuarantineOver(t, a)
	go func() {
		for range 3 {
			<-obs.votes
		}
		close(reg.gate)
	}()
	g, err := b.Acquire(ctx, "after", service.Request{TTL: time.Second})
	if err != nil {
		t.Fatalf("B's first acquire after the quarantine ended: %v; want granted", err)
	}
	if err := b.Release(ctx, "after", g.Token); err != nil {
		t.Fatal(err)
	}
	for i, st := range b.Nodes(ctx) {
		if !st.QuarantinedUntil.IsZero() {
			t.Errorf("B reports node %d quarantined until %v", i, st.QuarantinedUntil)
		}
	}
}

// TestRedisNode_Durability: a node counts as keeping every write it
// acknowledged only with appendonly yes, appendfsync always and
// no-appendfsync-on-rewrite no (with it on, writes are not fsynced while a
// save or rewrite runs).
func TestRedisNode_Durability(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, true)
	n := service.NewRedisNode(e.nodes[0].Addr(), service.RedisOptions{})
	t.Cleanup(func() { n.Close() })
	ctx := t.Context()
	if _, durable, err := n.ServerID(ctx); err != nil || !durable {
		t.Fatalf("ServerID with appendfsync always = durable %v, %v; want durable", durable, err)
	}
	if err := e.raw[0].ConfigSet(ctx, "no-appendfsync-on-rewrite", "yes").Err(); err != nil {
		t.Fatal(err)
	}
	if _, durable, err := n.ServerID(ctx); err != nil || durable {
		t.Errorf("ServerID with no-appendfsync-on-rewrite yes = durable %v, %v; want not durable", durable, err)
	}
}

// TestLocker_SharedNodes: a node reports the restarts it sees to one Locker
// only, so a second Locker given the same Node values is refused at Init
// (ErrNodeShared) rather than left blind to restarts; a second Init of the
// first is fine.
func TestLocker_SharedNodes(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	ns := e.redisNodes(t)
	opts := service.Options{Registry: e.db, MaxTTL: 3 * time.Second, NodeTimeout: time.Second}
	var ls []*service.Locker
	for range 2 {
		l, err := service.New(ns, e.db, opts)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(l.Close)
		ls = append(ls, l)
	}
	if err := ls[0].Init(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := ls[1].Init(t.Context()); !errors.Is(err, service.ErrNodeShared) {
		t.Errorf("Init of a second Locker on the same nodes = %v; want ErrNodeShared", err)
	}
	if err := ls[0].Init(t.Context()); err != nil {
		t.Errorf("second Init of the first Locker = %v", err)
	}
}

// waitStarts reports every start of a wait of a blocking acquire.
type waitStarts struct{ started chan struct{} }

func (w waitStarts) Waiting(delta int) {
	if delta > 0 {
		w.started <- struct{}{}
	}
}
func (waitStarts) NodeOp(string, string, service.Outcome, time.Duration) {}
func (waitStarts) Quarantine(string, time.Time)                          {}

// aclNodes creates the ACL user name on every node of e with rules, and
// returns a RedisNode for each that logs in as it.
func (e *restartEnv) aclNodes(t *testing.T, name, rules string) []service.Node {
	t.Helper()
	const password = "acl-test-password"
	args := []any{"acl", "setuser", name, "reset", "on", ">" + password}
	for r := range strings.FieldsSeq(rules) {
		args = append(args, r)
	}
	var ns []service.Node
	for i, c := range e.raw {
		if err := c.Do(t.Context(), args...).Err(); err != nil {
			t.Fatalf("ACL SETUSER %s: %v", name, err)
		}
		rn := service.NewRedisNode(e.nodes[i].Addr(), service.RedisOptions{Username: name, Password: password})
		t.Cleanup(func() { rn.Close() })
		ns = append(ns, rn)
	}
	return ns
}

// aclLocker is an initialised Locker on e's nodes as the ACL user
// "redfence" with service.RedisACL (see aclNodes), closed when the test ends.
func (e *restartEnv) aclLocker(t *testing.T) *service.Locker {
	t.Helper()
	return e.start(t, e.aclNodes(t, "redfence", service.RedisACL), service.Options{Registry: e.db, MaxTTL: 30 * time.Second})
}

// initRefused checks that Init of a Locker on ns fails with an error
// matching want that names every node of e, and returns the Locker's log
// (the Locker is closed).
func (e *restartEnv) initRefused(t *testing.T, ns []service.Node, want error) string {
	t.Helper()
	var logs testutil.Buffer
	l, err := service.New(ns, e.db, service.Options{Registry: e.db, MaxTTL: 30 * time.Second, NodeTimeout: time.Second,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	err = l.Init(t.Context())
	l.Close()
	if !errors.Is(err, want) {
		t.Fatalf("Init = %v; want %v", err, want)
	}
	for _, n := range e.nodes {
		if !strings.Contains(err.Error(), n.Addr()) {
			t.Errorf("Init's error does not name node %s: %v", n.Addr(), err)
		}
	}
	return logs.String()
}

// TestLocker_ACLUser: a Redis user with service.RedisACL (the rules README
// gives) can do everything: Init finds every process, locks are acquired,
// extended and released, and a waiter of another Locker is woken by the
// release's Pub/Sub message (its own retry delay is longer than its wait).
// Init refuses nodes that refuse INFO (ErrCommandRefused): restarts from a
// snapshot, aliases and eviction could not be found on them. A user
// without the channels can still release.
func TestLocker_ACLUser(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	newLocker := func(ns []service.Node, log *testutil.Buffer, retry time.Duration, obs service.Observer) *service.Locker {
		t.Helper()
		l, err := service.New(ns, e.db, service.Options{
			Registry: e.db, MaxTTL: 30 * time.Second, NodeTimeout: time.Second,
			RetryDelayMin: retry, RetryDelayMax: retry, Observer: obs,
			Logger: slog.New(slog.NewTextHandler(log, nil)),
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(l.Close)
		if err := l.Init(t.Context()); err != nil {
			t.Fatalf("Init: %v", err)
		}
		return l
	}
	var log1, log2 testutil.Buffer
	waiting := waitStarts{make(chan struct{}, 1)}
	l1 := newLocker(e.aclNodes(t, "redfence", service.RedisACL), &log1, 10*time.Millisecond, nil)
	l2 := newLocker(e.aclNodes(t, "redfence", service.RedisACL), &log2, time.Hour, waiting)
	for i, st := range l1.Nodes(t.Context()) {
		if st.Err != nil || !st.Up {
			t.Errorf("node %d with the ACL user: up %v, %v", i, st.Up, st.Err)
		}
	}
	ctx := t.Context()
	g, err := l1.Acquire(ctx, "acl", service.Request{TTL: 10 * time.Second})
	if err != nil {
		t.Fatalf("acquire as the ACL user: %v", err)
	}
	if _, err := l1.Extend(ctx, "acl", g.Token, 20*time.Second); err != nil {
		t.Fatalf("extend as the ACL user: %v", err)
	}
	waited := make(chan error, 1)
	go func() {
		// Ended by its context rather than its wait, which would make a
		// last try as the wait ends.
		wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		w, err := l2.Acquire(wctx, "acl", service.Request{TTL: 10 * time.Second, Wait: 50 * time.Second})
		if err == nil && w.Fencing <= g.Fencing {
			err = fmt.Errorf("waiter's token %d not above the holder's %d", w.Fencing, g.Fencing)
		}
		waited <- err
	}()
	// The waiter's first try is refused (held); its next comes only with
	// the release's message.
	<-waiting.started
	// Its subscriptions are applied in the background: a release before
	// they are would be missed (then only the retry delay, an hour here,
	// would wake it).
	testutil.WaitFor(t, 10*time.Second, "the waiter's subscriptions", func() (bool, error) {
		for _, c := range e.raw {
			n, err := c.PubSubNumSub(ctx, keyspace.ReleasedPrefix+"acl").Result()
			if err != nil || n[keyspace.ReleasedPrefix+"acl"] == 0 {
				return false, err
			}
		}
		return true, nil
	})
	if err := l1.Release(ctx, "acl", g.Token); err != nil {
		t.Fatalf("release as the ACL user: %v", err)
	}
	if err := <-waited; err != nil {
		t.Fatalf("waiter on another Locker, woken only by Pub/Sub: %v", err)
	}
	for _, log := range []*testutil.Buffer{&log1, &log2} {
		if strings.Contains(log.String(), "level=WARN") {
			t.Errorf("log with service.RedisACL:\n%s", log)
		}
	}

	// A user without INFO: Init refuses, naming every node.
	e.initRefused(t, e.aclNodes(t, "noinfo", service.RedisACL+" -info"), service.ErrCommandRefused)
	var log3 testutil.Buffer
	// Without the channels (Redis 7's default for a new user), the release
	// script's PUBLISH is refused after its DEL, which a script does not
	// roll back: the release still succeeds.
	nochan := strings.Replace(service.RedisACL, "&redfence:released:* ", "", 1)
	if nochan == service.RedisACL {
		t.Fatal("service.RedisACL grants no channels")
	}
	l4 := newLocker(e.aclNodes(t, "nochannels", nochan), &log3, 10*time.Millisecond, nil)
	g4, err := l4.Acquire(ctx, "acl-nochannels", service.Request{TTL: 10 * time.Second})
	if err != nil {
		t.Fatalf("acquire without channels: %v", err)
	}
	if err := l4.Release(ctx, "acl-nochannels", g4.Token); err != nil {
		t.Fatalf("release without channels: %v", err)
	}
	if st, err := l4.Status(ctx, "acl-nochannels"); err != nil || st.Held {
		t.Errorf("after the release without channels: held %v, %v", st != nil && st.Held, err)
	}
}

// TestLocker_INFORevoked: a node whose user loses INFO after Init is not
// used through new connections (whose server process would be unknown:
// perhaps restarted from a snapshot), and its eviction policy, unknown, counts
// it out; the other nodes grant on.
func TestLocker_INFORevoked(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	ctx := t.Context()
	l := e.aclLocker(t)
	if err := e.raw[0].Do(ctx, "acl", "setuser", "redfence", "-info").Err(); err != nil {
		t.Fatal(err)
	}
	if err := e.raw[0].Do(ctx, "client", "kill", "user", "redfence").Err(); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 20*time.Second, "node 0 counted out as refusing INFO", func() (bool, error) {
		st := l.Nodes(ctx)[0]
		return !st.QuarantinedUntil.IsZero() && st.QuarantineReason == service.QuarantinePolicyUnknown, nil
	})
	for i := range 3 {
		key := fmt.Sprintf("info-revoked-%d", i)
		g, err := l.Acquire(ctx, key, service.Request{TTL: 10 * time.Second})
		if err != nil {
			t.Fatalf("acquire on the 4 other nodes: %v", err)
		}
		if n, err := e.raw[0].Exists(ctx, keyspace.RedisKey(key)).Result(); err != nil || n != 0 {
			t.Errorf("%s set on the node refusing INFO (exists %d, %v)", key, n, err)
		}
		if err := l.Release(ctx, key, g.Token); err != nil {
			t.Fatal(err)
		}
	}
}

// TestLocker_WrongPassword: a server whose Redis password is wrong refuses
// to start (ErrAuth, naming each node) and changes nothing the running
// servers count on: no node's record in the Registry, no marker. Its nodes'
// refusals match ErrAuth, never ErrCommandRefused: a node that runs no
// command tells nothing of its eviction policy or restarts (counted out as
// refusing INFO, it was recorded as evicting, with a new epoch it could not
// mark, which made every other server quarantine it).
func TestLocker_WrongPassword(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	ctx := t.Context()
	l := e.aclLocker(t)
	state := func() string {
		t.Helper()
		conn, err := pgx.Connect(ctx, e.url)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		var b strings.Builder
		rows, err := conn.Query(ctx, `SELECT addr, epoch, memory_losses, coalesce(quarantined_until::text, '') FROM redfence_nodes ORDER BY addr`)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var addr, epoch, until string
			var losses int64
			if err := rows.Scan(&addr, &epoch, &losses, &until); err != nil {
				t.Fatal(err)
			}
			fmt.Fprintf(&b, "%s epoch %s losses %d until %q\n", addr, epoch, losses, until)
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		for i, c := range e.raw {
			m, err := c.Get(ctx, keyspace.NodeEpochKey(e.nodes[i].Addr())).Result()
			if err != nil {
				t.Fatal(err)
			}
			fmt.Fprintf(&b, "marker of %s: %s\n", e.nodes[i].Addr(), m)
		}
		return b.String()
	}
	before := state()

	var bad []service.Node
	for _, n := range e.nodes {
		rn := service.NewRedisNode(n.Addr(), service.RedisOptions{Username: "redfence", Password: "not-the-password"})
		t.Cleanup(func() { rn.Close() })
		bad = append(bad, rn)
	}
	rn := bad[0].(*service.RedisNode)
	if _, _, err := rn.Eviction(ctx); !errors.Is(err, service.ErrAuth) || errors.Is(err, service.ErrCommandRefused) {
		t.Errorf("Eviction with a wrong password = %v; want ErrAuth, not ErrCommandRefused", err)
	}
	if _, _, err := rn.ServerID(ctx); !errors.Is(err, service.ErrAuth) {
		t.Errorf("ServerID with a wrong password = %v; want ErrAuth", err)
	}
	logs := e.initRefused(t, bad, service.ErrAuth)
	if after := state(); after != before {
		t.Errorf("a server refused by every node changed the record or markers:\nbefore:\n%safter:\n%s\nits log:\n%s", before, after, logs)
	}
	// The running server still counts every node.
	if _, err := l.Acquire(ctx, "wrong-password", service.Request{TTL: 10 * time.Second}); err != nil {
		t.Fatalf("acquire on the running server: %v", err)
	}
	for i, st := range l.Nodes(ctx) {
		if !st.Up || !st.QuarantinedUntil.IsZero() {
			t.Errorf("node %d on the running server: %+v; want up and counted", i, st)
		}
	}
}

// TestRedisNode_ConnectRefusedError: a command that gets no connection
// because the node refuses INFO to the new connection's check (see
// WatchRestarts) fails with that refusal, not with an empty answer.
func TestRedisNode_ConnectRefusedError(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	ns := e.aclNodes(t, "noinfo", service.RedisACL+" -info")
	rn := ns[0].(*service.RedisNode)
	if err := rn.WatchRestarts(t, func(context.Context, string, bool) error { return nil }); err != nil {
		t.Fatal(err)
	}
	_, _, err := rn.Acquire(t.Context(), keyspace.RedisKey("refused"), "token", time.Second, "")
	if !errors.Is(err, service.ErrCommandRefused) || !strings.Contains(err.Error(), "info") {
		t.Errorf("acquire through a connection whose check was refused = %v; want the refusal (ErrCommandRefused)", err)
	}
}

// TestLocker_StatusQuarantined: with 3 of 5 nodes restarted without their
// data, a held lock's status cannot be told (the 2 nodes that count hold
// it; the restarted ones forgot it): Status answers ErrQuorum, not "not
// held" from the forgetful nodes.
func TestLocker_StatusQuarantined(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	l := e.locker(t, e.db)
	ctx := t.Context()
	const key = "status-quarantined"
	if _, err := l.Acquire(ctx, key, service.Request{TTL: 3 * time.Second}); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		e.restartEmpty(t, i)
	}
	st, err := l.Status(ctx, key)
	if !errors.Is(err, service.ErrQuorum) {
		t.Fatalf("status with 3 of 5 nodes restarted empty = %+v, %v; want ErrQuorum", st, err)
	}
}

// TestLocker_QuarantinedMajorityLogged: a majority of nodes that answer but
// are quarantined (restarted without their data) is an outage like a
// majority that does not answer, and the log says so, once, then says when
// each quarantine is over and the majority counts again.
func TestLocker_QuarantinedMajorityLogged(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	logs := &testutil.Buffer{}
	// The quarantines (MaxTTL) outlast a node timeout or two: a node whose
	// first answers after its restart are late on a loaded machine is
	// logged as not answering instead, until it answers within them.
	l := e.lockerWith(t, nil, service.Options{Registry: e.db, MaxTTL: 2 * time.Second, NodeTimeout: 500 * time.Millisecond,
		Logger: slog.New(slog.NewJSONHandler(logs, nil))})
	for i := range 3 {
		e.restartEmpty(t, i)
	}
	has := func(msg string) func() (bool, error) {
		return func() (bool, error) { return strings.Contains(logs.String(), msg), nil }
	}
	testutil.WaitFor(t, 30*time.Second, "the lost counting majority to be logged", func() (bool, error) {
		l.Nodes(t.Context()) // finds the restarts; then the nodes answer again, quarantined
		return has(`"level":"ERROR","msg":"fewer Redis nodes count than a majority`)()
	})
	testutil.WaitFor(t, 30*time.Second, "the three quarantines' ends to be logged", func() (bool, error) {
		return strings.Count(logs.String(), "node's quarantine is over") >= 3, nil
	})
	testutil.WaitFor(t, 30*time.Second, "the majority counting again to be logged", has(`"msg":"a majority of Redis nodes counts again"`))
	out := logs.String()
	for msg, want := range map[string]int{"fewer Redis nodes count than a majority": 1, "a majority of Redis nodes counts again": 1, "node's quarantine is over": 3} {
		if n := strings.Count(out, msg); n != want {
			t.Errorf("%q logged %d times; want %d:\n%s", msg, n, want, out)
		}
	}
	if _, err := l.Acquire(t.Context(), "after", service.Request{TTL: 500 * time.Millisecond}); err != nil {
		t.Errorf("acquire once a majority counts again = %v", err)
	}
}

// TestLocker_DurabilityTurnedOff: a node that fsyncs every write (AOF,
// appendfsync always) and has its AOF switched off at run time (CONFIG SET
// appendonly no) is recorded as no longer durable, found by the check every
// second or, first, by a new connection to it (the Locker's connections
// killed, as a timeout or a network blip does). When it restarts, its AOF
// back on but without what was written meanwhile (a lock), a server started
// after the restart, which knows only the record, quarantines it rather than
// trust it to have kept its leases.
func TestLocker_DurabilityTurnedOff(t *testing.T) {
	t.Parallel()
	for _, reconnect := range []bool{false, true} {
		t.Run(map[bool]string{false: "Polled", true: "NewConnection"}[reconnect], func(t *testing.T) {
			t.Parallel()
			ctx := t.Context()
			e := newRestartEnv(t, true)
			l := e.locker(t, e.db)
			addr := e.nodes[0].Addr()
			conn, err := pgx.Connect(ctx, e.url)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = conn.Close(context.Background()) })
			recorded := func(want bool) func() (bool, error) {
				return func() (bool, error) {
					var d *bool
					err := conn.QueryRow(ctx, `SELECT run_durable FROM redfence_nodes WHERE addr = $1`, addr).Scan(&d)
					return err == nil && d != nil && *d == want, err
				}
			}
			testutil.WaitFor(t, 20*time.Second, "node 0 recorded as durable", recorded(true))
			if err := e.raw[0].ConfigSet(ctx, "appendonly", "no").Err(); err != nil {
				t.Fatal(err)
			}
			if reconnect {
				if err := e.raw[0].Do(ctx, "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes").Err(); err != nil {
					t.Fatal(err)
				}
			}
			testutil.WaitFor(t, 20*time.Second, "node 0 recorded as no longer durable", recorded(false))
			a := e.holdOnFirstThree(t, l, "aof-off")
			l.Close()            // this server restarts too; its heartbeat still counts
			e.restartEmpty(t, 0) // its AOF back on (its configuration), without A's lock
			if n, err := e.raw[0].Exists(ctx, "redfence:lock:aof-off").Result(); err != nil || n != 0 {
				t.Fatalf("node 0 after the restart: A's key present = %d, %v; want the fault (lost)", n, err)
			}
			b, err := e.locker(t, e.db).Acquire(ctx, "aof-off", service.Request{TTL: time.Second})
			if err == nil {
				t.Fatalf("B granted (token %d) while A (token %d) holds the lock: two holders", b.Fencing, a.Fencing)
			}
			var se *service.Error
			if !errors.As(err, &se) || se.Nodes[0].Outcome != service.Quarantined {
				t.Fatalf("B = %v; want refused with node 0 quarantined", err)
			}
		})
	}
}
