//go:build unix

// Package clustertest adapts package cluster to tests: it starts servers
// for a testing.TB, fails the test when they cannot start and closes them
// in tb.Cleanup.
//
// Database shares one Postgres between all tests of a test binary. That
// server is never closed explicitly: it dies with the test process (the
// kernel kills it when its parent exits), and its temporary directory is
// removed by the next test binary that uses Database (a container instead,
// when Docker stands in for a missing binary, is removed by the next one
// that uses Docker). Tests must not stop
// or pause it; use cluster.StartPostgres for fault tests.
package clustertest

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/redfence/redfence/internal/cluster"
)

// Start starts a cluster for tb, closes it in tb.Cleanup and fails the test
// if it cannot start.
func Start(tb testing.TB, opts cluster.Options) *cluster.Cluster {
	tb.Helper()
	c, err := cluster.Start(tb.Context(), opts)
	return closedAfter(tb, c, err)
}

// closedAfter fails tb on err, or else closes c in tb.Cleanup (failing tb
// if that fails) and returns it.
func closedAfter[T interface{ Close() error }](tb testing.TB, c T, err error) T {
	tb.Helper()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := c.Close(); err != nil {
			tb.Error(err)
		}
	})
	return c
}

// Redis starts n Redis nodes (no Postgres) for tb, closes them in
// tb.Cleanup and fails the test if they cannot start.
func Redis(tb testing.TB, n int, opts cluster.RedisOptions) []*cluster.Redis {
	tb.Helper()
	nodes, err := cluster.StartRedisNodes(tb.Context(), n, opts)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		for _, r := range nodes {
			if err := r.Close(); err != nil {
				tb.Error(err)
			}
		}
	})
	return nodes
}

// Postgres starts a Postgres server for tb alone (one to restart, stop or
// reconfigure), closes it in tb.Cleanup and fails the test if it cannot
// start.
func Postgres(tb testing.TB) *cluster.Postgres {
	tb.Helper()
	pg, err := cluster.StartPostgres(tb.Context(), cluster.PostgresOptions{})
	return closedAfter(tb, pg, err)
}

// Database returns the URL of a fresh database named after tb.Name() on
// the Postgres shared by the test binary, starting that server on first
// use. It fails the test on error.
func Database(tb testing.TB) string {
	tb.Helper()
	pg, err := sharedPostgres(tb)
	if err != nil {
		tb.Fatal(err)
	}
	url, err := pg.CreateDatabase(tb.Context(), tb.Name())
	if err != nil {
		tb.Fatal(err)
	}
	return url
}

// shared is the Postgres shared by the tests of this test binary. This is
// the one piece of package-level mutable state the project allows: a test
// binary has no hook to start a server once and stop it at exit. The
// server is started lazily under mu, and a failed start is retried by the
// next caller.
var shared struct {
	mu sync.Mutex
	pg *cluster.Postgres
}

// dirPrefix names the per-process parent directory of the shared server's
// data; the suffix is the pid of the test binary.
const dirPrefix = "redfence-clustertest-"

func sharedPostgres(tb testing.TB) (*cluster.Postgres, error) {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.pg != nil && shared.pg.Running() {
		return shared.pg, nil
	}
	if shared.pg != nil {
		_ = shared.pg.Close()
		shared.pg = nil
	}
	removeStaleDirs()
	dir := filepath.Join(os.TempDir(), dirPrefix+strconv.Itoa(os.Getpid()))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("clustertest: %w", err)
	}
	// Searchable by the postgres user when the tests run as root.
	if err := os.Chmod(dir, 0o755); err != nil {
		return nil, fmt.Errorf("clustertest: %w", err)
	}
	pg, err := cluster.StartPostgres(tb.Context(), cluster.PostgresOptions{Dir: dir})
	if err != nil {
		return nil, err
	}
	shared.pg = pg
	return pg, nil
}

// removeStaleDirs removes, best effort, the directories left by test
// binaries that have exited.
func removeStaleDirs() {
	matches, _ := filepath.Glob(filepath.Join(os.TempDir(), dirPrefix+"*"))
	for _, m := range matches {
		pid, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(m), dirPrefix))
		if err != nil || pid == os.Getpid() {
			continue
		}
		if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
			_ = os.RemoveAll(m)
		}
	}
}
