package main

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/service"
	"github.com/redfence/redfence/store"
)

// TestServer_RefusesNodesOfAnotherDatabase: a server pointed at Redis nodes
// that servers of another database use refuses to start, naming the cause,
// and leaves them alone: without the check, each side took the other's
// epoch marker for a lost memory and quarantined every node in turn, for
// as long as both ran. A later start is refused again (the refused one
// left no record of the nodes behind), and the first deployment grants on.
func TestServer_RefusesNodesOfAnotherDatabase(t *testing.T) {
	t.Parallel()
	nodes := clustertest.Redis(t, 3, cluster.RedisOptions{})
	a, _ := open(t, testConfig(t, addrs(nodes), clustertest.Database(t)), discard)
	acquire(t, a.Addr(), "before")
	other := clustertest.Database(t)
	for try := range 2 {
		b, err := Open(t.Context(), testConfig(t, addrs(nodes), other), discard, ServerOptions{})
		if err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
			b.Close(ctx)
			cancel()
			t.Fatalf("start %d on another database: Open = nil; want the nodes refused", try+1)
		}
		if !errors.Is(err, service.ErrForeignNode) {
			t.Fatalf("start %d on another database: Open = %v; want an error matching ErrForeignNode", try+1, err)
		}
	}
	acquire(t, a.Addr(), "after")
	var ns struct {
		Nodes []struct {
			QuarantinedUntil string `json:"quarantined_until"`
		} `json:"nodes"`
	}
	expect(t, "GET /v1/nodes", call(t, http.MethodGet, a.Addr(), "/v1/nodes", ""), http.StatusOK, &ns)
	for i, n := range ns.Nodes {
		if n.QuarantinedUntil != "" {
			t.Errorf("node %d of the first deployment is quarantined until %s after the refused starts; want none", i, n.QuarantinedUntil)
		}
	}
}

// TestServer_RefusesAnotherNodeList: a server listing other Redis nodes than
// a running server of its database refuses to start, naming both lists:
// majorities of the two lists need not overlap (here a 3-node server's
// majority, 2 nodes, would miss the 3 of 5 that hold the first server's
// lease), so both could grant one lock at once. The same nodes in another
// order start, and the first server grants on.
func TestServer_RefusesAnotherNodeList(t *testing.T) {
	t.Parallel()
	nodes := addrs(clustertest.Redis(t, 5, cluster.RedisOptions{}))
	url := clustertest.Database(t)
	a, _ := open(t, testConfig(t, nodes, url), discard)
	acquire(t, a.Addr(), "held")
	for _, list := range [][]string{nodes[:3], append(slices.Clone(nodes), addrs(clustertest.Redis(t, 1, cluster.RedisOptions{}))...)} {
		b, err := Open(t.Context(), testConfig(t, list, url), discard, ServerOptions{})
		if err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
			b.Close(ctx)
			cancel()
			t.Fatalf("start with nodes %v beside a server with %v: Open = nil; want it refused", list, nodes)
		}
		if !errors.Is(err, store.ErrNodeListDiffers) || !strings.Contains(err.Error(), strings.Join(slices.Sorted(slices.Values(list)), ",")) {
			t.Fatalf("start with nodes %v: Open = %v; want an error matching ErrNodeListDiffers naming the list", list, err)
		}
	}
	reordered := slices.Clone(nodes)
	slices.Reverse(reordered)
	open(t, testConfig(t, reordered, url), discard)
	acquire(t, a.Addr(), "after")
}
