package main

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/internal/testutil"
)

// TestOpenWaiting: a server started while its Postgres is down waits for
// it, saying so, and serves once it is up; one whose Postgres refuses what
// it asks (a database that does not exist) or whose listen address is
// taken fails at once; a signal ends the wait.
func TestOpenWaiting(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	nodes := addrs(clustertest.Redis(t, 3, cluster.RedisOptions{}))
	pg := clustertest.Postgres(t)
	url, err := pg.CreateDatabase(ctx, "waiting")
	if err != nil {
		t.Fatal(err)
	}
	if err := pg.Stop(ctx, true); err != nil {
		t.Fatal(err)
	}

	t.Run("Signal", func(t *testing.T) {
		var logs testutil.Buffer
		sctx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() {
			_, err := OpenWaiting(sctx, testConfig(t, nodes, url), slog.New(slog.NewJSONHandler(&logs, nil)), ServerOptions{})
			done <- err
		}()
		testutil.WaitFor(t, time.Minute, "the wait to be logged", func() (bool, error) {
			return strings.Contains(logs.String(), "Postgres cannot be reached"), nil
		})
		stop()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("OpenWaiting after its context ended = %v; want context.Canceled", err)
		}
	})

	t.Run("Up", func(t *testing.T) {
		var logs testutil.Buffer
		type result struct {
			s   *Server
			err error
		}
		done := make(chan result, 1)
		go func() {
			s, err := OpenWaiting(ctx, testConfig(t, nodes, url), slog.New(slog.NewJSONHandler(&logs, nil)), ServerOptions{})
			done <- result{s, err}
		}()
		testutil.WaitFor(t, time.Minute, "the wait to be logged", func() (bool, error) {
			return strings.Contains(logs.String(), `"level":"WARN","msg":"Postgres cannot be reached`), nil
		})
		if err := pg.Start(ctx); err != nil {
			t.Fatal(err)
		}
		r := <-done
		if r.err != nil {
			t.Fatalf("OpenWaiting once Postgres is up = %v\n%s", r.err, logs.String())
		}
		t.Cleanup(func() {
			cctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
			defer cancel()
			if err := r.s.Close(cctx); err != nil {
				t.Error(err)
			}
		})
		if g := acquire(t, r.s.Addr(), "after-outage"); g.FencingToken != 1 {
			t.Errorf("first token = %d; want 1", g.FencingToken)
		}
	})

	t.Run("NoDatabase", func(t *testing.T) {
		bad := strings.Replace(url, "/waiting", "/nosuchdb", 1)
		if bad == url {
			t.Fatalf("no database name in %s", url)
		}
		if _, err := OpenWaiting(ctx, testConfig(t, nodes, bad), discard, ServerOptions{}); err == nil || !strings.Contains(err.Error(), "nosuchdb") {
			t.Errorf("OpenWaiting on a database that does not exist = %v; want its error at once", err)
		}
	})

	t.Run("AddressTaken", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		cfg := testConfig(t, nodes, url)
		cfg.ListenAddr = ln.Addr().String()
		if _, err := OpenWaiting(ctx, cfg, discard, ServerOptions{}); err == nil || !strings.Contains(err.Error(), "address already in use") {
			t.Errorf("OpenWaiting on a taken address = %v; want its error at once", err)
		}
	})
}
