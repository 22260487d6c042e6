package main

import (
	"net/http"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/internal/testutil"
)

// TestServer_ReadyzFollowsHeartbeat: a server whose heartbeat Postgres does
// not record (its table locked here; a read-only Postgres does the same)
// grants nothing, though Postgres answers pings: /readyz says so (503,
// postgres not up), so a balancer stops sending it acquires; once the
// heartbeat is recorded again, it is ready again.
func TestServer_ReadyzFollowsHeartbeat(t *testing.T) {
	t.Parallel()
	url := clustertest.Database(t)
	s, _ := open(t, testConfig(t, addrs(clustertest.Redis(t, 3, cluster.RedisOptions{})), url), discard)
	expect(t, "GET /readyz", call(t, http.MethodGet, s.Addr(), "/readyz", ""), http.StatusOK, nil)
	conn, err := pgx.Connect(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(t.Context())
	tx, err := conn.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(t.Context(), "LOCK TABLE redfence_servers IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, waitTimeout, "/readyz to say the heartbeat is not recorded", func() (bool, error) {
		r := call(t, http.MethodGet, s.Addr(), "/readyz", "")
		return r.status == http.StatusServiceUnavailable && strings.Contains(string(r.body), "heartbeat"), nil
	})
	r := call(t, http.MethodPost, s.Addr(), "/v1/locks/meanwhile", `{"ttl_ms":10000}`)
	if r.status != http.StatusServiceUnavailable {
		t.Errorf("acquire while /readyz says not ready = %d %s; want 503", r.status, r.body)
	}
	if err := tx.Rollback(t.Context()); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, waitTimeout, "/readyz to be ready again", func() (bool, error) {
		return call(t, http.MethodGet, s.Addr(), "/readyz", "").status == http.StatusOK, nil
	})
	acquire(t, s.Addr(), "after")
}
