package service

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"
)

// TestLocker_MarkRaceRestartsQuarantine: a node lost its memory once. The
// recovery adopts the new epoch (m.epoch = cur) before its Mark lands on
// the node; an acquire of any name that reads the new epoch in that window
// and reaches the node before the Mark finds the node "without its marker"
// and queues another loss, which the registry accepts (the recorded epoch
// is the one expected), so the quarantine starts again with yet another
// epoch, whose Mark opens the same window. Under steady traffic the node's
// quarantine never ends. One loss must give one quarantine.
func TestLocker_MarkRaceRestartsQuarantine(t *testing.T) {
	ctx := context.Background()
	clk := &clock{t: time.Unix(1000, 0)}
	reg := newRegistry(clk)
	ns, ms := nodes(5)
	l := newLocker(t, ns, &memIssuer{}, Options{Registry: reg, Now: clk.Now, MaxTTL: time.Minute})
	if err := l.Init(ctx); err != nil {
		t.Fatal(err)
	}
	lost := clk.Now()
	ms[0].restart() // one memory loss, now

	m := l.members[0]
	marks, races := 0, 0
	firstMark := make(chan struct{})
	ms[0].hook = func(_ context.Context, op string) error {
		if op != "mark" {
			return nil
		}
		marks++ // marks run one at a time (one recovery per node)
		if marks == 1 {
			close(firstMark)
		}
		if races < 3 {
			races++
			// Traffic goes on while the mark is on its way: 1 s later,
			// an acquire of another name reaches node 0 just before it,
			// and its answer is noted before the mark goes on.
			clk.Advance(time.Second)
			if _, err := l.Acquire(ctx, fmt.Sprintf("other-%d", races), Request{TTL: 30 * time.Second}); err != nil {
				t.Errorf("acquire of another name: %v", err)
			}
			for {
				m.mu.Lock()
				noted := len(m.queued) > 0
				m.mu.Unlock()
				if noted {
					break
				}
				time.Sleep(time.Millisecond) // polling an observable condition
			}
		}
		return nil
	}
	// The first acquire to reach node 0 finds the loss.
	if _, err := l.Acquire(ctx, key, Request{TTL: 30 * time.Second}); err != nil {
		t.Fatalf("acquire: %v", err)
	}
	<-firstMark // the recovery runs
	m.mu.Lock()
	done := m.recovery
	m.mu.Unlock()
	if done != nil { // nil: they have all run already
		<-done // every queued recovery of node 0 has run
	}
	_, until := m.state()
	if want := lost.Add(l.quarantineFor()); until.After(want) {
		t.Errorf("node 0 quarantined until %v (%d marks, %d new epochs); one memory loss at %v needs it only until %v",
			until.Sub(lost), marks, marks, lost, want.Sub(lost))
	}
	if marks != 1 {
		t.Errorf("node 0 was re-marked %d times for one memory loss; want 1", marks)
	}
}

// TestLocker_EvictionDuringMark: an eviction spell first seen while a mark
// is under way (the node's epoch about to move on) is still recorded for
// the other servers: its quarantine is taken from the epoch current when it
// is recorded, not from the one it was seen with.
func TestLocker_EvictionDuringMark(t *testing.T) {
	ctx := context.Background()
	clk := &clock{t: time.Unix(1000, 0)}
	reg := newRegistry(clk)
	ns, ms := nodes(5)
	pn := &policyNode{memNode: ms[0]}
	ns[0] = pn
	l := newLocker(t, ns, &memIssuer{}, Options{Registry: reg, Now: clk.Now, MaxTTL: time.Minute})
	if err := l.Init(ctx); err != nil {
		t.Fatal(err)
	}
	ms[0].restart() // a memory loss: its recovery marks the node
	firstMark := make(chan struct{})
	var once sync.Once
	ms[0].hook = func(_ context.Context, op string) error {
		if op == "mark" {
			once.Do(func() {
				// While the mark is on its way, the node turns out to
				// evict, 10 s after the loss.
				clk.Advance(10 * time.Second)
				pn.set("allkeys-lru", nil)
				l.checkEviction(ctx)
				close(firstMark)
			})
		}
		return nil
	}
	lost := clk.Now()
	if _, err := l.Acquire(ctx, key, Request{TTL: 30 * time.Second}); err != nil {
		t.Fatal(err)
	}
	<-firstMark
	m := l.members[0]
	m.mu.Lock()
	done := m.recovery
	m.mu.Unlock()
	if done != nil {
		<-done
	}
	reg.mu.Lock()
	until := reg.until[ms[0].Addr()]
	reg.mu.Unlock()
	if want := lost.Add(10 * time.Second).Add(l.quarantineFor()); until.Before(want) {
		t.Errorf("recorded quarantine ends %v after the loss; want the eviction's, at least %v", until.Sub(lost), want.Sub(lost))
	}
}
