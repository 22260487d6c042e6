package cluster_test

import (
	"context"
	"errors"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
)

func newClient(t *testing.T, addr string) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{
		Addr:                  addr,
		ContextTimeoutEnabled: true,
		MaxRetries:            -1,
		DisableIdentity:       true,
	})
	t.Cleanup(func() { c.Close() })
	return c
}

func ping(t *testing.T, c *redis.Client, timeout time.Duration) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), timeout)
	defer cancel()
	return c.Ping(ctx).Err()
}

// isTimeout reports whether err is a context deadline or a network timeout
// (go-redis turns the context deadline into a socket deadline).
func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout()
}

// gone reports whether no process has the given pid.
func gone(pid int) bool {
	return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
}

func TestRedis_PauseResume(t *testing.T) {
	t.Parallel()
	nodes := clustertest.Redis(t, 3, cluster.RedisOptions{})
	c0 := newClient(t, nodes[0].Addr())
	if err := c0.Set(t.Context(), "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}
	c1 := newClient(t, nodes[1].Addr())
	if err := ping(t, c1, time.Second); err != nil {
		t.Fatalf("PING before Pause: %v", err)
	}

	if err := nodes[1].Pause(); err != nil {
		t.Fatal(err)
	}
	if err := ping(t, c1, 100*time.Millisecond); !isTimeout(err) {
		t.Fatalf("PING on paused node = %v; want a timeout", err)
	}
	if !nodes[1].Running() {
		t.Error("Running() = false on a paused node; want true")
	}
	if got, err := c0.Get(t.Context(), "k").Result(); err != nil || got != "v" {
		t.Errorf("GET on other node = %q, %v; want \"v\"", got, err)
	}

	if err := nodes[1].Resume(); err != nil {
		t.Fatal(err)
	}
	if err := ping(t, c1, time.Second); err != nil {
		t.Fatalf("PING after Resume: %v", err)
	}
}

func TestRedis_Restart(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		persist bool
		stop    func(context.Context, *cluster.Redis) error
	}{
		{"KillNoPersist", false, func(_ context.Context, r *cluster.Redis) error { return r.Kill() }},
		{"KillPersist", true, func(_ context.Context, r *cluster.Redis) error { return r.Kill() }},
		{"StopPersist", true, func(ctx context.Context, r *cluster.Redis) error { return r.Stop(ctx) }},
		{"KillPaused", true, func(_ context.Context, r *cluster.Redis) error {
			if err := r.Pause(); err != nil {
				return err
			}
			return r.Kill()
		}},
		{"StopPaused", false, func(ctx context.Context, r *cluster.Redis) error {
			if err := r.Pause(); err != nil {
				return err
			}
			return r.Stop(ctx)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := clustertest.Redis(t, 1, cluster.RedisOptions{Persist: tc.persist})[0]
			addr, pid := r.Addr(), r.PID()
			c := newClient(t, addr)
			if err := c.Set(t.Context(), "k", "v", 0).Err(); err != nil {
				t.Fatalf("SET: %v", err)
			}

			if err := tc.stop(t.Context(), r); err != nil {
				t.Fatal(err)
			}
			if r.Running() {
				t.Error("Running() = true after stop; want false")
			}
			if !gone(pid) {
				t.Errorf("pid %d still exists after stop", pid)
			}
			if err := ping(t, c, time.Second); err == nil {
				t.Error("PING after stop succeeded; want error")
			}
			if err := r.Kill(); err != nil {
				t.Errorf("Kill on stopped node: %v", err)
			}
			if err := r.Pause(); err == nil {
				t.Error("Pause on stopped node succeeded; want error")
			}

			if err := r.Start(t.Context()); err != nil {
				t.Fatal(err)
			}
			if r.Addr() != addr {
				t.Errorf("Addr() = %s after restart; want %s", r.Addr(), addr)
			}
			if err := r.Start(t.Context()); err == nil {
				t.Error("Start on running node succeeded; want error")
			}
			got, err := c.Get(t.Context(), "k").Result()
			switch {
			case tc.persist && (err != nil || got != "v"):
				t.Errorf("GET after restart = %q, %v; want \"v\"", got, err)
			case !tc.persist && !errors.Is(err, redis.Nil):
				t.Errorf("GET after restart = %q, %v; want redis.Nil", got, err)
			}
		})
	}
}

func TestRedis_StartPortTaken(t *testing.T) {
	t.Parallel()
	r := clustertest.Redis(t, 1, cluster.RedisOptions{})[0]
	if err := r.Kill(); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", r.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if err := r.Start(t.Context()); err == nil {
		t.Fatal("Start on a taken port succeeded; want error")
	}
	if r.Running() {
		t.Error("Running() = true after failed Start; want false")
	}
	ln.Close()
	if err := r.Start(t.Context()); err != nil {
		t.Fatalf("Start after port freed: %v", err)
	}
}

func connect(ctx context.Context, url string, timeout time.Duration) (*pgx.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, err
	}
	if err := conn.Ping(ctx); err != nil {
		conn.Close(context.Background())
		return nil, err
	}
	return conn, nil
}

func TestPostgres(t *testing.T) {
	t.Parallel()
	pg := clustertest.Postgres(t)

	url1, err := pg.CreateDatabase(t.Context(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	url2, err := pg.CreateDatabase(t.Context(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	if url1 == url2 {
		t.Fatalf("CreateDatabase twice = %s both times; want distinct", url1)
	}

	conn, err := connect(t.Context(), url1, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(t.Context(), "CREATE TABLE t (v int); INSERT INTO t VALUES (42)"); err != nil {
		t.Fatal(err)
	}
	conn2, err := connect(t.Context(), url2, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn2.Exec(t.Context(), "SELECT * FROM t"); err == nil {
		t.Error("table of the first database visible in the second")
	}
	conn2.Close(t.Context())

	t.Run("PauseResume", func(t *testing.T) {
		idle, err := connect(t.Context(), url1, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer idle.Close(context.Background())
		if err := pg.Pause(); err != nil {
			t.Fatal(err)
		}
		// The backend of an existing connection is paused too.
		ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
		if _, err := idle.Exec(ctx, "SELECT 1"); err == nil {
			t.Error("query on paused Postgres succeeded; want error")
		}
		cancel()
		if c, err := connect(t.Context(), url1, 200*time.Millisecond); err == nil {
			c.Close(t.Context())
			t.Error("connect to paused Postgres succeeded; want error")
		}
		if err := pg.Resume(); err != nil {
			t.Fatal(err)
		}
		var v int
		if err := conn.QueryRow(t.Context(), "SELECT v FROM t").Scan(&v); err != nil || v != 42 {
			t.Errorf("SELECT after Resume = %d, %v; want 42", v, err)
		}
	})

	t.Run("StopImmediate", func(t *testing.T) {
		pid := pg.PID()
		if err := pg.Stop(t.Context(), true); err != nil {
			t.Fatal(err)
		}
		if pg.Running() || !gone(pid) {
			t.Errorf("Running() = %v, pid %d gone = %v after Stop; want false, true", pg.Running(), pid, gone(pid))
		}
		if err := conn.Ping(t.Context()); err == nil {
			t.Error("Ping on old connection after Stop succeeded; want error")
		}
		if c, err := connect(t.Context(), url1, time.Second); err == nil {
			c.Close(t.Context())
			t.Error("connect after Stop succeeded; want error")
		}

		if err := pg.Start(t.Context()); err != nil {
			t.Fatal(err)
		}
		c, err := connect(t.Context(), url1, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close(t.Context())
		var v int
		if err := c.QueryRow(t.Context(), "SELECT v FROM t").Scan(&v); err != nil || v != 42 {
			t.Errorf("SELECT after restart = %d, %v; want 42", v, err)
		}
	})

	t.Run("StopFastWhilePaused", func(t *testing.T) {
		if err := pg.Pause(); err != nil {
			t.Fatal(err)
		}
		if err := pg.Stop(t.Context(), false); err != nil {
			t.Fatal(err)
		}
		if err := pg.Start(t.Context()); err != nil {
			t.Fatal(err)
		}
	})
}

func TestCluster_Close(t *testing.T) {
	t.Parallel()
	c, err := cluster.Start(t.Context(), cluster.Options{Nodes: 2})
	if err != nil {
		t.Fatal(err)
	}
	if got := len(c.Addrs()); got != 2 {
		t.Errorf("len(Addrs()) = %d; want 2", got)
	}
	pids := []int{c.Postgres.PID()}
	for _, r := range c.Redis {
		pids = append(pids, r.PID())
	}
	// Closing must also work on paused servers.
	if err := c.Redis[0].Pause(); err != nil {
		t.Fatal(err)
	}
	if err := c.Postgres.Pause(); err != nil {
		t.Fatal(err)
	}

	if err := c.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := c.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	for _, pid := range pids {
		if pid == 0 || !gone(pid) {
			t.Errorf("pid %d exists after Close", pid)
		}
	}
	if err := c.Redis[1].Start(t.Context()); err == nil {
		t.Error("Start after Close succeeded; want error")
	}
}

// TestStart_Without: a cluster started without Redis or without Postgres
// starts only the other (redfence dev pointed at the user's own servers).
func TestStart_Without(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name            string
		noRedis, noPG   bool
		wantRedis, want int
	}{
		{"WithoutPostgres", false, true, 2, 0},
		{"WithoutRedis", true, false, 0, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c, err := cluster.Start(t.Context(), cluster.Options{Nodes: 2, WithoutRedis: tc.noRedis, WithoutPostgres: tc.noPG})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = c.Close() })
			pg := 0
			if c.Postgres != nil {
				pg = 1
			}
			if len(c.Redis) != tc.wantRedis || pg != tc.want {
				t.Errorf("Start = %d Redis nodes, %d Postgres; want %d, %d", len(c.Redis), pg, tc.wantRedis, tc.want)
			}
		})
	}
}
