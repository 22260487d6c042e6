//go:build unix

package main

import (
	"context"
	"os"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/store"
)

// startLocal starts the servers redfence dev runs itself (see cluster).
func startLocal(ctx context.Context, o localOptions) (localServers, error) {
	c, err := cluster.Start(ctx, cluster.Options{Nodes: o.nodes, DurablePostgres: true,
		WithoutRedis: o.withoutRedis, WithoutPostgres: o.withoutPostgres})
	if err != nil {
		return nil, err
	}
	return localCluster{c}, nil
}

// localCluster is a cluster.Cluster as localServers.
type localCluster struct{ *cluster.Cluster }

func (c localCluster) PostgresURL() string {
	if c.Postgres == nil {
		return ""
	}
	return c.Postgres.URL()
}

// keyCreator names this process as the creator of an API key that must not
// outlive it (see store.CreateProcessKey); ok is false when it cannot.
func keyCreator() (c store.KeyCreator, ok bool) {
	host, err := cluster.OwnerHost()
	if err != nil {
		return c, false
	}
	return store.KeyCreator{Host: host, PID: os.Getpid()}, true
}

// processGone reports whether no process of this host has pid.
func processGone(pid int) bool { return cluster.Gone(pid) }
