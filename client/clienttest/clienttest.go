//go:build unix

// Package clienttest starts a real Redfence for tests of code that uses it
// (this module's client, CLI and examples): the API handler over five real
// redis-server nodes and a real Postgres (started by internal/cluster from
// local binaries, or Docker), behind an httptest server, wired as `redfence
// serve` wires it, metrics included. Everything it starts is stopped in
// tb.Cleanup.
//
// Not provided: fault injection beyond deleting a lock's keys; use
// internal/cluster directly for that. It needs redis-server and Postgres
// binaries (or a Docker engine) on the machine.
package clienttest

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/redfence/redfence"
	"github.com/redfence/redfence/api"
	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/internal/keyspace"
	"github.com/redfence/redfence/service"
	"github.com/redfence/redfence/store"
)

// Server is a running Redfence.
type Server struct {
	// URL is the server's base URL (http://127.0.0.1:port).
	URL string
	// Redis holds a direct client per Redis node, in node order.
	Redis []*redis.Client
	// Handler is the API it serves (Wait for its last audit lines).
	Handler *api.Handler
}

// Options tunes Start. The zero value is usable.
type Options struct {
	// Logger receives the server's log (audit lines included). The default
	// discards it.
	Logger *slog.Logger
}

// Start starts five Redis nodes, a fresh database on the test binary's
// shared Postgres, and Redfence on them. It fails tb on error.
func Start(tb testing.TB, opts Options) *Server {
	tb.Helper()
	ctx := context.Background()
	nodes := clustertest.Redis(tb, 5, cluster.RedisOptions{})
	db, err := store.Open(ctx, clustertest.Database(tb), store.Options{})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(db.Close)
	if _, err := db.Migrate(ctx); err != nil {
		tb.Fatal(err)
	}
	s := &Server{}
	var ns []service.Node
	for _, r := range nodes {
		n := service.NewRedisNode(r.Addr(), service.RedisOptions{})
		tb.Cleanup(func() { n.Close() })
		ns = append(ns, n)
		c := redis.NewClient(&redis.Options{Addr: r.Addr(), MaxRetries: -1})
		tb.Cleanup(func() { c.Close() })
		s.Redis = append(s.Redis, c)
	}
	reg := prometheus.NewRegistry()
	obs := api.NewObserver(reg)
	// A generous per-node timeout: tests run in parallel under -race on a
	// small machine, and a slow answer must not become a spurious 503.
	locker, err := service.New(ns, obs.Issuer(db), service.Options{NodeTimeout: time.Second, Observer: obs})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(locker.Close)
	h := api.NewHandler(locker, db, api.Options{OpenAPI: redfence.OpenAPI, Registry: reg, Logger: opts.Logger})
	tb.Cleanup(h.Wait) // after the server closed: audit lines still looking up their grant
	srv := httptest.NewServer(h)
	tb.Cleanup(srv.Close)
	s.URL, s.Handler = srv.URL, h
	return s
}

// DeleteLock deletes the lock's key on the first n nodes, as nodes that lost
// their memory (or an operator) would: with n a majority, the lease is lost.
// It first waits until every node holds the key: a grant is returned once a
// majority answered, and a slower node's SET landing after the delete would
// bring the key back.
func (s *Server) DeleteLock(tb testing.TB, name string, n int) {
	tb.Helper()
	key := keyspace.RedisKey(keyspace.Key("", name))
	deadline := time.Now().Add(30 * time.Second)
	for _, c := range s.Redis {
		for {
			got, err := c.Exists(context.Background(), key).Result()
			if err != nil {
				tb.Fatal(err)
			}
			if got == 1 {
				break
			}
			if time.Now().After(deadline) {
				tb.Fatalf("DeleteLock(%q): the key is not on every node after 30s", name)
			}
			time.Sleep(time.Millisecond) // polling an observable condition, not a stand-in for one
		}
	}
	for _, c := range s.Redis[:n] {
		if err := c.Del(context.Background(), key).Err(); err != nil {
			tb.Fatal(err)
		}
	}
}

// GrantingMux is a scripted server for faults a real one cannot be made to
// show: it grants every acquire with lockToken and fencing token 7, for ttl
// (validity 90% of it). Callers add the other routes.
func GrantingMux(lockToken string, ttl time.Duration) *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/locks/{name}", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"name":%q,"lock_token":%q,"fencing_token":7,"ttl_ms":%d,"validity_ms":%d,"expires_at":"2030-01-01T00:00:00Z","owner":""}`,
			r.PathValue("name"), lockToken, ttl.Milliseconds(), ttl.Milliseconds()*9/10)
	})
	return mux
}
