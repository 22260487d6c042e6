package service_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/redfence/redfence/internal/keyspace"
	"github.com/redfence/redfence/internal/testutil"
	"github.com/redfence/redfence/service"
)

// gatedEpochNode is a RedisNode whose first Epoch read, once answered,
// waits for gate to close before it returns: it holds a Locker's Init in
// the middle of its check for another database's marker.
type gatedEpochNode struct {
	*service.RedisNode
	once    sync.Once
	entered chan struct{}
	gate    chan struct{}
}

func (n *gatedEpochNode) Epoch(ctx context.Context) (string, error) {
	v, err := n.RedisNode.Epoch(ctx)
	n.once.Do(func() {
		close(n.entered)
		<-n.gate
	})
	return v, err
}

// TestLocker_ForeignNodeConcurrentStart: two servers that start at once on
// a database that does not know a node, which servers of another database
// marked, are both refused (ErrForeignNode), and the node's marker and the
// database are left as they were. Before, the first one's registration was
// visible before its check of the marker had answered: the second found
// the node known, adopted the epoch without a check of its own and started
// (the first then removed the record, so the second's check of the node's
// process failed for as long as it ran, the node counted out for good).
func TestLocker_ForeignNodeConcurrentStart(t *testing.T) {
	t.Parallel()
	e := newRestartEnv(t, false)
	ctx := t.Context()
	addr := e.nodes[0].Addr()
	const foreign = "another-deployments-epoch"
	if err := e.raw[0].Set(ctx, keyspace.NodeEpochKey(addr), foreign, 0).Err(); err != nil {
		t.Fatal(err)
	}
	newLocker := func(ns []service.Node) *service.Locker {
		l, err := service.New(ns, e.db, service.Options{Registry: e.db, MaxTTL: 3 * time.Second, NodeTimeout: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(l.Close)
		return l
	}
	gated := &gatedEpochNode{RedisNode: e.redisNodes(t, addr)[0].(*service.RedisNode), entered: make(chan struct{}), gate: make(chan struct{})}
	var rest []string
	for _, n := range e.nodes[1:] {
		rest = append(rest, n.Addr())
	}
	a := newLocker(append([]service.Node{gated}, e.redisNodes(t, rest...)...))
	b := newLocker(e.redisNodes(t))

	aDone := make(chan error, 1)
	go func() { aDone <- a.Init(ctx) }()
	select {
	case <-gated.entered: // A registered node 0 and read its marker
	case err := <-aDone:
		t.Fatalf("A's Init = %v before it checked node 0's marker", err)
	}
	bDone := make(chan error, 1)
	go func() { bDone <- b.Init(ctx) }()
	// B either finished its Init (it took A's registration as settled) or
	// waits for A's (the fix): only then may A's check answer.
	admin, err := pgx.Connect(ctx, e.url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close(context.Background()) })
	var bErr error
	bReturned := false
	testutil.WaitFor(t, 30*time.Second, "B to finish its Init or wait for A's registration", func() (bool, error) {
		select {
		case bErr = <-bDone:
			bReturned = true
			return true, nil
		default:
		}
		var n int
		err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = 'redfence' AND wait_event_type = 'Lock'`).Scan(&n)
		return n > 0, err
	})
	close(gated.gate)
	if err := <-aDone; !errors.Is(err, service.ErrForeignNode) {
		t.Errorf("A's Init = %v; want an error matching ErrForeignNode", err)
	}
	if !bReturned {
		bErr = <-bDone
	}
	if !errors.Is(bErr, service.ErrForeignNode) {
		t.Errorf("B's Init, started while A checked the node = %v; want an error matching ErrForeignNode", bErr)
	}
	if got, err := e.raw[0].Get(ctx, keyspace.NodeEpochKey(addr)).Result(); err != nil || got != foreign {
		t.Errorf("node 0's marker after the refused starts = %q, %v; want %q, untouched", got, err, foreign)
	}
	var rows int
	if err := admin.QueryRow(ctx, `SELECT count(*) FROM redfence_nodes WHERE addr = $1`, addr).Scan(&rows); err != nil || rows != 0 {
		t.Errorf("records of node 0 after the refused starts = %d, %v; want none", rows, err)
	}
}
