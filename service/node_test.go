package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/internal/testutil"
)

// TestRedisNode_ExtendNeverShortens: on a real node, a renewal lengthens a
// lease but never shortens it, and never touches a key that does not hold
// the token.
func TestRedisNode_ExtendNeverShortens(t *testing.T) {
	n, _, admin := realNode(t, RedisOptions{})
	ctx := t.Context()
	if ok, _, err := n.Acquire(ctx, "k", "tok", time.Minute, ""); err != nil || !ok {
		t.Fatalf("Acquire = %v, %v", ok, err)
	}
	pttl := func() time.Duration {
		t.Helper()
		d, err := admin.PTTL(ctx, "k").Result()
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	if lease, prev, err := n.Extend(ctx, "k", "tok", time.Second, ""); err != nil || lease < 30*time.Second || lease > time.Minute || prev < lease || prev >= lease+4*time.Millisecond {
		t.Fatalf("Extend to 1s = %v (before: %v), %v; want the lease kept, about a minute, and the same before (rounded up to 4 ms)", lease, prev, err)
	}
	if d := pttl(); d < 30*time.Second {
		t.Errorf("after a shorter renewal the lease has %v left; want about a minute", d)
	}
	if lease, prev, err := n.Extend(ctx, "k", "tok", 10*time.Minute, ""); err != nil || lease != 10*time.Minute || prev < 30*time.Second || prev > time.Minute {
		t.Fatalf("Extend to 10m = %v (before: %v), %v; want 10m, about a minute before", lease, prev, err)
	}
	if d := pttl(); d < 5*time.Minute {
		t.Errorf("after a longer renewal the lease has %v left; want about 10 minutes", d)
	}
	if lease, prev, err := n.Extend(ctx, "k", "other", time.Hour, ""); err != nil || lease != 0 || prev != 0 {
		t.Errorf("Extend with another token = %v, %v, %v; want 0", lease, prev, err)
	}
	if d := pttl(); d > 11*time.Minute {
		t.Errorf("another token's renewal changed the lease to %v", d)
	}
	if lease, _, err := n.Extend(ctx, "absent", "tok", time.Hour, ""); err != nil || lease != 0 {
		t.Errorf("Extend of a missing key = %v, %v; want 0", lease, err)
	}
	if n, err := admin.Exists(ctx, "absent").Result(); err != nil || n != 0 {
		t.Errorf("Extend created a key: EXISTS = %d, %v", n, err)
	}
	// Restore shortens, never lengthens, and only the token's key.
	if ok, err := n.Restore(ctx, "k", "other", time.Second); err != nil || ok {
		t.Errorf("Restore with another token = %v, %v; want false", ok, err)
	}
	if ok, err := n.Restore(ctx, "k", "tok", time.Hour); err != nil || !ok {
		t.Errorf("Restore to an hour = %v, %v; want true", ok, err)
	}
	if d := pttl(); d > 10*time.Minute {
		t.Errorf("Restore lengthened the lease to %v", d)
	}
	if ok, err := n.Restore(ctx, "k", "tok", 30*time.Second); err != nil || !ok {
		t.Errorf("Restore to 30s = %v, %v; want true", ok, err)
	}
	if d := pttl(); d > 30*time.Second || d < 20*time.Second {
		t.Errorf("after Restore to 30s the lease has %v left", d)
	}
	// A key with more left than the reply can carry (a server with a
	// longer MaxTTL set it): reported short, and its lease before as more
	// than any renewal gives, so a failed extend never restores it.
	if err := admin.PExpire(ctx, "k", 40*time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	if lease, prev, err := n.Extend(ctx, "k", "tok", time.Minute, ""); err != nil || lease != (1<<27-4)*time.Millisecond || prev != lease {
		t.Errorf("Extend of a 40h lease = %v (before: %v), %v; want 2^27-4 ms for both (not lengthened: never restored)", lease, prev, err)
	}
	if d := pttl(); d < 39*time.Hour {
		t.Errorf("Extend shortened a 40h lease to %v", d)
	}
	if err := admin.PExpire(ctx, "k", 4*time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	// A node without the marker it was given (it lost its memory): the
	// renewal is refused as such, and changes nothing.
	if ok, err := n.Mark(ctx, "e1", true); err != nil || !ok {
		t.Fatalf("Mark = %v, %v", ok, err)
	}
	if lease, _, err := n.Extend(ctx, "k", "tok", 5*time.Minute, "e1"); err != nil || lease != 5*time.Minute {
		t.Errorf("Extend with the node's epoch = %v, %v; want 5m", lease, err)
	}
	if lease, _, err := n.Extend(ctx, "k", "tok", 8*time.Minute, "e2"); !errors.Is(err, ErrMemoryLost) || lease != 0 {
		t.Errorf("Extend with another epoch = %v, %v; want ErrMemoryLost", lease, err)
	}
	if d := pttl(); d > 5*time.Minute {
		t.Errorf("a refused renewal changed the lease to %v", d)
	}
}

// TestDialer_ResetsOnClose: a node connection closed with data undelivered
// is reset (SO_LINGER 0), so the kernel does not go on retransmitting a
// command its caller gave up on: the peer sees a reset, not an orderly EOF.
func TestDialer_ResetsOnClose(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	c, err := dialer(RedisOptions{DialTimeout: time.Second})(t.Context(), "tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	srv, ok := <-accepted
	if !ok {
		t.Fatal("accept failed")
	}
	defer srv.Close()
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	_, err = srv.Read(make([]byte, 1))
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("the peer's read after close = %v; want ECONNRESET (an orderly close would be io.EOF)", err)
	}
}

// TestLocker_SameServerTwice: a Redis server listed twice, under one
// address or two, would vote twice; New and Init refuse it.
func TestLocker_SameServerTwice(t *testing.T) {
	t.Parallel()
	if _, err := New([]Node{newMem("a:1"), newMem("b:1"), newMem("A:1")}, &memIssuer{}, Options{}); !errors.Is(err, ErrSameServer) {
		t.Errorf("New with a:1 and A:1 = %v; want ErrSameServer", err)
	}
	rs := clustertest.Redis(t, 3, cluster.RedisOptions{})
	_, port, err := net.SplitHostPort(rs[0].Addr())
	if err != nil {
		t.Fatal(err)
	}
	locker := func(addrs ...string) *Locker {
		nodes := make([]Node, len(addrs))
		for i, a := range addrs {
			n := NewRedisNode(a, RedisOptions{})
			t.Cleanup(func() { _ = n.Close() })
			nodes[i] = n
		}
		l, err := New(nodes, &memIssuer{}, Options{NodeTimeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(l.Close)
		return l
	}
	if err := locker(rs[0].Addr(), rs[1].Addr(), rs[2].Addr()).Init(t.Context()); err != nil {
		t.Fatalf("Init over three servers: %v", err)
	}
	err = locker(rs[0].Addr(), rs[1].Addr(), "localhost:"+port).Init(t.Context())
	if !errors.Is(err, ErrSameServer) || !strings.Contains(err.Error(), "localhost:"+port) {
		t.Fatalf("Init with %s and localhost:%s = %v; want ErrSameServer naming both", rs[0].Addr(), port, err)
	}
}

// TestGrant_ValidityFrom: counted from an instant before the round (the
// request's arrival), the validity covers the wait too, less the drift
// allowance on it, so a client whose clock runs slow by the drift factor
// still stops before the keys expire.
func TestGrant_ValidityFrom(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	const f = 0.01
	for _, tc := range []struct {
		wait, ttl time.Duration
	}{
		{0, 10 * time.Second}, {5 * time.Second, 10 * time.Second}, {30 * time.Second, 100 * time.Millisecond},
		{time.Hour, time.Second}, {time.Millisecond, time.Minute},
	} {
		start := t0.Add(tc.wait)
		drift := time.Duration(float64(tc.ttl)*f) + 2*time.Millisecond
		g := &Grant{TTL: tc.ttl, Start: start, Expires: start.Add(tc.ttl - drift), DriftFactor: f}
		v := g.ValidityFrom(t0)
		// Counted from t0 by a clock up to f slow, it must end before the
		// keys do: at start + ttl.
		if end := t0.Add(time.Duration(float64(v) * (1 + f))); end.After(start.Add(tc.ttl)) {
			t.Errorf("wait %v, ttl %v: ValidityFrom = %v; a clock %v slow counts past the keys' expiry by %v",
				tc.wait, tc.ttl, v, f, end.Sub(start.Add(tc.ttl)))
		}
		// And it counts the wait: more than the validity at the grant.
		if tc.wait >= time.Second && v <= g.Validity(start) {
			t.Errorf("wait %v, ttl %v: ValidityFrom = %v; want more than the %v left at the grant", tc.wait, tc.ttl, v, g.Validity(start))
		}
		// From the round's own start it is the plain validity.
		if got := g.ValidityFrom(start); got != g.Validity(start) {
			t.Errorf("ValidityFrom(start) = %v; want %v", got, g.Validity(start))
		}
	}
}

func TestEvictionPolicy(t *testing.T) {
	for _, tc := range []struct {
		info, want string
		err        bool
	}{
		{"# Memory\r\nused_memory:1000\r\nmaxmemory:0\r\nmaxmemory_policy:allkeys-lru\r\n", "", false},
		{"# Memory\r\nmaxmemory:1073741824\r\nmaxmemory_policy:noeviction\r\n", "", false},
		{"# Memory\r\nmaxmemory:1073741824\r\nmaxmemory_policy:volatile-lru\r\n", "volatile-lru", false},
		{"# Memory\r\nmaxmemory_policy:allkeys-lfu\r\nmaxmemory:5\r\n", "allkeys-lfu", false},
		{"# Memory\r\nused_memory:1000\r\n", "", true},
	} {
		got, err := evictionPolicy(tc.info)
		if got != tc.want || (err != nil) != tc.err || (err != nil && !errors.Is(err, errNoPolicy)) {
			t.Errorf("evictionPolicy(%q) = %q, %v; want %q (error %v)", tc.info, got, err, tc.want, tc.err)
		}
	}
}

// policyNode is a memNode whose eviction policy is policy, or err, and
// whose evicted_keys is evicted (set them with set and evict once the Locker
// runs: its checks read them).
type policyNode struct {
	*memNode
	pmu     sync.Mutex
	policy  string
	err     error
	evicted int64
}

func (n *policyNode) set(policy string, err error) {
	n.pmu.Lock()
	defer n.pmu.Unlock()
	n.policy, n.err = policy, err
}

func (n *policyNode) evict(evicted int64) {
	n.pmu.Lock()
	defer n.pmu.Unlock()
	n.evicted = evicted
}

func (n *policyNode) Eviction(context.Context) (string, int64, error) {
	n.pmu.Lock()
	defer n.pmu.Unlock()
	if n.err != nil {
		return "", -1, n.err
	}
	return n.policy, n.evicted, nil
}

func TestEvictedKeys(t *testing.T) {
	for _, tc := range []struct {
		info string
		want int64
	}{
		{"# Stats\r\ntotal_connections_received:3\r\nevicted_keys:0\r\nkeyspace_hits:1\r\n", 0},
		{"# Stats\r\nevicted_keys:12\r\n", 12},
		{"# Stats\r\nexpired_keys:4\r\n", -1},
		{"# Stats\r\nevicted_keys:x\r\n", -1},
	} {
		if got := evictedKeys(tc.info); got != tc.want {
			t.Errorf("evictedKeys(%q) = %d; want %d", tc.info, got, tc.want)
		}
	}
}

// TestLocker_EvictedBetweenChecks: a node whose evicted_keys rose since the
// last check is counted out even though it does not evict now (a limit set
// and undone between two checks), then quarantined as evicted; a count that
// started again from 0 (a restart, CONFIG RESETSTAT) is all new; a first
// reading, or a check the node did not answer, counts out nothing.
func TestLocker_EvictedBetweenChecks(t *testing.T) {
	var logs testutil.Buffer
	ns, ms := nodes(3)
	pn := &policyNode{memNode: ms[0], evicted: 7}
	ns[0] = pn
	l := newLocker(t, ns, &memIssuer{}, Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	check := func(what string, out bool, reason string) {
		t.Helper()
		l.checkEviction(t.Context())
		if counted := l.counts(0, l.opts.Now()); counted == out {
			t.Errorf("%s: node 0 counts = %v; want %v", what, counted, !out)
		}
		if st := l.Nodes(t.Context())[0]; st.QuarantineReason != reason {
			t.Errorf("%s: Nodes shows %+v; want quarantine reason %q", what, st, reason)
		}
	}
	check("evicted_keys 7 at the first check", false, "")
	check("no new eviction", false, "")
	pn.set("", context.DeadlineExceeded)
	check("no answer", false, "")
	pn.set("", nil)
	pn.evict(9)
	check("2 keys evicted since, noeviction now", true, QuarantineEvicted)
	if !strings.Contains(logs.String(), "node evicted keys since the last check") {
		t.Errorf("log = %s; want it to say keys were evicted", logs.String())
	}
	check("no new eviction after the spell", true, QuarantineEvicted)

	// Started again from 0: a second node, which restarted and evicted.
	ns2, ms2 := nodes(3)
	pn2 := &policyNode{memNode: ms2[0], evicted: 50}
	ns2[0] = pn2
	l2 := newLocker(t, ns2, &memIssuer{}, Options{})
	l2.checkEviction(t.Context())
	pn2.evict(1)
	l2.checkEviction(t.Context())
	if l2.counts(0, l2.opts.Now()) {
		t.Error("evicted_keys 50 then 1 (counted from 0 again): node 0 counts; want it counted out")
	}

	// A node that answers without evicted_keys (a proxy): warned of once.
	var logs3 testutil.Buffer
	ns3, ms3 := nodes(3)
	ns3[0] = &policyNode{memNode: ms3[0], evicted: -1}
	l3 := newLocker(t, ns3, &memIssuer{}, Options{Logger: slog.New(slog.NewTextHandler(&logs3, nil))})
	l3.checkEviction(t.Context())
	l3.checkEviction(t.Context())
	if n := strings.Count(logs3.String(), "has no evicted_keys"); n != 1 {
		t.Errorf("log = %s; want one warning that evicted_keys is missing, got %d", logs3.String(), n)
	}
	if !l3.counts(0, l3.opts.Now()) {
		t.Error("a node without evicted_keys is counted out; want it counted (its policy says noeviction)")
	}
	// One whose INFO stats failed (a timeout) says nothing: no warning.
	var logs4 testutil.Buffer
	ns4, ms4 := nodes(3)
	ns4[0] = &policyNode{memNode: ms4[0], evicted: evictedFailed}
	l4 := newLocker(t, ns4, &memIssuer{}, Options{Logger: slog.New(slog.NewTextHandler(&logs4, nil))})
	l4.checkEviction(t.Context())
	if strings.Contains(logs4.String(), "has no evicted_keys") {
		t.Errorf("log = %s; want no warning for a node whose INFO stats failed", logs4.String())
	}
}

// TestLocker_EvictionPolicyUnknown: a node whose eviction policy cannot be
// read (INFO refused, or INFO memory without it) is counted out as if it
// evicted, with the reason; one whose check merely failed (a timeout, the
// credentials refused) keeps its state.
func TestLocker_EvictionPolicyUnknown(t *testing.T) {
	for _, tc := range []struct {
		name    string
		err     error
		out     bool
		warning string
	}{
		{"Refused", fmt.Errorf("info memory: %w", ErrCommandRefused), true, "node refuses INFO"},
		{"Unreported", errNoPolicy, true, "has no maxmemory or maxmemory_policy"},
		{"Timeout", context.DeadlineExceeded, false, ""},
		// It ran no INFO: it tells nothing of the node.
		{"WrongPassword", fmt.Errorf("info memory: %w: WRONGPASS invalid username-password pair", ErrAuth), false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs testutil.Buffer
			ns, ms := nodes(3)
			ns[0] = &policyNode{memNode: ms[0], err: tc.err}
			l := newLocker(t, ns, &memIssuer{}, Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
			l.checkEviction(t.Context())
			st := l.Nodes(t.Context())[0]
			if counted := l.counts(0, l.opts.Now()); counted == tc.out {
				t.Errorf("node 0 counts = %v; want %v", counted, !tc.out)
			}
			if tc.out && (st.QuarantinedUntil.IsZero() || st.QuarantineReason != QuarantinePolicyUnknown) {
				t.Errorf("Nodes shows %+v; want quarantined as %q", st, QuarantinePolicyUnknown)
			}
			if !tc.out && !st.QuarantinedUntil.IsZero() {
				t.Errorf("Nodes shows %+v; want not quarantined", st)
			}
			if !strings.Contains(logs.String(), tc.warning) {
				t.Errorf("log = %s; want it to say %q", logs.String(), tc.warning)
			}
		})
	}
}

// TestLocker_EvictionCheckNotesReach: the background eviction check tells
// when a node does not answer, as a round does, so that tries stop
// speculating on a node gone before any round meets it; an answer (a
// refusal, the node's own error reply) is no news: a node that answers INFO
// may refuse a lock's writes, and only a round it answers says it is back.
func TestLocker_EvictionCheckNotesReach(t *testing.T) {
	ns, ms := nodes(3)
	pn := &policyNode{memNode: ms[1]}
	ns[1] = pn
	l := newLocker(t, ns, &memIssuer{}, Options{})
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{nil, true},
		{&net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}, false},
		{nil, false}, // answers INFO: not news
		{ErrCommandRefused, false},
		{errNoPolicy, false},
	} {
		pn.set("", tc.err)
		l.checkEviction(t.Context())
		if got := l.allAnswering(); got != tc.want {
			t.Errorf("eviction check answered %v: allAnswering = %v; want %v", tc.err, got, tc.want)
		}
	}
	// A round the node answers says it is back (its answer may be noted
	// after the grant returned).
	if _, err := l.Acquire(t.Context(), key, Request{TTL: time.Second}); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "node 1's answer to the round noted", func() (bool, error) {
		return l.allAnswering(), nil
	})
	pn.set("", context.DeadlineExceeded)
	l.checkEviction(t.Context())
	if l.allAnswering() {
		t.Error("allAnswering = true after a check the node did not answer")
	}
}
