//go:build unix

// Package cluster starts real servers for tests, benchmarks and the
// redfence dev command: N redis-server processes and one Postgres, each on
// its own free port on 127.0.0.1, with fault injection (stop, kill -9,
// pause, resume, restart on the same port and data).
//
// Servers run from local binaries (redis-server; initdb and postgres from
// PATH or /usr/lib/postgresql/*/bin). Only when a binary is missing and a
// Docker engine answers are containers used instead; otherwise Start
// fails with an error that names what to install.
//
// Guarantees: every local server runs in its own process group (a
// terminal's Ctrl-C reaches only the parent, which shuts the servers down
// with Close) and is killed by the kernel when the process that started it
// dies (Linux parent-death signal), so none outlives a crashed test. Their
// temporary directories are removed by Close; those a killed process left
// behind are removed by the next start of a server of the same kind, once
// their creator is gone. Containers are removed by Close, or, when their
// creator is gone (a killed test binary; the shared test Postgres of
// clustertest, never closed), by the next use of Docker on the same host:
// they are labelled with the creator's host and PID. Elsewhere than Linux a
// local server whose creator was killed outlives it.
//
// Not guaranteed: that a port stays free while a server is stopped; Start
// then fails. The harness is for tests and development, not production.
package cluster

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
)

// Options configures a Cluster.
type Options struct {
	// Nodes is the number of Redis nodes. The default (0) is 5.
	Nodes int
	// Persist turns on AOF persistence on every Redis node; see
	// RedisOptions.Persist.
	Persist bool
	// DurablePostgres keeps fsync on; see PostgresOptions.Durable.
	DurablePostgres bool
	// Log receives the output of all servers; nil discards it. Writes are
	// serialised.
	Log io.Writer
	// WithoutRedis and WithoutPostgres leave the Redis nodes or Postgres
	// out (the caller has its own).
	WithoutRedis, WithoutPostgres bool
}

// Cluster is N Redis nodes plus one Postgres (either may be left out, see
// Options).
type Cluster struct {
	// Redis holds the nodes in a fixed order.
	Redis []*Redis
	// Postgres is the cluster's database server.
	Postgres *Postgres
}

// Start starts the Redis nodes and Postgres in parallel and waits until all
// are ready. On error it closes whatever started.
func Start(ctx context.Context, opts Options) (*Cluster, error) {
	if opts.Nodes < 0 {
		return nil, fmt.Errorf("cluster: %d nodes", opts.Nodes)
	}
	if opts.Nodes == 0 {
		opts.Nodes = 5
	}
	log := syncLog(opts.Log)
	c := &Cluster{}
	var redisErr, pgErr error
	var wg sync.WaitGroup
	if !opts.WithoutRedis {
		wg.Go(func() {
			c.Redis, redisErr = StartRedisNodes(ctx, opts.Nodes, RedisOptions{Persist: opts.Persist, Log: log})
		})
	}
	if !opts.WithoutPostgres {
		wg.Go(func() {
			c.Postgres, pgErr = StartPostgres(ctx, PostgresOptions{Durable: opts.DurablePostgres, Log: log})
		})
	}
	wg.Wait()
	if err := errors.Join(redisErr, pgErr); err != nil {
		return nil, errors.Join(err, c.Close())
	}
	return c, nil
}

// Addrs returns the addresses of the Redis nodes, in the order of c.Redis.
func (c *Cluster) Addrs() []string {
	addrs := make([]string, len(c.Redis))
	for i, r := range c.Redis {
		addrs[i] = r.Addr()
	}
	return addrs
}

// Close closes all servers and joins their errors. It is idempotent.
func (c *Cluster) Close() error {
	var errs []error
	for _, r := range c.Redis {
		errs = append(errs, r.Close())
	}
	if c.Postgres != nil {
		errs = append(errs, c.Postgres.Close())
	}
	return errors.Join(errs...)
}
