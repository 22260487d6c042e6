//go:build linux

package cluster_test

import (
	"testing"
	"time"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/testutil"
)

// The kernel sends a server its death signal when the thread that started
// it ends, and the Go runtime ends the thread of a goroutine that exits
// locked to it (as `redfence lock` does). A server started from such a
// goroutine must live on.
func TestRedis_OutlivesStartingThread(t *testing.T) {
	t.Parallel()
	var r *cluster.Redis
	var err error
	testutil.OnEndingThread(t, func() { r, err = cluster.StartRedis(t.Context(), cluster.RedisOptions{}) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Error(err)
		}
	})
	if err := ping(t, newClient(t, r.Addr()), 5*time.Second); err != nil {
		t.Errorf("PING after the starting thread ended: %v; want PONG", err)
	}
	if !r.Running() {
		t.Error("Running() = false after the starting thread ended; want true")
	}
}
