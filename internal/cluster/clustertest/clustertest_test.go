package clustertest_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
)

func TestDatabase(t *testing.T) {
	t.Parallel()
	urls := map[string]bool{}
	for range 3 {
		url := clustertest.Database(t)
		if urls[url] {
			t.Fatalf("Database returned %s twice", url)
		}
		urls[url] = true
		conn, err := pgx.Connect(t.Context(), url)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(t.Context(), "CREATE TABLE t (v int)"); err != nil {
			t.Error(err)
		}
		conn.Close(context.Background())
	}
}

func TestStart(t *testing.T) {
	t.Parallel()
	c := clustertest.Start(t, cluster.Options{Nodes: 1})
	if len(c.Redis) != 1 || c.Postgres == nil {
		t.Fatalf("Start(Nodes: 1) = %d nodes, Postgres %v", len(c.Redis), c.Postgres)
	}
	url, err := c.Postgres.CreateDatabase(t.Context(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	conn.Close(context.Background())
}
