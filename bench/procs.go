package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// child is a server process this program started: in its own process group
// (a terminal's Ctrl-C reaches only us, and we stop it) and killed by the
// kernel if we die.
type child struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	tail *tailBuffer
	dir  string // removed by stop, if set
}

func startChild(name, path string, args, env []string, logPath, dir string) (*child, error) {
	c := &child{name: name, done: make(chan struct{}), tail: &tailBuffer{}, dir: dir}
	cmd := exec.Command(path, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	// Server output goes straight to a file (default /dev/null), not through
	// a pipe this process would have to read: reading it would cost the
	// load generator CPU that the table charges to the client.
	if logPath == "" {
		logPath = os.DevNull
	}
	f, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("%s log: %w", name, err)
	}
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	f.Close()
	c.cmd = cmd
	go func() {
		err := cmd.Wait()
		if err != nil {
			fmt.Fprintf(c.tail, "(%s: %v)", name, err)
		}
		close(c.done)
	}()
	return c, nil
}

func (c *child) pid() int { return c.cmd.Process.Pid }

func (c *child) running() bool {
	select {
	case <-c.done:
		return false
	default:
		return true
	}
}

// stop sends SIGTERM, waits up to 10 s, then kills; it removes c.dir.
func (c *child) stop() {
	if c == nil {
		return
	}
	if c.running() {
		_ = c.cmd.Process.Signal(syscall.SIGCONT)
		_ = c.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-c.done:
		case <-time.After(10 * time.Second):
			_ = c.cmd.Process.Kill()
			<-c.done
		}
	}
	if c.dir != "" {
		_ = os.RemoveAll(c.dir)
	}
}

// waitHTTP polls url until it answers 200 (and, if want is set, a body
// containing want), the child exits or 30 s pass.
func (c *child) waitHTTP(ctx context.Context, url, want string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	client := &http.Client{Timeout: time.Second}
	var last error
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := client.Do(req)
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK && strings.Contains(string(body), want) {
				return nil
			}
			err = fmt.Errorf("%s: %s", resp.Status, bytes.TrimSpace(body))
		}
		last = err
		select {
		case <-c.done:
			return fmt.Errorf("%s exited before it was ready %s (set its log file to see why)", c.name, c.tail.String())
		case <-ctx.Done():
			return fmt.Errorf("%s not ready at %s: %w (last: %v)", c.name, url, ctx.Err(), last)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// tailBuffer keeps the last few KiB written to it.
type tailBuffer struct {
	mu  sync.Mutex
	buf []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if n := len(t.buf); n > 4096 {
		t.buf = append(t.buf[:0:0], t.buf[n-4096:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.buf)
}

// freePort returns a loopback TCP port that was free a moment ago.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// etcd is a one-member etcd cluster on loopback ports with its data in a
// temporary directory (it fsyncs its WAL on every commit, as deployed).
type etcd struct {
	*child
	endpoint string
}

func startEtcd(ctx context.Context, logPath string) (*etcd, error) {
	path, err := exec.LookPath("etcd")
	if err != nil {
		return nil, errors.New("etcd not found in PATH: run `bash scripts/install-deps.sh --bench` (Debian: apt-get install etcd-server)")
	}
	var errs []error
	for range 3 { // a port may be taken between freePort and etcd's bind
		dir, err := os.MkdirTemp("", "redfence-bench-etcd-")
		if err != nil {
			return nil, err
		}
		cport, err1 := freePort()
		pport, err2 := freePort()
		if err := errors.Join(err1, err2); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
		client := fmt.Sprintf("http://127.0.0.1:%d", cport)
		peer := fmt.Sprintf("http://127.0.0.1:%d", pport)
		args := []string{
			"--name", "bench", "--data-dir", filepath.Join(dir, "data"),
			"--listen-client-urls", client, "--advertise-client-urls", client,
			"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
			"--initial-cluster", "bench=" + peer, "--initial-cluster-state", "new",
			"--logger", "zap", "--log-level", "error",
		}
		c, err := startChild("etcd", path, args, nil, logPath, dir)
		if err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
		if err := c.waitHTTP(ctx, client+"/health", `"health":"true"`); err != nil {
			c.stop()
			errs = append(errs, err)
			continue
		}
		return &etcd{child: c, endpoint: client}, nil
	}
	return nil, errors.Join(errs...)
}

func (e *etcd) version() string {
	out, err := exec.Command(e.cmd.Path, "--version").Output()
	if err != nil {
		return "?"
	}
	v, _, _ := strings.Cut(strings.TrimPrefix(string(out), "etcd Version: "), "\n")
	return v
}

// redfenceServer is a `redfence serve` process.
type redfenceServer struct {
	*child
	base string // http://127.0.0.1:PORT
}

func startRedfence(ctx context.Context, bin string, redisAddrs []string, dbURL string, extraEnv []string, logPath string) (*redfenceServer, error) {
	var errs []error
	for range 3 {
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		env := append([]string{
			"REDFENCE_LISTEN_ADDR=" + addr,
			"REDFENCE_REDIS_ADDRS=" + strings.Join(redisAddrs, ","),
			"REDFENCE_DATABASE_URL=" + dbURL,
		}, extraEnv...)
		c, err := startChild("redfence serve", bin, []string{"serve"}, env, logPath, "")
		if err != nil {
			return nil, err
		}
		if err := c.waitHTTP(ctx, "http://"+addr+"/readyz", ""); err != nil {
			c.stop()
			errs = append(errs, err)
			continue
		}
		return &redfenceServer{child: c, base: "http://" + addr}, nil
	}
	return nil, errors.Join(errs...)
}

// buildRedfence builds cmd/redfence of the main module at src into dir. An
// overlay file (go build -overlay) may add files to the package without
// touching the source tree.
func buildRedfence(ctx context.Context, src, dir, overlay string) (string, error) {
	out := filepath.Join(dir, "redfence")
	args := []string{"build", "-o", out}
	if overlay != "" {
		args = append(args, "-overlay", overlay)
	}
	args = append(args, "./cmd/redfence")
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = src
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/redfence in %s: %w\n%s", src, err, b)
	}
	return out, nil
}

// createAPIKey creates an API key with the locks scope through `redfence keys
// create` (the server's production default requires one). A binary without
// that command gives "", and the server then runs with REDFENCE_AUTH=false.
func createAPIKey(ctx context.Context, bin, dbURL string) (string, error) {
	cmd := exec.CommandContext(ctx, bin, "keys", "create", "--tenant", "bench", "--scope", "locks")
	cmd.Env = append(os.Environ(), "REDFENCE_DATABASE_URL="+dbURL)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		if strings.Contains(stderr.String(), "unknown command") {
			return "", nil
		}
		return "", fmt.Errorf("redfence keys create: %w: %s", err, stderr.String())
	}
	return strings.TrimSpace(string(out)), nil
}
