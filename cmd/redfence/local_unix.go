//go:build unix

package main

import (
	"context"

	"github.com/redfence/redfence/internal/cluster"
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
