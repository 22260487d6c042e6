//go:build unix

package main

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/term"

	"github.com/redfence/redfence/client"
	"github.com/redfence/redfence/internal/childproc"
)

const lockHelp = `Usage: redfence lock [flags] NAME -- COMMAND [ARGS...]

Runs COMMAND while holding the lock NAME, like etcdctl lock and consul lock:
acquires the lock (waiting up to --wait), runs COMMAND with
REDFENCE_LOCK_NAME and REDFENCE_FENCING_TOKEN in its environment, renews
the lease every third of --ttl while it runs, releases the lock when it
exits, and exits with its status (128+N if signal N ended it).

If the lease is lost (a renewal is refused, or the server cannot renew it in
time), COMMAND's process group gets SIGTERM before the lease's deadline, and
SIGKILL --grace later, still before the deadline (less a safety of a tenth of
the TTL, at most 1s); redfence lock then exits non-zero. When COMMAND exits,
what is left of its process group (background children) is stopped the same
way before the lock is released. SIGINT, SIGTERM,
SIGHUP and SIGQUIT sent to redfence lock are forwarded to COMMAND's process
group (SIGHUP stays ignored if it was at start: nohup). COMMAND runs in a process group of its own, so that all of it can be
stopped: it cannot read from the terminal (a terminal on stdin reads as
end-of-file; a pipe or file is passed through).

A lease can still end while this machine is paused, unnoticed until it
resumes: pass REDFENCE_FENCING_TOKEN with every write, to storage that
checks it.

--grace plus that safety must be at most half of --ttl, so that a renewal
has time before COMMAND would be stopped; --max-hold, if set, at least --ttl.

Exit status: COMMAND's, or 1 if the lock could not be acquired or the lease
was lost while COMMAND exited 0, 127 if COMMAND was not found, 126 if it
could not be run, 128+N if signal N (SIGINT, SIGTERM, SIGHUP) came while
waiting for the lock.

Flags:
`

// lockFlags are the parsed flags of redfence lock.
type lockFlags struct {
	server  string
	apiKey  string
	ttl     time.Duration
	wait    time.Duration
	grace   time.Duration
	maxHold time.Duration
	owner   string
	verbose bool
	// caFile, certFile and keyFile set up TLS to the server: the CAs to
	// trust, and the client certificate for a server that asks for one.
	caFile, certFile, keyFile string
}

// parseLockArgs parses [flags] NAME [flags] [--] COMMAND [ARGS...].
// The help (-h) goes to stdout; errors go to stderr.
func parseLockArgs(args []string, stdout, stderr io.Writer) (*lockFlags, string, []string, error) {
	f := &lockFlags{}
	fs := flag.NewFlagSet("lock", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {} // the help is printed below, to stdout, when asked for
	host, _ := os.Hostname()
	// The environment's values are applied after parsing, not as flag
	// defaults: the usage text prints defaults, and the API key is a secret.
	fs.StringVar(&f.server, "server", "", "Redfence base URL (default $REDFENCE_SERVER, else http://127.0.0.1:8080)")
	fs.StringVar(&f.apiKey, "api-key", "", "API key sent as a bearer token (default $REDFENCE_API_KEY; prefer it: other local users can read a command line)")
	fs.DurationVar(&f.ttl, "ttl", 10*time.Second, "lease length; renewed every ttl/3 while COMMAND runs")
	fs.DurationVar(&f.wait, "wait", 0, "how long to wait for the lock when it is held (0: try once)")
	fs.DurationVar(&f.grace, "grace", 2*time.Second, "time between SIGTERM and SIGKILL when the lease is lost, or for what is left of COMMAND's process group when it exits")
	fs.DurationVar(&f.maxHold, "max-hold", 0, "never hold the lock longer than this after it was granted (0: no cap): no renewal goes past it, so the last lease ends up to about --ttl before it; COMMAND is then stopped as on a loss, --grace before that lease ends")
	fs.StringVar(&f.owner, "owner", fmt.Sprintf("%s:%d", host, os.Getpid()), "owner label shown by GET /v1/locks/NAME and in the audit log")
	fs.BoolVar(&f.verbose, "v", false, "print lease events (acquired, renewed, lost, signals) with timestamps to stderr")
	fs.StringVar(&f.caFile, "cacert", "", "PEM file of the CAs that sign an https server's certificate (default $REDFENCE_CA_FILE, else the system's)")
	fs.StringVar(&f.certFile, "cert", "", "PEM client certificate, for a server that requires one (mutual TLS; default $REDFENCE_CLIENT_CERT_FILE)")
	fs.StringVar(&f.keyFile, "key", "", "PEM private key of --cert (default $REDFENCE_CLIENT_KEY_FILE)")

	before, command, dashes := args, []string(nil), false
	for i, a := range args {
		if a == "--" {
			before, command, dashes = args[:i], args[i+1:], true
			break
		}
	}
	var positional []string
	for rest := before; ; {
		if err := fs.Parse(rest); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				fmt.Fprint(stdout, lockHelp)
				fs.SetOutput(stdout)
				fs.PrintDefaults()
				return nil, "", nil, flag.ErrHelp
			}
			fmt.Fprint(stderr, lockHelp) // after flag's own line on the error
			fs.PrintDefaults()
			return nil, "", nil, errUsage
		}
		rest = fs.Args()
		if len(rest) == 0 {
			break
		}
		positional = append(positional, rest[0])
		if !dashes {
			// No "--": NAME is the first argument, the command the rest.
			command = rest[1:]
			break
		}
		rest = rest[1:]
	}
	if f.server == "" {
		f.server = cmp.Or(os.Getenv("REDFENCE_SERVER"), "http://127.0.0.1:8080")
	}
	if f.apiKey == "" {
		f.apiKey = os.Getenv("REDFENCE_API_KEY")
	}
	f.caFile = cmp.Or(f.caFile, os.Getenv("REDFENCE_CA_FILE"))
	f.certFile = cmp.Or(f.certFile, os.Getenv("REDFENCE_CLIENT_CERT_FILE"))
	f.keyFile = cmp.Or(f.keyFile, os.Getenv("REDFENCE_CLIENT_KEY_FILE"))
	switch {
	case len(positional) != 1:
		fmt.Fprintf(stderr, "redfence lock: want one lock NAME before the command, got %q\n", positional)
		return nil, "", nil, errUsage
	case len(command) == 0:
		fmt.Fprintln(stderr, "redfence lock: no command given: redfence lock NAME -- COMMAND [ARGS...]")
		return nil, "", nil, errUsage
	case f.ttl <= 0 || f.wait < 0 || f.grace < 0 || f.maxHold < 0:
		fmt.Fprintln(stderr, "redfence lock: --ttl must be positive; --wait, --grace and --max-hold not negative")
		return nil, "", nil, errUsage
	}
	return f, positional[0], command, nil
}

// httpClient is the client's HTTP client: the default one, with the TLS
// settings of --cacert, --cert and --key when any is given.
func (f *lockFlags) httpClient() (*http.Client, error) {
	if f.caFile == "" && f.certFile == "" && f.keyFile == "" {
		return nil, nil // client.New's default
	}
	cfg, err := clientTLS("--cacert", f.caFile, "--cert / --key", f.certFile, f.keyFile)
	if err != nil {
		return nil, err
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = cfg
	return &http.Client{Transport: tr}, nil
}

// lockSafety is how long before the lease's deadline the command must be
// dead: a tenth of the TTL, at most 1s.
func lockSafety(ttl time.Duration) time.Duration { return min(ttl/10, time.Second) }

// lockDiagBytes bounds redfence lock's own lines waiting for stderr: a
// Write never waits (those beyond are dropped, and counted), so a stderr
// that takes nothing holds up neither the renewals nor, once the lease is
// lost, the signals to the command (which writes to stderr directly).
const lockDiagBytes = 64 << 10

func cmdLock(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	f, name, command, err := parseLockArgs(args, stdout, stderr)
	if err != nil {
		return helpOK(err)
	}
	safety := lockSafety(f.ttl)
	if f.grace+safety > f.ttl/2 {
		// The renewal, a third of the TTL in, must have a sixth of it
		// before the command is stopped (client.LockOptions.Margin).
		fmt.Fprintf(stderr, "redfence lock: --grace %v plus the safety %v must be at most half of --ttl %v, to leave time for a renewal\n", f.grace, safety, f.ttl)
		return errUsage
	}
	if f.maxHold > 0 && f.maxHold < f.ttl {
		fmt.Fprintf(stderr, "redfence lock: --max-hold %v is shorter than --ttl %v: the first lease would outlast it\n", f.maxHold, f.ttl)
		return errUsage
	}
	// The command is looked up first: one that cannot run takes no lock
	// (and burns no fencing token), and fails as a shell would.
	path, err := exec.LookPath(command[0])
	if err == nil {
		err = checkInterpreter(path)
	}
	if err != nil {
		fmt.Fprintf(stderr, "redfence lock: %v\n", err)
		if errors.Is(err, fs.ErrPermission) || errors.Is(err, syscall.EISDIR) {
			return &exitError{code: 126}
		}
		return &exitError{code: 127}
	}
	// While it supervises the command, nothing may stop redfence lock
	// without stopping the command: Ctrl-Z (SIGTSTP) and background
	// terminal I/O would stop it alone (the command runs in its own
	// process group) while the command ran on past the lease, and a closed
	// stderr pipe (SIGPIPE) would kill it. They are caught and dropped,
	// not ignored: an ignored signal stays ignored in the command (SIG_IGN
	// survives exec), a caught one does not. (SIGSTOP and SIGKILL cannot
	// be caught: the command then gets SIGKILL with it, see runLocked.)
	absorbed := make(chan os.Signal, 1)
	signal.Notify(absorbed, syscall.SIGTSTP, syscall.SIGTTIN, syscall.SIGTTOU, syscall.SIGPIPE)
	defer signal.Stop(absorbed)
	// Its own lines never wait for stderr: one that takes nothing must
	// hold up neither the renewals nor the signals to the command once
	// the lease is lost (COMMAND writes to stderr directly).
	diag := newAsyncWriterBounds(stderr, lockDiagBytes, 0, time.Second)
	diag.reportDrops(func(n int) {
		fmt.Fprintf(diag, "redfence lock: %d lines of its own dropped: stderr took none for a while\n", n)
	})
	defer diag.Close()
	ev := &lockEvents{w: diag, verbose: f.verbose}
	hc, err := f.httpClient()
	if err != nil {
		return err
	}
	c, err := client.New(f.server, client.Options{
		APIKey: f.apiKey, Owner: f.owner, HTTPClient: hc,
		Logger: slog.New(slog.NewTextHandler(ev.debugWriter(), &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		return err
	}
	// A signal that ends the acquire (main's context) ends redfence lock
	// as it would have ended the command: 128+N. So does one that comes
	// after the grant, before runLocked forwards them (see early there):
	// stopped stays set up until then.
	stopped := make(chan os.Signal, 1)
	signal.Notify(stopped, shutdownSignals()...)
	defer signal.Stop(stopped)
	lease, err := c.Acquire(ctx, name, &client.LockOptions{
		TTL: f.ttl, Wait: f.wait, MaxHold: f.maxHold,
		// Done closes early enough for SIGTERM, the grace period and the
		// safety to fit before the deadline.
		Margin:  f.grace + safety,
		OnRenew: func(d time.Time) { ev.printf("renewed %q until %s", name, stamp(d)) },
	})
	if err != nil {
		// A signal goes to each channel in turn: main's context may have
		// been cancelled by it (ending the acquire) before it reached
		// stopped. Stop waits for that delivery to end (see
		// signal.Stop), so it is in stopped by now.
		signal.Stop(stopped)
		select {
		case sig := <-stopped:
			fmt.Fprintf(diag, "redfence lock: %v while acquiring %q: no lock taken\n", sig, name)
			return &exitError{code: 128 + int(sig.(syscall.Signal))}
		default:
		}
		return err // names the operation and the lock
	}
	ev.printf("acquired %q: fencing token %d, valid until %s", name, lease.FencingToken(), stamp(lease.Deadline()))

	status, lost := runLocked(ctx, lease, f, command, stdout, stderr, diag, ev, stopped)

	// Past the deadline the keys are expiring by themselves: the release
	// only tidies up, and gets a second at most.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), min(10*time.Second, max(time.Until(lease.Deadline()), time.Second)))
	defer cancel()
	if err := lease.ReleaseRetrying(rctx); err != nil && !lost {
		fmt.Fprintf(diag, "redfence lock: releasing %q: %v (it expires by itself within %v)\n", name, err, f.ttl)
	} else if err == nil {
		ev.printf("released %q", name)
	}
	if lost && status == 0 {
		status = 1
	}
	if status != 0 {
		return &exitError{code: status}
	}
	return nil
}

// runLocked runs command while lease lasts and returns its exit status, and
// whether the lease was lost (and the command therefore stopped). The
// command's output goes to stdout and stderr, redfence lock's own to diag.
// early is the channel the caller's signals (shutdownSignals) went to until
// now: one there, or one that comes before the command starts, ends
// redfence lock (128+N) without starting it, as it would have ended the
// command.
func runLocked(ctx context.Context, lease *client.Lease, f *lockFlags, command []string, stdout, stderr io.Writer, diag *asyncWriter, ev *lockEvents, early chan os.Signal) (status int, lost bool) {
	cmd := exec.Command(command[0], command[1:]...)
	cmd.Env = append(os.Environ(),
		"REDFENCE_LOCK_NAME="+lease.Name(),
		"REDFENCE_FENCING_TOKEN="+lease.FencingToken().String())
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, stdout, stderr
	if term.IsTerminal(int(os.Stdin.Fd())) {
		// COMMAND runs in a process group of its own, in the background of
		// the terminal: reading it would stop COMMAND (SIGTTIN) while the
		// lock is renewed for ever. It reads end-of-file instead.
		cmd.Stdin = nil
	}
	cmd.SysProcAttr = commandAttr()
	// Output copying (when stdout is not a file) must not outlive the
	// process group by much once it is gone.
	cmd.WaitDelay = time.Second

	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, append(shutdownSignals(), syscall.SIGQUIT)...)
	defer signal.Stop(sigs)
	// From here on sigs gets every signal: one that came before (between
	// the grant and the line above, when only early was set up) would
	// otherwise go unforwarded, and the command run to its end. Stop
	// first: it waits for a signal being delivered to reach early.
	signal.Stop(early)
	select {
	case s := <-early:
		fmt.Fprintf(diag, "redfence lock: %v before the command started: not run\n", s)
		return 128 + int(s.(syscall.Signal)), false
	default:
	}

	if err := lease.Err(); err != nil { // the grant came too late to use
		fmt.Fprintf(diag, "redfence lock: lease on %q ended before the command could start (%v)\n", lease.Name(), err)
		return 1, true
	}
	// What was printed before (the grant) is out before the command runs,
	// unless stderr takes nothing.
	diag.flush(250 * time.Millisecond)
	// childproc keeps the thread that forked the command alive until the
	// command is reaped: the parent-death signal (commandAttr) follows that
	// thread, not the process.
	exited, err := childproc.Start(cmd)
	if err != nil {
		fmt.Fprintf(diag, "redfence lock: %v\n", err)
		if errors.Is(err, fs.ErrPermission) || errors.Is(err, syscall.EISDIR) {
			return 126, false
		}
		return 127, false
	}
	pgid := cmd.Process.Pid
	signalGroup := func(s syscall.Signal) {
		if err := syscall.Kill(-pgid, s); err != nil && !errors.Is(err, syscall.ESRCH) {
			fmt.Fprintf(diag, "redfence lock: sending %v: %v\n", s, err)
		}
	}
	safety := lockSafety(f.ttl)
	var kill <-chan time.Time
	var killedAt time.Time // when SIGKILL was sent
	var graceGiven time.Duration
	// stop sends SIGTERM now and schedules SIGKILL after the grace period,
	// and in any case before the lease's deadline (less the safety).
	stop := func() {
		if kill != nil || !killedAt.IsZero() {
			return
		}
		signalGroup(syscall.SIGTERM)
		graceGiven = max(min(f.grace, time.Until(lease.Deadline().Add(-safety))), 0)
		kill = time.After(graceGiven)
	}
	// Once COMMAND has exited, what is left of its process group (children
	// it started in the background) is stopped the same way before the
	// lock is released: any of them could still act with the token.
	var (
		exitedStatus = -1
		poll         <-chan time.Time
	)
	groupGone := func() bool {
		// Members that exited are zombies until reaped: by us when they
		// were re-parented to us (we are PID 1 in a container, or a
		// subreaper). COMMAND itself was reaped by cmd.Wait.
		for {
			var ws syscall.WaitStatus
			if pid, err := syscall.Wait4(-pgid, &ws, syscall.WNOHANG, nil); pid <= 0 || err != nil {
				break
			}
		}
		return errors.Is(syscall.Kill(-pgid, 0), syscall.ESRCH)
	}
	leaseDone, ctxDone := lease.Done(), ctx.Done()
	for {
		select {
		case err := <-exited:
			exited = nil
			exitedStatus = exitStatus(cmd.ProcessState, err)
			if groupGone() {
				return exitedStatus, lost
			}
			ev.printf("the command exited; stopping the rest of its process group")
			stop()
			tick := time.NewTicker(10 * time.Millisecond)
			defer tick.Stop()
			poll = tick.C
		case <-poll:
			// Once SIGKILL is sent nothing of the group can act any more;
			// wait a little for it to be gone (a zombie that nobody reaps,
			// under a PID 1 that does not, would keep it forever).
			if groupGone() || !killedAt.IsZero() && time.Since(killedAt) > time.Second {
				return exitedStatus, lost
			}
		case s := <-sigs:
			ev.printf("forwarding %v to the command", s)
			signalGroup(s.(syscall.Signal))
		case <-ctxDone:
			ctxDone = nil
			// A signal cancels ctx too (signal.NotifyContext, whose cause
			// describes the signal) and is forwarded above; a plain
			// cancellation or deadline stops the command. The comparison is
			// ==, not errors.Is, on purpose: a signal's cause may wrap
			// context.Canceled, and must not match here.
			if cause := context.Cause(ctx); cause == context.Canceled || cause == context.DeadlineExceeded {
				ev.printf("stopping the command: %v", cause)
				stop()
			}
		case <-leaseDone:
			leaseDone = nil
			lost = true
			target := "the command"
			if exitedStatus >= 0 {
				target = "what is left of the command's process group"
			}
			stop()
			fmt.Fprintf(diag, "redfence lock: lease on %q lost (%v): sent SIGTERM to %s\n", lease.Name(), lease.Err(), target)
			ev.printf("sent SIGTERM; lease deadline %s", stamp(lease.Deadline()))
		case <-kill:
			kill = nil
			signalGroup(syscall.SIGKILL)
			killedAt = time.Now()
			within := fmt.Sprintf("--grace %v", f.grace)
			if graceGiven < f.grace {
				within = fmt.Sprintf("%v (--grace %v, cut short to end before the lease's deadline)", graceGiven.Round(time.Millisecond), f.grace)
			}
			fmt.Fprintf(diag, "redfence lock: the command's process group did not exit within %s: sent SIGKILL\n", within)
			ev.printf("sent SIGKILL")
		}
	}
}

// exitStatus is the shell's view of how a command ended: its exit code, or
// 128+N when signal N killed it.
func exitStatus(ps *os.ProcessState, err error) int {
	if ps == nil {
		if err != nil {
			return 1
		}
		return 0
	}
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	return ps.ExitCode()
}

// stamp formats a time for lock events: wall clock, UTC, nanoseconds.
func stamp(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }

// lockEvents prints redfence lock's events to its asyncWriter (stderr): with
// -v, every event, each line prefixed with its time.
type lockEvents struct {
	mu      sync.Mutex
	w       io.Writer
	verbose bool
}

func (e *lockEvents) printf(format string, args ...any) {
	if !e.verbose {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	fmt.Fprintf(e.w, "%s redfence lock: %s\n", stamp(time.Now()), fmt.Sprintf(format, args...))
}

// debugWriter receives the client's own log (renewal failures): stderr.
func (e *lockEvents) debugWriter() io.Writer { return lockedWriter{e} }

type lockedWriter struct{ e *lockEvents }

func (w lockedWriter) Write(p []byte) (int, error) {
	w.e.mu.Lock()
	defer w.e.mu.Unlock()
	if _, err := io.WriteString(w.e.w, "redfence lock: "+strings.TrimRight(string(p), "\n")+"\n"); err != nil {
		return 0, err
	}
	return len(p), nil
}

// checkInterpreter checks that the interpreter a script at path names on
// its "#!" line exists and can run, as the kernel will when it runs the
// script, so that a script whose interpreter is missing takes no lock; for
// "#!/usr/bin/env prog" it also looks prog up on PATH. It errs like
// exec.LookPath (fs.ErrNotExist, fs.ErrPermission). What it cannot judge
// as the kernel or env would (a file that is not a regular one or cannot be
// read, a relative interpreter, env's options and the expansions of env -S)
// is left to the exec.
func checkInterpreter(path string) error {
	if fi, err := os.Stat(path); err != nil || !fi.Mode().IsRegular() {
		return nil // a FIFO, say: opening it could block
	}
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	buf := make([]byte, 256) // the kernel reads as much (BINPRM_BUF_SIZE)
	n, _ := io.ReadFull(f, buf)
	line, ok := bytes.CutPrefix(buf[:n], []byte("#!"))
	if !ok {
		return nil
	}
	interp, arg := shebang(line)
	if interp == "" || !strings.Contains(interp, "/") {
		return nil // relative to the directory it runs in: left to the exec
	}
	if _, err := exec.LookPath(interp); err != nil {
		return fmt.Errorf("%s: bad interpreter %q: %w", path, interp, err)
	}
	if filepath.Base(interp) != "env" || arg == "" {
		return nil
	}
	prog := arg // without -S, env gets the rest of the line as one word
	if rest, ok := strings.CutPrefix(arg, "-S"); ok && (rest == "" || rest[0] == ' ' || rest[0] == '\t') {
		if strings.ContainsAny(rest, "\"'$\\=") {
			return nil // quotes, expansions, escapes, assignments: env's to read
		}
		if prog, _ = shebang([]byte(rest)); prog == "" {
			return nil
		}
	}
	if strings.HasPrefix(prog, "-") || strings.Contains(prog, "=") {
		return nil // env's other options and assignments: left to env
	}
	if p, ok := os.LookupEnv("PATH"); !ok || p == "" {
		return nil // env's libc searches its default path, or the working directory: left to env
	}
	if _, err := exec.LookPath(prog); err != nil && !errors.Is(err, exec.ErrDot) {
		return fmt.Errorf("%s: %s cannot run %q: %w", path, interp, prog, err)
	}
	return nil
}

// shebang splits a "#!" line (after the "#!") as Linux does: the
// interpreter runs to the first space or tab, and the rest of the line,
// without the spaces and tabs around it, is one argument. A carriage return
// is not a space: "#!/bin/sh\r" names an interpreter "/bin/sh\r".
func shebang(line []byte) (interp, arg string) {
	if i := bytes.IndexByte(line, '\n'); i >= 0 {
		line = line[:i]
	}
	s := strings.Trim(string(line), " \t")
	i := strings.IndexAny(s, " \t")
	if i < 0 {
		return s, ""
	}
	return s[:i], strings.Trim(s[i+1:], " \t")
}
