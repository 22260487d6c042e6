package service

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// proc is the Redis process behind a memNode, shared by every Locker's view
// of the node (procNode).
type proc struct {
	mu      sync.Mutex
	id      string // "" while the node is down
	down    bool
	durable bool // appendfsync always
}

// procNode is one Locker's view of a memNode with a process behind it: it
// names the process (serverIdentifier) and reports new ones to that Locker
// when the test says the Locker connected to the node (restartWatcher).
type procNode struct {
	*memNode
	p    *proc
	mu   sync.Mutex
	hook func(ctx context.Context, runID string, durable bool) error
}

func (n *procNode) ServerID(ctx context.Context) (string, bool, error) {
	n.p.mu.Lock()
	defer n.p.mu.Unlock()
	if n.p.down {
		return "", false, errors.New("connection refused")
	}
	return n.p.id, n.p.durable, nil
}

func (n *procNode) WatchRestarts(_ any, f func(ctx context.Context, runID string, durable bool) error) error {
	n.mu.Lock()
	n.hook = f
	n.mu.Unlock()
	return nil
}

// connect is a new connection of this Locker to the node: its hook learns
// the process behind it.
func (n *procNode) connect(t *testing.T) {
	t.Helper()
	n.mu.Lock()
	f := n.hook
	n.mu.Unlock()
	n.p.mu.Lock()
	id, durable := n.p.id, n.p.durable
	n.p.mu.Unlock()
	if err := f(t.Context(), id, durable); err != nil {
		t.Fatal(err)
	}
}

// snapshotRestart restarts the process as id from a snapshot that holds the
// node's marker but not the lock key rkey.
func snapshotRestart(m *memNode, p *proc, id string) {
	p.mu.Lock()
	p.id, p.down = id, false
	p.mu.Unlock()
	m.mu.Lock()
	delete(m.vals, rkey)
	delete(m.ttl, rkey)
	m.mu.Unlock()
}

// recovered waits until node i's recoveries in l have all run.
func recovered(l *Locker, i int) {
	m := l.members[i]
	m.mu.Lock()
	done := m.recovery
	m.mu.Unlock()
	if done != nil {
		<-done
	}
}

// procCluster is 5 memNodes with processes, and one view of them per Locker.
type procCluster struct {
	ms    []*memNode
	procs []*proc
}

func newProcCluster() *procCluster {
	_, ms := nodes(5)
	c := &procCluster{ms: ms}
	for i := range ms {
		c.procs = append(c.procs, &proc{id: "R1-" + ms[i].addr})
	}
	return c
}

// locker starts a Locker on its own view of the nodes.
func (c *procCluster) locker(t *testing.T, reg Registry, clk *clock) (*Locker, []*procNode) {
	t.Helper()
	var ns []Node
	var views []*procNode
	for i, m := range c.ms {
		v := &procNode{memNode: m, p: c.procs[i]}
		ns, views = append(ns, v), append(views, v)
	}
	l := newLocker(t, ns, &memIssuer{}, Options{Registry: reg, Now: clk.Now, MaxTTL: time.Minute})
	if err := l.Init(t.Context()); err != nil {
		t.Fatal(err)
	}
	return l, views
}

// holdOnFirstThree makes l hold key on nodes 0-2 only.
func (c *procCluster) holdOnFirstThree(t *testing.T, l *Locker) {
	t.Helper()
	for _, m := range c.ms[3:] {
		m.set(rkey, "other", time.Second)
	}
	if _, err := l.Acquire(t.Context(), key, Request{TTL: 30 * time.Second}); err != nil {
		t.Fatalf("A: %v", err)
	}
	settle(c.ms)
	for _, m := range c.ms[3:] {
		m.set(rkey, "", 0)
	}
}

// heldCluster is a procCluster with server A started on it, holding the
// lock on nodes 0-2 only.
func heldCluster(t *testing.T) (*clock, *memRegistry, *procCluster, *Locker) {
	t.Helper()
	clk := &clock{t: time.Unix(1000, 0)}
	reg := newRegistry(clk)
	c := newProcCluster()
	a, _ := c.locker(t, reg, clk)
	c.holdOnFirstThree(t, a)
	return clk, reg, c, a
}

// setDown stops or starts node i's process (keeping its run_id).
func (c *procCluster) setDown(i int, down bool) {
	c.procs[i].mu.Lock()
	c.procs[i].down = down
	c.procs[i].mu.Unlock()
}

// TestLocker_SecondRestartSeenBehind: server A handles node 0's restart
// from a snapshot (R1 to R2) and its quarantine runs out; server B, cut off
// from the node meanwhile, still has the old epoch. The node then restarts
// from a snapshot again (R3), losing A's lock but keeping the marker A
// wrote. B, which sees R3, must not take it for the restart A handled (the
// record names R2): it quarantines the node, and does not grant the lock A
// holds.
func TestLocker_SecondRestartSeenBehind(t *testing.T) {
	clk := &clock{t: time.Unix(1000, 0)}
	reg := newRegistry(clk)
	c := newProcCluster()
	a, av := c.locker(t, reg, clk)
	b, bv := c.locker(t, reg, clk)
	epochB, _ := b.members[0].state()

	snapshotRestart(c.ms[0], c.procs[0], "R2")
	av[0].connect(t) // A sees R2; B does not
	recovered(a, 0)
	if epoch, until := a.members[0].state(); epoch == epochB || !until.After(clk.Now()) {
		t.Fatalf("A after R2: epoch %q, quarantined until %v; want a new epoch and a quarantine", epoch, until)
	}
	clk.Advance(2 * time.Minute)

	c.holdOnFirstThree(t, a)
	snapshotRestart(c.ms[0], c.procs[0], "R3")
	bv[0].connect(t)
	recovered(b, 0)
	if b.counts(0, clk.Now()) {
		t.Fatal("B counts node 0 after a restart no server handled (R3; the record names R2)")
	}
	_, err := b.Acquire(t.Context(), key, Request{TTL: time.Second})
	var e *Error
	if !errors.As(err, &e) || e.Nodes[0].Outcome != Quarantined {
		t.Fatalf("B = %v; want refused with node 0 quarantined while A holds the lock", err)
	}
	// A, on its next connection, agrees: the restart it finds is on record.
	av[0].connect(t)
	recovered(a, 0)
	if a.counts(0, clk.Now()) {
		t.Error("A counts node 0 during the quarantine B started")
	}
}

// TestLocker_RestartUnseenFirstSight: node 0 is down when server B starts;
// it comes back from a snapshot (a process not on record) while A holds a
// lock it no longer has. B's first connection to it finds the process is not
// the one on record: B counts the node out from that moment, and the
// Registry's answer keeps it out.
func TestLocker_RestartUnseenFirstSight(t *testing.T) {
	clk, reg, c, _ := heldCluster(t)
	c.setDown(0, true)
	b, bv := c.locker(t, reg, clk)
	snapshotRestart(c.ms[0], c.procs[0], "R2")
	bv[0].connect(t)
	if b.counts(0, clk.Now()) {
		t.Fatal("B counts node 0 before the Registry has answered for its first process")
	}
	recovered(b, 0)
	if b.counts(0, clk.Now()) {
		t.Fatal("B counts node 0 after its unseen restart")
	}
	if _, err := b.Acquire(t.Context(), key, Request{TTL: time.Second}); err == nil {
		t.Fatal("B granted the lock A holds")
	}

	// The process on record, first seen by a server that started while
	// the node was down: it counts once the Registry has answered.
	clk.Advance(2 * time.Minute)
	c.setDown(1, true)
	d, dv := c.locker(t, reg, clk)
	c.setDown(1, false)
	dv[1].connect(t)
	recovered(d, 1)
	if !d.counts(1, clk.Now()) {
		t.Error("D does not count node 1, whose process is the one on record")
	}
}

// gatedProcessRegistry holds every NodeProcess for addr until gate is
// closed, telling asked when one is waiting.
type gatedProcessRegistry struct {
	*memRegistry
	addr  string
	gate  chan struct{}
	asked chan struct{}
}

func (r *gatedProcessRegistry) NodeProcess(ctx context.Context, addr, runID, next string, durable bool) (string, time.Duration, error) {
	if addr != r.addr {
		return r.memRegistry.NodeProcess(ctx, addr, runID, next, durable)
	}
	r.asked <- struct{}{}
	select {
	case <-r.gate:
	case <-ctx.Done():
		return "", 0, ctx.Err()
	}
	return r.memRegistry.NodeProcess(ctx, addr, runID, next, durable)
}

// TestLocker_NodesWaitsForFirstSight: a node first seen after Init (down
// when the server started) is counted out until the Registry has answered
// for its process. Nodes, asked meanwhile (serve's report at start,
// /v1/nodes), waits for that answer rather than report the node quarantined
// for a quarantine's length: its process is the one on record, and it
// counts as soon as the answer comes (found by two fault hunts: "node
// quarantined ... quarantined_until" a minute ahead, at start under load).
func TestLocker_NodesWaitsForFirstSight(t *testing.T) {
	clk := &clock{t: time.Unix(1000, 0)}
	reg := newRegistry(clk)
	c := newProcCluster()
	c.locker(t, reg, clk) // records every node's process
	c.setDown(1, true)
	g := &gatedProcessRegistry{memRegistry: reg, addr: c.ms[1].Addr(), gate: make(chan struct{}), asked: make(chan struct{}, 16)}
	d, dv := c.locker(t, g, clk)
	c.setDown(1, false)
	dv[1].connect(t)
	<-g.asked // node 1's recovery waits for the Registry
	if d.counts(1, clk.Now()) {
		t.Fatal("D counts node 1 before the Registry has answered for its first process")
	}
	// The answer comes once Nodes has asked node 1.
	var once sync.Once
	c.ms[1].hook = func(context.Context, string) error {
		once.Do(func() { close(g.gate) })
		return nil
	}
	for _, st := range d.Nodes(t.Context()) {
		if !st.Up || !st.QuarantinedUntil.IsZero() {
			t.Errorf("node %s: up %v, quarantined until %v (%s), error %v; want up and counting", st.Addr, st.Up, st.QuarantinedUntil, st.QuarantineReason, st.Err)
		}
	}
	if !d.counts(1, clk.Now()) {
		t.Error("D does not count node 1, whose process is the one on record")
	}
}

// TestLocker_DurableRestart: a node that restarts with appendfsync always
// kept every lease it acknowledged only if the process before it fsynced
// every write too. Started on the data of one that did not (its AOF lost the
// last writes), it is quarantined; after a restart from durable to durable
// it counts again as soon as the Registry has answered.
func TestLocker_DurableRestart(t *testing.T) {
	t.Run("FromNotDurable", func(t *testing.T) {
		clk := &clock{t: time.Unix(1000, 0)}
		reg := newRegistry(clk)
		c := newProcCluster()
		a, av := c.locker(t, reg, clk)
		b, bv := c.locker(t, reg, clk)
		c.holdOnFirstThree(t, a)
		c.procs[0].durable = true
		snapshotRestart(c.ms[0], c.procs[0], "R2") // the lock lost with the writes the AOF missed
		av[0].connect(t)
		recovered(a, 0)
		if a.counts(0, clk.Now()) {
			t.Fatal("A counts node 0, restarted durable on the data of a process that was not")
		}
		bv[0].connect(t)
		recovered(b, 0)
		_, err := b.Acquire(t.Context(), key, Request{TTL: time.Second})
		var e *Error
		if !errors.As(err, &e) || e.Nodes[0].Outcome != Quarantined {
			t.Fatalf("B = %v; want refused with node 0 quarantined while A holds the lock", err)
		}
	})
	t.Run("ThenDurableToDurable", func(t *testing.T) {
		// Quarantined once for the lossy-to-durable restart, the node is
		// on record as durable: its next restart, durable to durable, is
		// not quarantined.
		clk := &clock{t: time.Unix(1000, 0)}
		reg := newRegistry(clk)
		c := newProcCluster()
		a, av := c.locker(t, reg, clk)
		c.procs[0].durable = true
		snapshotRestart(c.ms[0], c.procs[0], "R2")
		av[0].connect(t)
		recovered(a, 0)
		if a.counts(0, clk.Now()) {
			t.Fatal("A counts node 0 after the lossy-to-durable restart")
		}
		clk.Advance(2 * time.Minute)
		c.procs[0].mu.Lock()
		c.procs[0].id = "R3"
		c.procs[0].mu.Unlock()
		av[0].connect(t)
		recovered(a, 0)
		if !a.counts(0, clk.Now()) {
			t.Error("A does not count node 0 after a durable-to-durable restart")
		}
	})
	t.Run("DurableToDurable", func(t *testing.T) {
		clk := &clock{t: time.Unix(1000, 0)}
		reg := newRegistry(clk)
		c := newProcCluster()
		for _, p := range c.procs {
			p.durable = true
		}
		a, av := c.locker(t, reg, clk)
		c.holdOnFirstThree(t, a)
		c.procs[0].mu.Lock()
		c.procs[0].id = "R2" // every write kept: the lock is still there
		c.procs[0].mu.Unlock()
		av[0].connect(t)
		recovered(a, 0)
		if !a.counts(0, clk.Now()) {
			t.Error("A does not count node 0 after a restart that kept every write")
		}
		if _, err := a.Acquire(t.Context(), key, Request{TTL: time.Second}); !errors.Is(err, ErrHeld) {
			t.Errorf("acquire of the held name = %v; want ErrHeld", err)
		}
	})
}

// failingProcess is a Registry whose NodeProcess fails for node0 while
// down is set (Postgres unreachable from this server).
type failingProcess struct {
	*memRegistry
	down atomic.Bool
}

func (r *failingProcess) NodeProcess(ctx context.Context, addr, runID, next string, durable bool) (string, time.Duration, error) {
	if addr == "node0" && r.down.Load() {
		return "", 0, errors.New("postgres is down")
	}
	return r.memRegistry.NodeProcess(ctx, addr, runID, next, durable)
}

// TestLocker_InitProcessCheckFails: a server that starts while node 0 has
// restarted from a snapshot unseen, and cannot check the node's process
// against the record, counts the node out until it can: it does not grant
// the lock whose lease the node lost. The check is retried, finds the
// restart, and the node counts again once its quarantine ends.
func TestLocker_InitProcessCheckFails(t *testing.T) {
	clk, reg, c, _ := heldCluster(t)
	snapshotRestart(c.ms[0], c.procs[0], "R2") // A, idle, does not see it
	fp := &failingProcess{memRegistry: reg}
	fp.down.Store(true)
	b, _ := c.locker(t, fp, clk)
	clk.Advance(10 * time.Minute) // however long the check fails
	if b.counts(0, clk.Now()) {
		t.Fatal("B counts node 0, whose process it could not check")
	}
	if _, err := b.Acquire(t.Context(), key, Request{TTL: time.Second}); err == nil {
		t.Fatal("B granted the lock A holds")
	}
	fp.down.Store(false)
	recovered(b, 0) // the check, retried, finds the unseen restart
	if b.counts(0, clk.Now()) {
		t.Error("B counts node 0 once checked; want the restart's quarantine")
	}
	clk.Advance(2 * time.Minute)
	if !b.counts(0, clk.Now()) {
		t.Error("B still counts node 0 out after the restart's quarantine")
	}
}

// gatedRecord is a Registry that holds the recording of news of process
// hold (NodeProcess or QuarantineNode naming it) until its gate is closed,
// saying on entered when one starts.
type gatedRecord struct {
	*memRegistry
	gates   map[string]chan struct{} // run_id -> gate
	entered chan string
}

func (r *gatedRecord) wait(runID string) {
	if g, ok := r.gates[runID]; ok {
		select {
		case r.entered <- runID:
		default: // nobody listens any more (the test ended)
		}
		<-g
	}
}

func (r *gatedRecord) NodeProcess(ctx context.Context, addr, runID, next string, durable bool) (string, time.Duration, error) {
	r.wait(runID)
	return r.memRegistry.NodeProcess(ctx, addr, runID, next, durable)
}

func (r *gatedRecord) QuarantineNode(ctx context.Context, addr, expected, next, runID string, durable bool, d time.Duration) (string, time.Duration, error) {
	r.wait(runID)
	return r.memRegistry.QuarantineNode(ctx, addr, expected, next, runID, durable, d)
}

// TestLocker_RecoveryQueuedBehind: node 0 was down when server B started;
// B's first sight of it (process R1, the one on record) is being checked
// when the node restarts from a snapshot (R2). The check's answer, which
// predates the restart, does not end the quarantine B started when it saw
// R2: the node stays counted out until R2's restart is recorded, and then
// for its quarantine.
func TestLocker_RecoveryQueuedBehind(t *testing.T) {
	clk, reg, c, _ := heldCluster(t) // A records R1 for every node
	r1 := c.procs[0].id
	c.setDown(0, true)
	g := &gatedRecord{memRegistry: reg, entered: make(chan string, 4),
		gates: map[string]chan struct{}{r1: make(chan struct{}), "R2": make(chan struct{})}}
	b, bv := c.locker(t, g, clk)
	open := func(id string) { close(g.gates[id]) }
	t.Cleanup(func() { // before B's Close, which waits for its recoveries
		for _, id := range []string{r1, "R2"} {
			select {
			case <-g.gates[id]:
			default:
				open(id)
			}
		}
	})
	c.setDown(0, false)
	bv[0].connect(t) // first sight of R1: checked, held at the gate
	if got := <-g.entered; got != r1 {
		t.Fatalf("first recording names %q; want %q", got, r1)
	}
	snapshotRestart(c.ms[0], c.procs[0], "R2")
	bv[0].connect(t) // the restart, queued behind the check of R1
	open(r1)
	if got := <-g.entered; got != "R2" {
		t.Fatalf("second recording names %q; want R2", got)
	}
	// R1's check has answered (no restart, no quarantine): R2 is not
	// recorded yet.
	if b.counts(0, clk.Now()) {
		t.Fatal("B counts node 0 after R1's check answered, before R2's restart is recorded")
	}
	open("R2")
	recovered(b, 0)
	if b.counts(0, clk.Now()) {
		t.Error("B counts node 0 after its snapshot restart was recorded")
	}
	if _, err := b.Acquire(t.Context(), key, Request{TTL: time.Second}); err == nil {
		t.Error("B granted the lock A holds")
	}
}

// downRegistry is a Registry that cannot record anything while down.
type downRegistry struct {
	*memRegistry
	down atomic.Bool
}

func (r *downRegistry) QuarantineNode(ctx context.Context, addr, expected, next, runID string, durable bool, d time.Duration) (string, time.Duration, error) {
	if r.down.Load() {
		return "", 0, errors.New("postgres is down")
	}
	return r.memRegistry.QuarantineNode(ctx, addr, expected, next, runID, durable, d)
}

// TestLocker_UnrecordedRestartRetried: a restart that cannot be recorded
// (Postgres down) keeps the node counted out, however long that lasts, and
// its recording is retried: once Postgres is back, the restart is recorded
// (a quarantine for every server) and the node counts when it ends.
func TestLocker_UnrecordedRestartRetried(t *testing.T) {
	clk := &clock{t: time.Unix(1000, 0)}
	reg := &downRegistry{memRegistry: newRegistry(clk)}
	c := newProcCluster()
	a, av := c.locker(t, reg, clk)
	reg.down.Store(true)
	snapshotRestart(c.ms[0], c.procs[0], "R2")
	av[0].connect(t)
	clk.Advance(10 * time.Minute) // far past any quarantine
	if a.counts(0, clk.Now()) {
		t.Fatal("A counts node 0, whose restart it could not record")
	}
	if st := a.Nodes(t.Context()); st[0].Up && st[0].QuarantinedUntil.IsZero() {
		t.Errorf("Nodes reports node 0 %+v; want it down or quarantined while its restart is not recorded", st[0])
	}
	reg.down.Store(false)
	recovered(a, 0) // the retry, a second later
	if a.counts(0, clk.Now()) {
		t.Error("A counts node 0 right after recording its restart; want the quarantine")
	}
	if _, left, _ := reg.QuarantineNode(t.Context(), "node0", "", "x", "R2", false, 0); left <= 0 {
		t.Error("the registry records no quarantine for node 0's restart")
	}
	clk.Advance(2 * time.Minute)
	if !a.counts(0, clk.Now()) {
		t.Error("A does not count node 0 after the recorded quarantine")
	}
}

// TestLocker_RecoveryAskedAgainWhileReporting: a provisional recovery asked
// again while the same one, already answered, is still reporting (marking
// the node) runs again, so the node is not left counted out for good.
func TestLocker_RecoveryAskedAgainWhileReporting(t *testing.T) {
	clk := &clock{t: time.Unix(1000, 0)}
	reg := newRegistry(clk)
	c := newProcCluster()
	a, av := c.locker(t, reg, clk)
	epoch, _ := a.members[0].state()
	marking, release := make(chan struct{}, 1), make(chan struct{})
	c.ms[0].hook = func(_ context.Context, op string) error {
		if op == "mark" {
			marking <- struct{}{}
			<-release
		}
		return nil
	}
	snapshotRestart(c.ms[0], c.procs[0], "R2")
	av[0].connect(t) // recorded (a quarantine), then marks: held here
	<-marking
	a.recover(0, recoveryReq{seen: epoch, runID: "R2"}, true) // the same news again
	c.ms[0].hook = nil
	close(release)
	recovered(a, 0)
	clk.Advance(2 * time.Minute)
	if !a.counts(0, clk.Now()) {
		t.Error("node 0 is counted out for good after its restart was recorded twice")
	}
}

// TestLocker_StaleRecoveryFails: a recovery naming a process the node no
// longer runs (queued before the node restarted again) that fails to be
// recorded does not leave the node counted out: the current process's news
// is what counts.
func TestLocker_StaleRecoveryFails(t *testing.T) {
	clk := &clock{t: time.Unix(1000, 0)}
	reg := &downRegistry{memRegistry: newRegistry(clk)}
	c := newProcCluster()
	a, av := c.locker(t, reg, clk)
	r1 := c.procs[0].id
	epoch, _ := a.members[0].state()
	snapshotRestart(c.ms[0], c.procs[0], "R2")
	av[0].connect(t)
	recovered(a, 0)
	clk.Advance(2 * time.Minute)
	if !a.counts(0, clk.Now()) {
		t.Fatal("node 0 not counted after its recorded quarantine")
	}
	reg.down.Store(true)
	done := a.recover(0, recoveryReq{seen: epoch, runID: r1}, false) // news of R1, late
	<-done
	reg.down.Store(false)
	if !a.counts(0, clk.Now()) {
		t.Error("a failed recording of a process the node no longer runs counts the node out")
	}
}
