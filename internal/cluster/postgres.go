//go:build unix

package cluster

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/redfence/redfence/internal/childproc"
)

// PostgresOptions configures a Postgres server.
type PostgresOptions struct {
	// Durable keeps fsync and full_page_writes on. The default turns them
	// off for speed: data then survives a server crash or Stop(immediate)
	// but not an operating system crash.
	Durable bool
	// Log receives the server's output; nil discards it. It is written from
	// another goroutine.
	Log io.Writer
	// Dir is the directory in which the server's temporary directory is
	// created; "" means os.TempDir(). When running as root it must be
	// searchable by the postgres user.
	Dir string
}

// Postgres is one Postgres server listening on 127.0.0.1 with trust
// authentication for the user postgres, run from the local binaries or,
// when they are missing, in a Docker container. Its port and data stay the
// same across Stop and Start.
//
// Lifecycle methods are safe for concurrent use; they are serialised.
type Postgres struct {
	opts PostgresOptions
	port int
	dir  string // temporary directory; "" for a container
	data string // data directory; "" for a container
	out  *output
	seq  atomic.Uint64 // makes database names unique

	mu     sync.Mutex // serialises lifecycle operations
	b      backend
	closed bool
}

// StartPostgres initialises a data directory and starts Postgres on a free
// loopback port, waiting until it accepts connections. It uses initdb and
// postgres from PATH or /usr/lib/postgresql/*/bin, or a postgres:15-alpine
// container if they are missing and a Docker engine answers. When running
// as root, the server runs as the postgres user.
func StartPostgres(ctx context.Context, opts PostgresOptions) (*Postgres, error) {
	p := &Postgres{opts: opts, out: &output{log: opts.Log}}
	bin, err := postgresBin()
	if err != nil {
		pool, derr := dockerPool()
		if derr != nil {
			return nil, fmt.Errorf("cluster: postgres and initdb not found in PATH or /usr/lib/postgresql/*/bin; install them (Debian/Ubuntu: apt-get install postgresql) or start a Docker engine (%v)", derr)
		}
		spec := containerSpec{
			repository: "postgres",
			tag:        "15-alpine",
			env:        []string{"POSTGRES_HOST_AUTH_METHOD=trust"},
			cmd:        append([]string{"postgres"}, p.settings()...),
			port:       "5432/tcp",
		}
		err = startOnFreePort("postgres", func(port int) error {
			p.port = port
			c, err := runContainer(ctx, pool, spec, port, p.out)
			if err != nil {
				return err
			}
			p.b = c
			if err := p.waitReady(ctx); err != nil {
				return errors.Join(err, killWait(c), c.remove())
			}
			return nil
		})
		if err != nil {
			return nil, err
		}
		return p, nil
	}

	cred, err := pgCredential()
	if err != nil {
		return nil, err
	}
	if err := p.initdb(ctx, bin, cred); err != nil {
		if p.dir != "" {
			err = errors.Join(err, os.RemoveAll(p.dir))
		}
		return nil, err
	}
	sock := filepath.Join(p.dir, "sock")
	err = startOnFreePort("postgres", func(port int) error {
		p.port = port
		args := []string{"-D", p.data, "-p", strconv.Itoa(port), "-k", sock, "-c", "listen_addresses=127.0.0.1"}
		args = append(args, p.settings()...)
		p.b = newProcess(filepath.Join(bin, "postgres"), args, p.dir, cred, p.out)
		return p.start(ctx)
	})
	if err != nil {
		return nil, errors.Join(err, os.RemoveAll(p.dir))
	}
	return p, nil
}

// settings are the -c options common to local and container servers.
func (p *Postgres) settings() []string {
	durable := "off"
	if p.opts.Durable {
		durable = "on"
	}
	return []string{
		"-c", "fsync=" + durable,
		"-c", "full_page_writes=" + durable,
		// synchronous_commit keeps its default (on) and stays
		// reloadable: a command-line setting would hide what a reload
		// does to live sessions (Redfence's set it for themselves).
		"-c", "max_connections=200",
	}
}

// initdb creates p.dir with the data directory and the socket directory,
// both owned by cred's user.
func (p *Postgres) initdb(ctx context.Context, bin string, cred *syscall.Credential) error {
	removeOrphanDirs(p.opts.Dir, "redfence-pg-")
	dir, err := os.MkdirTemp(p.opts.Dir, "redfence-pg-")
	if err != nil {
		return fmt.Errorf("cluster: postgres temp dir: %w", err)
	}
	p.dir = dir
	if err := claimDir(dir); err != nil {
		return fmt.Errorf("cluster: postgres temp dir: %w", err)
	}
	if p.dir, err = filepath.Abs(dir); err != nil {
		return fmt.Errorf("cluster: postgres temp dir: %w", err)
	}
	p.data = filepath.Join(p.dir, "data")
	sock := filepath.Join(p.dir, "sock")
	if err := os.Mkdir(sock, 0o700); err != nil {
		return fmt.Errorf("cluster: postgres socket dir: %w", err)
	}
	if cred != nil {
		for _, d := range []string{p.dir, sock} {
			if err := os.Chown(d, int(cred.Uid), int(cred.Gid)); err != nil {
				return fmt.Errorf("cluster: postgres temp dir: %w", err)
			}
		}
	}
	args := []string{"-D", p.data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C", "--no-instructions"}
	if !p.opts.Durable {
		args = append(args, "--no-sync")
	}
	out := &output{log: p.opts.Log}
	cmd := exec.CommandContext(ctx, filepath.Join(bin, "initdb"), args...)
	cmd.Dir = p.dir
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = sysProcAttr(cred)
	cmd.WaitDelay = 2 * time.Second
	// Through childproc, as every child here: its parent-death signal
	// follows the thread that forked it, which must not end before it does.
	exited, err := childproc.Start(cmd)
	if err == nil {
		err = <-exited
	}
	if err != nil {
		return fmt.Errorf("cluster: initdb: %w:\n%s", err, out)
	}
	return nil
}

// postgresBin returns the directory holding initdb and postgres: the one on
// PATH, else the newest /usr/lib/postgresql/VERSION/bin.
func postgresBin() (string, error) {
	if path, err := exec.LookPath("postgres"); err == nil {
		dir := filepath.Dir(path)
		if _, err := os.Stat(filepath.Join(dir, "initdb")); err == nil {
			return dir, nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	version := func(dir string) int {
		v, _ := strconv.Atoi(filepath.Base(filepath.Dir(dir)))
		return v
	}
	slices.SortFunc(dirs, func(a, b string) int { return version(b) - version(a) })
	for _, dir := range dirs {
		_, err1 := os.Stat(filepath.Join(dir, "postgres"))
		_, err2 := os.Stat(filepath.Join(dir, "initdb"))
		if err1 == nil && err2 == nil {
			return dir, nil
		}
	}
	return "", errors.New("cluster: postgres binaries not found")
}

// start launches the server and waits until it accepts connections; on
// failure it leaves it not running.
func (p *Postgres) start(ctx context.Context) error {
	if err := p.b.launch(ctx); err != nil {
		return fmt.Errorf("cluster: start postgres on port %d: %w", p.port, err)
	}
	if err := p.waitReady(ctx); err != nil {
		return errors.Join(err, killWait(p.b))
	}
	return nil
}

// waitReady waits until the server accepts connections. For a local server
// it also checks that the answering server uses this data directory, not
// another one that took the port.
func (p *Postgres) waitReady(ctx context.Context) error {
	url := p.URL()
	return waitReady(ctx, p.b, "postgres on port "+strconv.Itoa(p.port), func(ctx context.Context) error {
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			return err
		}
		defer conn.Close(context.WithoutCancel(ctx))
		var dir string
		if err := conn.QueryRow(ctx, "SELECT current_setting('data_directory')").Scan(&dir); err != nil {
			return err
		}
		if p.data != "" && dir != p.data {
			return fmt.Errorf("%w: data_directory %s, want %s", errPortInUse, dir, p.data)
		}
		return nil
	})
}

// URL returns the URL of the postgres database:
// postgres://postgres@127.0.0.1:PORT/postgres?sslmode=disable.
func (p *Postgres) URL() string { return p.databaseURL("postgres") }

func (p *Postgres) databaseURL(db string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", p.port, db)
}

// PID returns the process id of the running postmaster, or 0 when it is
// not running or runs in a container.
func (p *Postgres) PID() int { return p.b.pid() }

// Running reports whether the postmaster is running (a paused one is).
func (p *Postgres) Running() bool { return running(p.b) }

// CreateDatabase creates a fresh, empty database and returns its URL. Its
// name is derived from name (for example a t.Name()): lower-cased, other
// characters than [a-z0-9_] replaced by '_', truncated and hashed to fit 63
// bytes, and suffixed with a sequence number, so every call gets a new
// database.
func (p *Postgres) CreateDatabase(ctx context.Context, name string) (string, error) {
	db := databaseName(name, p.seq.Add(1))
	conn, err := pgx.Connect(ctx, p.URL())
	if err != nil {
		return "", fmt.Errorf("cluster: create database %s: %w", db, err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{db}.Sanitize()); err != nil {
		return "", fmt.Errorf("cluster: create database %s: %w", db, err)
	}
	return p.databaseURL(db), nil
}

// databaseName derives a valid, unquoted-safe database name from name and
// seq.
func databaseName(name string, seq uint64) string {
	const maxLen = 63 // NAMEDATALEN-1
	base := strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9', r == '_':
			return r
		case r >= 'A' && r <= 'Z':
			return r - 'A' + 'a'
		default:
			return '_'
		}
	}, name)
	if base == "" || base[0] >= '0' && base[0] <= '9' {
		base = "db_" + base
	}
	suffix := "_" + strconv.FormatUint(seq, 10)
	if len(base)+len(suffix) > maxLen {
		sum := sha256.Sum256([]byte(name))
		hash := "_" + hex.EncodeToString(sum[:4])
		base = base[:maxLen-len(suffix)-len(hash)] + hash
	}
	return base + suffix
}

// Pause stops the postmaster and all its child processes with SIGSTOP
// (docker pause for a container). Connections hang until Resume.
func (p *Postgres) Pause() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.b.pause(); err != nil {
		return fmt.Errorf("cluster: pause postgres on port %d: %w", p.port, err)
	}
	return nil
}

// Resume continues what Pause stopped with SIGCONT.
func (p *Postgres) Resume() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.b.resume(); err != nil {
		return fmt.Errorf("cluster: resume postgres on port %d: %w", p.port, err)
	}
	return nil
}

// Stop shuts the server down and waits until it has exited. With immediate
// it sends SIGQUIT to the postmaster (like pg_ctl -m immediate: no
// checkpoint, crash recovery on the next start); otherwise SIGINT (fast
// shutdown). A paused server is resumed first. If ctx ends first the
// server is killed and the error wraps ctx.Err(). It does nothing when the
// server is not running.
func (p *Postgres) Stop(ctx context.Context, immediate bool) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	sig := syscall.SIGINT
	if immediate {
		sig = syscall.SIGQUIT
	}
	if err := terminate(ctx, p.b, sig); err != nil {
		return fmt.Errorf("cluster: stop postgres on port %d: %w", p.port, err)
	}
	return nil
}

// Start starts a stopped server again on the same port and data directory
// and waits until it accepts connections. It fails if the server is
// running, closed, or the port has been taken by another process.
func (p *Postgres) Start(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return fmt.Errorf("cluster: start postgres on port %d: closed", p.port)
	}
	return p.start(ctx)
}

// Close stops the server immediately if it is running and removes its
// data. It is idempotent.
func (p *Postgres) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := terminate(ctx, p.b, syscall.SIGQUIT)
	err = errors.Join(err, p.b.remove())
	if p.dir != "" {
		err = errors.Join(err, os.RemoveAll(p.dir))
	}
	if err != nil {
		return fmt.Errorf("cluster: close postgres on port %d: %w", p.port, err)
	}
	return nil
}
