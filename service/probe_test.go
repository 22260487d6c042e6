package service_test

import (
	"context"
	"strings"
	"testing"
)

// TestLocker_NodesFindsRefusedWrites: a node that answers reads but refuses
// the writes of an acquire is reported down by Nodes (GET /v1/nodes,
// /readyz), with why: one whose memory is full under noeviction (the
// answer's error), one paused for writes (no answer). Both come back once
// they take writes again.
func TestLocker_NodesFindsRefusedWrites(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	l := e.locker(t, e.db)
	ctx := t.Context()
	for i, st := range l.Nodes(ctx) {
		if !st.Up || st.Err != nil {
			t.Fatalf("node %d at the start: %+v; want up", i, st)
		}
	}
	if err := e.raw[0].ConfigSet(ctx, "maxmemory", "1").Err(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.raw[0].ConfigSet(context.Background(), "maxmemory", "0") })
	if err := e.raw[1].Do(ctx, "CLIENT", "PAUSE", 600000, "WRITE").Err(); err != nil {
		t.Fatal(err)
	}
	unpause := func() { e.raw[1].Do(context.Background(), "CLIENT", "UNPAUSE") }
	t.Cleanup(unpause)
	if err := e.raw[1].Ping(ctx).Err(); err != nil { // reads still answered
		t.Fatalf("node 1 paused for writes does not answer PING: %v", err)
	}

	st := l.Nodes(ctx)
	if st[0].Up || st[0].Err == nil || !strings.Contains(st[0].Err.Error(), "refuses lock writes") || !strings.Contains(st[0].Err.Error(), "OOM") {
		t.Errorf("node 0, memory full: %+v; want down, its error saying it refuses lock writes (OOM)", st[0])
	}
	if st[1].Up || st[1].Err == nil {
		t.Errorf("node 1, paused for writes: %+v; want down", st[1])
	}
	for i := 2; i < len(st); i++ {
		if !st[i].Up {
			t.Errorf("node %d: %+v; want up", i, st[i])
		}
	}
	for i, s := range st {
		if !s.QuarantinedUntil.IsZero() {
			t.Errorf("node %d quarantined: %+v; refusing writes is not losing memory", i, s)
		}
	}

	if err := e.raw[0].ConfigSet(ctx, "maxmemory", "0").Err(); err != nil {
		t.Fatal(err)
	}
	unpause()
	for i, st := range l.Nodes(ctx) {
		if !st.Up {
			t.Errorf("node %d once it takes writes again: %+v; want up", i, st)
		}
	}
	keys, err := e.raw[2].Keys(ctx, "redfence:probe:*").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys { // the probes' keys live 1 ms
		if ttl, err := e.raw[2].PTTL(ctx, k).Result(); err == nil && ttl > 0 && ttl.Milliseconds() > 1 {
			t.Errorf("key %q left with %v to live", k, ttl)
		}
	}
}
