//go:build unix

package cluster

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/redfence/redfence/internal/childproc"
)

const (
	// startTimeout bounds how long a server may take to become ready after
	// it was launched.
	startTimeout = 10 * time.Second
	// pollInterval is the readiness polling period.
	pollInterval = 10 * time.Millisecond
	// portAttempts is how many free ports a first start tries before giving
	// up when another process keeps taking the chosen port.
	portAttempts = 5
	// tailSize is how much of a server's output is kept for error messages.
	tailSize = 4 << 10
)

// errPortInUse reports that a server could not listen on its port because
// another process took it between freePort and the server's bind.
var errPortInUse = errors.New("cluster: port already in use")

// errNotRunning reports an operation that needs a running server.
var errNotRunning = errors.New("cluster: server is not running")

// backend is one server instance: a local process or a Docker container.
// Every launch starts a new run; exited is closed when that run has ended
// and has been reaped.
type backend interface {
	// launch starts a new run. It does not wait for readiness.
	launch(ctx context.Context) error
	// exited returns a channel closed when the current run has ended. It is
	// closed already when no run was ever launched.
	exited() <-chan struct{}
	// pid is the main process id of the current run, 0 when unknown
	// (containers) or not running.
	pid() int
	// signal delivers sig to the main process only.
	signal(sig syscall.Signal) error
	// pause stops the server and all its child processes (SIGSTOP).
	pause() error
	// resume continues what pause stopped (SIGCONT).
	resume() error
	// kill sends SIGKILL to the server and all its child processes. It does
	// not wait.
	kill() error
	// output returns the tail of the current run's output.
	output() string
	// remove releases what the backend holds outside the process (a
	// container); the run must have ended.
	remove() error
}

// running reports whether b has a run that has not ended.
func running(b backend) bool {
	select {
	case <-b.exited():
		return false
	default:
		return true
	}
}

// waitExit waits until the current run of b has ended or ctx is done.
func waitExit(ctx context.Context, b backend) error {
	select {
	case <-b.exited():
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// terminate asks b to exit with sig and waits for it. If ctx ends first, or
// the signal cannot be delivered, b is killed. It is a no-op when b is not
// running.
func terminate(ctx context.Context, b backend, sig syscall.Signal) error {
	if !running(b) {
		return nil
	}
	// A stopped process does not act on SIGTERM, SIGINT or SIGQUIT.
	_ = b.resume()
	err := b.signal(sig)
	if err == nil {
		err = waitExit(ctx, b)
	}
	if err == nil || !running(b) {
		return nil
	}
	if kerr := killWait(b); kerr != nil {
		return errors.Join(err, kerr)
	}
	return fmt.Errorf("cluster: killed after %v: %w", sig, err)
}

// killWait kills b and waits for the run to be reaped. Reaping after
// SIGKILL cannot block for long, so it takes no context.
func killWait(b backend) error {
	if !running(b) {
		return nil
	}
	if err := b.kill(); err != nil && running(b) {
		return err
	}
	<-b.exited()
	return nil
}

// waitReady polls probe every pollInterval until it succeeds, b exits, ctx
// ends or startTimeout passes. what names the server in errors.
func waitReady(ctx context.Context, b backend, what string, probe func(ctx context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	exit := b.exited()
	for {
		pctx, pcancel := context.WithTimeout(ctx, time.Second)
		go func() {
			// Do not let a probe hang on a port that another process
			// took while ours has already given up.
			select {
			case <-exit:
				pcancel()
			case <-pctx.Done():
			}
		}()
		err := probe(pctx)
		pcancel()
		if err == nil {
			return nil
		}
		if errors.Is(err, errPortInUse) {
			return fmt.Errorf("%w: %s answered for another server", errPortInUse, what)
		}
		select {
		case <-exit:
			out := b.output()
			if strings.Contains(out, "Address already in use") {
				return fmt.Errorf("%w: %s exited:\n%s", errPortInUse, what, out)
			}
			return fmt.Errorf("cluster: %s exited before it was ready:\n%s", what, out)
		case <-ctx.Done():
			return fmt.Errorf("cluster: %s not ready: %w (last probe: %v); output:\n%s", what, ctx.Err(), err, b.output())
		case <-tick.C:
		}
	}
}

// startOnFreePort calls start with fresh free ports until the server comes
// up or fails for another reason than a port taken meanwhile.
func startOnFreePort(what string, start func(port int) error) error {
	var err error
	for range portAttempts {
		port, perr := freePort()
		if perr != nil {
			return perr
		}
		err = start(port)
		if !errors.Is(err, errPortInUse) {
			return err
		}
	}
	return fmt.Errorf("cluster: start %s: gave up after %d ports: %w", what, portAttempts, err)
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("cluster: find a free port: %w", err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	if err := ln.Close(); err != nil {
		return 0, fmt.Errorf("cluster: find a free port: %w", err)
	}
	return port, nil
}

// output keeps the tail of a server's output and copies it to an optional
// log writer.
type output struct {
	log io.Writer

	mu   sync.Mutex
	tail []byte
}

// Write implements io.Writer. Errors of the log writer are ignored so that a
// broken log cannot stall the server.
func (o *output) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.tail = append(o.tail, p...)
	if n := len(o.tail); n > tailSize {
		o.tail = append(o.tail[:0:0], o.tail[n-tailSize:]...)
	}
	if o.log != nil {
		_, _ = o.log.Write(p)
	}
	return len(p), nil
}

func (o *output) reset() {
	o.mu.Lock()
	o.tail = nil
	o.mu.Unlock()
}

func (o *output) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return string(o.tail)
}

// lockedWriter serialises writes of several servers to one writer.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// syncLog wraps w so that several servers can share it; nil stays nil.
func syncLog(w io.Writer) io.Writer {
	if w == nil {
		return nil
	}
	if _, ok := w.(*lockedWriter); ok {
		return w
	}
	return &lockedWriter{w: w}
}

// process is a backend that runs a local binary.
type process struct {
	path string
	args []string
	dir  string
	cred *syscall.Credential
	out  *output

	mu   sync.Mutex
	proc *os.Process
	exit chan struct{}
	err  error // result of Wait for the last run
}

func newProcess(path string, args []string, dir string, cred *syscall.Credential, out *output) *process {
	exit := make(chan struct{})
	close(exit)
	return &process{path: path, args: args, dir: dir, cred: cred, out: out, exit: exit}
}

func (p *process) launch(context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.exit:
	default:
		return fmt.Errorf("cluster: %s is already running", filepath.Base(p.path))
	}
	p.out.reset()
	// Not exec.CommandContext: the server must outlive the start context.
	cmd := exec.Command(p.path, p.args...)
	cmd.Dir = p.dir
	cmd.Stdout = p.out
	cmd.Stderr = p.out
	cmd.SysProcAttr = sysProcAttr(p.cred)
	// Grandchildren may hold the output pipe open; do not let them delay
	// the reaping of the server itself.
	cmd.WaitDelay = 2 * time.Second
	// The parent-death signal follows the thread that forks the server:
	// childproc holds that thread until the server exits.
	waited, err := childproc.Start(cmd)
	if err != nil {
		return fmt.Errorf("cluster: start %s: %w", p.path, err)
	}
	exit := make(chan struct{})
	go func() {
		err := <-waited
		p.mu.Lock()
		p.err = err
		p.mu.Unlock()
		close(exit)
	}()
	p.proc, p.exit, p.err = cmd.Process, exit, nil
	return nil
}

func (p *process) exited() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exit
}

// current returns the running process, or errNotRunning.
func (p *process) current() (*os.Process, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.exit:
		return nil, errNotRunning
	default:
		return p.proc, nil
	}
}

func (p *process) pid() int {
	proc, err := p.current()
	if err != nil {
		return 0
	}
	return proc.Pid
}

func (p *process) signal(sig syscall.Signal) error {
	proc, err := p.current()
	if err != nil {
		return err
	}
	// os.Process uses a pidfd on Linux, so this cannot hit a reused pid.
	if err := proc.Signal(sig); err != nil {
		return fmt.Errorf("cluster: signal %v to pid %d: %w", sig, proc.Pid, err)
	}
	return nil
}

// pause stops the main process first, so that it cannot fork while its
// descendants are being collected. Postgres backends call setsid, so
// signalling the process group would not reach them.
func (p *process) pause() error {
	if err := p.signal(syscall.SIGSTOP); err != nil {
		return err
	}
	return signalPids(descendants(p.pid()), syscall.SIGSTOP)
}

func (p *process) resume() error {
	proc, err := p.current()
	if err != nil {
		return err
	}
	// Children first: they remain children of the main process while it
	// is stopped, so none is missed.
	err = signalPids(descendants(proc.Pid), syscall.SIGCONT)
	return errors.Join(err, p.signal(syscall.SIGCONT))
}

func (p *process) kill() error {
	proc, err := p.current()
	if err != nil {
		return err
	}
	// Stop it so that it neither forks nor gets reparented children while
	// they are collected; SIGKILL works on stopped processes.
	_ = proc.Signal(syscall.SIGSTOP)
	kids := descendants(proc.Pid)
	err = p.signal(syscall.SIGKILL)
	return errors.Join(err, signalPids(kids, syscall.SIGKILL))
}

func (p *process) output() string {
	out := p.out.String()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err != nil {
		out += "(" + p.err.Error() + ")\n"
	}
	return out
}

func (p *process) remove() error { return nil }

// signalPids sends sig to each pid, ignoring processes that are gone.
func signalPids(pids []int, sig syscall.Signal) error {
	var errs []error
	for _, pid := range pids {
		if err := syscall.Kill(pid, sig); err != nil && !errors.Is(err, syscall.ESRCH) {
			errs = append(errs, fmt.Errorf("cluster: signal %v to pid %d: %w", sig, pid, err))
		}
	}
	return errors.Join(errs...)
}

// descendants returns the pids of all descendants of pid, read from /proc.
// It returns nil when pid is 0 or /proc cannot be read.
func descendants(pid int) []int {
	if pid <= 0 {
		return nil
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	children := make(map[int][]int)
	for _, e := range entries {
		child, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue // exited meanwhile
		}
		// "pid (comm) state ppid ...": comm may contain spaces and ')'.
		i := strings.LastIndexByte(string(stat), ')')
		if i < 0 {
			continue
		}
		fields := strings.Fields(string(stat[i+1:]))
		if len(fields) < 2 {
			continue
		}
		ppid, err := strconv.Atoi(fields[1])
		if err != nil {
			continue
		}
		children[ppid] = append(children[ppid], child)
	}
	var out []int
	queue := children[pid]
	for len(queue) > 0 {
		c := queue[0]
		queue = queue[1:]
		out = append(out, c)
		queue = append(queue, children[c]...)
	}
	return out
}

// pgCredential returns the credential to run Postgres with: the postgres
// user when running as root (Postgres refuses to run as root), otherwise nil
// (the current user).
func pgCredential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("cluster: Postgres cannot run as root and there is no postgres user: %w", err)
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("cluster: uid of user postgres: %w", err)
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("cluster: gid of user postgres: %w", err)
	}
	// Groups is empty, so root's supplementary groups are dropped.
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}
