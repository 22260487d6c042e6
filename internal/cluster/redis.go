//go:build unix

package cluster

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// RedisOptions configures a redis-server.
type RedisOptions struct {
	// Persist turns on AOF with appendfsync always, so a restart keeps the
	// data, even after Kill. The default keeps nothing across restarts.
	Persist bool
	// Log receives the server's output; nil discards it. It is written from
	// another goroutine; when several servers share it, it must be safe for
	// concurrent use (Start and StartRedisNodes take care of that).
	Log io.Writer
}

// Redis is one redis-server listening on 127.0.0.1, run from the local
// binary or, when that is missing, in a Docker container. Its address and
// data directory stay the same across Stop/Kill and Start.
//
// Lifecycle methods are safe for concurrent use; they are serialised.
type Redis struct {
	opts RedisOptions
	addr string
	dir  string // temporary data directory; "" for a container
	out  *output

	mu     sync.Mutex // serialises lifecycle operations
	b      backend
	closed bool
}

// StartRedis starts a redis-server on a free loopback port and waits until
// it answers PING. It uses redis-server from PATH, or a redis:7-alpine
// container if that is missing and a Docker engine answers.
func StartRedis(ctx context.Context, opts RedisOptions) (*Redis, error) {
	r := &Redis{opts: opts, out: &output{log: opts.Log}}
	path, err := exec.LookPath("redis-server")
	if err != nil {
		pool, derr := dockerPool()
		if derr != nil {
			return nil, fmt.Errorf("cluster: redis-server not found in PATH; install it (Debian/Ubuntu: apt-get install redis-server) or start a Docker engine (%v)", derr)
		}
		spec := containerSpec{repository: "redis", tag: "7-alpine", port: "6379/tcp"}
		spec.cmd = append([]string{"redis-server"}, r.serverArgs()...)
		err = startOnFreePort("redis", func(port int) error {
			r.addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
			c, err := runContainer(ctx, pool, spec, port, r.out)
			if err != nil {
				return err
			}
			r.b = c
			if err := r.waitReady(ctx); err != nil {
				return errors.Join(err, killWait(c), c.remove())
			}
			return nil
		})
		if err != nil {
			return nil, err
		}
		return r, nil
	}
	removeOrphanDirs("", "redfence-redis-")
	r.dir, err = os.MkdirTemp("", "redfence-redis-")
	if err != nil {
		return nil, fmt.Errorf("cluster: redis data dir: %w", err)
	}
	if err := claimDir(r.dir); err != nil {
		return nil, errors.Join(fmt.Errorf("cluster: redis data dir: %w", err), os.RemoveAll(r.dir))
	}
	err = startOnFreePort("redis", func(port int) error {
		r.addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		args := append([]string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", r.dir}, r.serverArgs()...)
		r.b = newProcess(path, args, r.dir, nil, r.out)
		return r.start(ctx)
	})
	if err != nil {
		return nil, errors.Join(err, os.RemoveAll(r.dir))
	}
	return r, nil
}

// StartRedisNodes starts n redis-servers in parallel. On error it closes
// those that started. Several servers share opts.Log safely.
func StartRedisNodes(ctx context.Context, n int, opts RedisOptions) ([]*Redis, error) {
	opts.Log = syncLog(opts.Log)
	nodes := make([]*Redis, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range nodes {
		wg.Go(func() { nodes[i], errs[i] = StartRedis(ctx, opts) })
	}
	wg.Wait()
	if err := joinDistinct(errs); err != nil {
		for _, r := range nodes {
			if r != nil {
				err = errors.Join(err, r.Close())
			}
		}
		return nil, err
	}
	return nodes, nil
}

// serverArgs are the arguments common to local and container servers.
func (r *Redis) serverArgs() []string {
	args := []string{"--save", "", "--protected-mode", "no", "--daemonize", "no"}
	if r.opts.Persist {
		return append(args, "--appendonly", "yes", "--appendfsync", "always")
	}
	return append(args, "--appendonly", "no")
}

// waitReady waits until the server answers PING. For a local process it
// also checks that the answering server is this process, not another one
// that took the port.
func (r *Redis) waitReady(ctx context.Context) error {
	return waitReady(ctx, r.b, "redis "+r.addr, func(ctx context.Context) error {
		pid := r.b.pid()
		got, err := probeRedis(ctx, r.addr, pid != 0)
		if err != nil {
			return err
		}
		if pid != 0 && got != strconv.Itoa(pid) {
			return fmt.Errorf("%w: process_id %s, want %d", errPortInUse, got, pid)
		}
		return nil
	})
}

// probeRedis sends PING over a new connection and, with withPID, INFO
// server, returning the server's process_id. It speaks RESP directly, so
// expected failures (connection refused while starting) are not logged by
// a client library.
func probeRedis(ctx context.Context, addr string, withPID bool) (string, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	if deadline, ok := ctx.Deadline(); ok {
		if err := conn.SetDeadline(deadline); err != nil {
			return "", err
		}
	}
	rd := bufio.NewReader(conn)
	if _, err := io.WriteString(conn, "*1\r\n$4\r\nPING\r\n"); err != nil {
		return "", err
	}
	line, err := rd.ReadString('\n')
	if err != nil {
		return "", err
	}
	if line != "+PONG\r\n" {
		return "", fmt.Errorf("PING: %q", strings.TrimSpace(line))
	}
	if !withPID {
		return "", nil
	}
	if _, err := io.WriteString(conn, "*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n"); err != nil {
		return "", err
	}
	line, err = rd.ReadString('\n')
	if err != nil {
		return "", err
	}
	n, err := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, "$")))
	if !strings.HasPrefix(line, "$") || err != nil || n < 0 {
		return "", fmt.Errorf("INFO: %q", strings.TrimSpace(line))
	}
	info := make([]byte, n+2)
	if _, err := io.ReadFull(rd, info); err != nil {
		return "", err
	}
	return infoField(string(info), "process_id"), nil
}

// infoField returns the value of key in the text of an INFO reply.
func infoField(info, key string) string {
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(line, key+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// Addr returns "127.0.0.1:PORT". It is stable across restarts.
func (r *Redis) Addr() string { return r.addr }

// PID returns the process id of the running server, or 0 when it is not
// running or runs in a container.
func (r *Redis) PID() int { return r.b.pid() }

// Running reports whether the server process is running (a paused server
// is running).
func (r *Redis) Running() bool { return running(r.b) }

// Pause stops the server with SIGSTOP (docker pause for a container): it
// keeps its connections but answers nothing until Resume.
func (r *Redis) Pause() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.b.pause(); err != nil {
		return fmt.Errorf("cluster: pause redis %s: %w", r.addr, err)
	}
	return nil
}

// Resume continues a paused server with SIGCONT.
func (r *Redis) Resume() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.b.resume(); err != nil {
		return fmt.Errorf("cluster: resume redis %s: %w", r.addr, err)
	}
	return nil
}

// Kill kills the server with SIGKILL (no save) and waits until it has
// exited. It does nothing when the server is not running.
func (r *Redis) Kill() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := killWait(r.b); err != nil {
		return fmt.Errorf("cluster: kill redis %s: %w", r.addr, err)
	}
	return nil
}

// Stop shuts the server down gracefully with SIGTERM (resuming it first if
// it is paused) and waits until it has exited. If ctx ends first the
// server is killed and the error wraps ctx.Err(). It does nothing when the
// server is not running.
func (r *Redis) Stop(ctx context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := terminate(ctx, r.b, syscall.SIGTERM); err != nil {
		return fmt.Errorf("cluster: stop redis %s: %w", r.addr, err)
	}
	return nil
}

// Start starts a stopped or killed server again on the same port and data
// directory and waits until it answers PING. It fails if the server is
// running, closed, or the port has been taken by another process.
func (r *Redis) Start(ctx context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return fmt.Errorf("cluster: start redis %s: closed", r.addr)
	}
	return r.start(ctx)
}

// start launches the server and waits until it is ready; on failure it
// leaves it not running.
func (r *Redis) start(ctx context.Context) error {
	if err := r.b.launch(ctx); err != nil {
		return fmt.Errorf("cluster: start redis %s: %w", r.addr, err)
	}
	if err := r.waitReady(ctx); err != nil {
		return errors.Join(err, killWait(r.b))
	}
	return nil
}

// Close kills the server if it is running and removes its data. It is
// idempotent.
func (r *Redis) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	r.closed = true
	err := killWait(r.b)
	err = errors.Join(err, r.b.remove())
	if r.dir != "" {
		err = errors.Join(err, os.RemoveAll(r.dir))
	}
	if err != nil {
		return fmt.Errorf("cluster: close redis %s: %w", r.addr, err)
	}
	return nil
}

// joinDistinct joins errs, each message once: n nodes that fail alike (no
// redis-server in PATH) give one line, not n.
func joinDistinct(errs []error) error {
	seen := map[string]bool{}
	var out []error
	for _, err := range errs {
		if err != nil && !seen[err.Error()] {
			seen[err.Error()] = true
			out = append(out, err)
		}
	}
	return errors.Join(out...)
}
