// Command redfence is the Redfence lock service: an HTTP/JSON API that grants
// locks with Redlock across independent Redis nodes and issues a fencing
// token with every grant.
//
// Usage:
//
//	redfence serve       run the service (configured by REDFENCE_* variables)
//	redfence dev         start local Redis nodes and Postgres, then serve
//	redfence migrate     apply database migrations and exit
//	redfence version     print the version
//	redfence healthcheck exit 0 if the local server answers /healthz
//	redfence lock        run a command while holding a lock
//	redfence keys        create, list and revoke API keys
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime/debug"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/redfence/redfence/store"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = ""

// shutdownSignals are the signals that stop serve and dev gracefully, and
// redfence lock while it waits: SIGINT, SIGTERM and SIGHUP (a closed
// terminal, a dropped ssh session), unless SIGHUP was ignored when the
// process started (nohup), as it then stays. Read before any Notify, which
// would stop it being ignored.
var shutdownSignals = sync.OnceValue(func() []os.Signal {
	sigs := []os.Signal{os.Interrupt, syscall.SIGTERM}
	if !signal.Ignored(syscall.SIGHUP) {
		sigs = append(sigs, syscall.SIGHUP)
	}
	// Clipped: the slice is shared, and a caller appending to it (runLocked
	// adds SIGQUIT) must get a copy, not write into the spare capacity
	// other goroutines' appends write into too.
	return slices.Clip(sigs)
})

// lastSignal returns a context cancelled at the next shutdown signal, from
// which on those signals have their default action again: one more ends the
// process at once instead of being swallowed. cancel unregisters it.
func lastSignal() (context.Context, context.CancelFunc) {
	sigs := shutdownSignals()
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, sigs...)
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		select {
		case <-ch:
			signal.Reset(sigs...)
			cancel()
		case <-ctx.Done():
		}
		signal.Stop(ch)
	}()
	return ctx, cancel
}

func main() {
	ctx, cancel := signal.NotifyContext(context.Background(), shutdownSignals()...)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	cancel()
	if err != nil {
		var ee *exitError
		if !errors.Is(err, errUsage) && !errors.As(err, &ee) {
			writeBounded(os.Stderr, "redfence: "+err.Error()+"\n", time.Second)
		}
		os.Exit(exitCode(err))
	}
}

// writeBounded writes s to w, waiting at most d: stderr may be a pipe that
// nobody reads any more (a stuck log reader), which must not keep the
// process from exiting.
func writeBounded(w io.Writer, s string, d time.Duration) {
	done := make(chan struct{})
	go func() {
		_, _ = io.WriteString(w, s)
		close(done)
	}()
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-done:
	case <-timer.C:
	}
}

// errUsage is returned after usage was printed for a bad command line.
var errUsage = errors.New("usage")

// exitError carries a specific exit code (for example a child's status).
type exitError struct{ code int }

func (e *exitError) Error() string { return fmt.Sprintf("exit status %d", e.code) }

func exitCode(err error) int {
	var ee *exitError
	if errors.As(err, &ee) {
		return ee.code
	}
	if errors.Is(err, errUsage) {
		return 2
	}
	return 1
}

func usage(w io.Writer) {
	fmt.Fprint(w, `redfence: an HTTP lock service with Redlock grants and fencing tokens.

Usage:
  redfence serve        run the service, configured by the variables below
  redfence dev          start 5 local redis-server nodes and a throwaway Postgres,
                        then serve on 127.0.0.1:8080 (see redfence dev -h)
  redfence migrate      apply database migrations to REDFENCE_DATABASE_URL and exit
  redfence version      print the version
  redfence healthcheck  exit 0 if the server on REDFENCE_LISTEN_ADDR answers /healthz
  redfence lock [--ttl D] [--wait D] [--server URL] NAME -- COMMAND [ARGS...]
                        run COMMAND while holding the lock NAME (see redfence lock -h)
  redfence keys create --tenant T [--scope locks,resources,admin]
                        create an API key and print it (shown only this once)
  redfence keys list    print every API key: id, tenant, scopes, created, revoked
  redfence keys revoke ID
                        revoke an API key on every server within a second

Settings (environment variables):
`)
	printSettings(w)
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		usage(stderr)
		return errUsage
	}
	cmd, rest := args[0], args[1:]
	switch cmd {
	case "-h", "-help", "--help", "help":
		usage(stdout)
		return nil
	case "-version", "--version":
		return cmdVersion(nil, stdout, stderr)
	case "version":
		return cmdVersion(rest, stdout, stderr)
	case "serve":
		return cmdServe(ctx, rest, stdout, stderr)
	case "dev":
		return cmdDev(ctx, rest, stdout, stderr)
	case "migrate":
		return cmdMigrate(ctx, rest, stdout, stderr)
	case "healthcheck":
		return cmdHealthcheck(ctx, rest, stdout, stderr)
	case "lock":
		return cmdLock(ctx, rest, stdout, stderr)
	case "keys":
		return cmdKeys(ctx, rest, stdout, stderr)
	}
	fmt.Fprintf(stderr, "redfence: unknown command %q\n\n", cmd)
	usage(stderr)
	return errUsage
}

func cmdVersion(args []string, stdout, stderr io.Writer) error {
	fs := flags("version", "Prints the version.", stderr)
	if err := parseFlags(fs, args, stdout); err != nil {
		return helpOK(err)
	}
	fmt.Fprintln(stdout, "redfence", buildVersion())
	return nil
}

func buildVersion() string {
	if version != "" {
		return version
	}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "(unknown version)"
	}
	if bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	// A plain go build in a checkout: name the commit.
	var rev, dirty string
	for _, s := range bi.Settings {
		switch {
		case s.Key == "vcs.revision":
			rev = s.Value[:min(12, len(s.Value))]
		case s.Key == "vcs.modified" && s.Value == "true":
			dirty = "-dirty"
		}
	}
	if rev == "" {
		return "(devel)"
	}
	return "(devel) " + rev + dirty
}

// flags returns a FlagSet whose -h prints the command's help and the
// settings on stdout; a bad command line gets the error and the help on
// stderr (see parseFlags).
func flags(name, help string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		w := fs.Output()
		fmt.Fprintf(w, "Usage: redfence %s\n\n%s\n", name, help)
		n := 0
		fs.VisitAll(func(*flag.Flag) { n++ })
		if n > 0 {
			fmt.Fprintln(w, "\nFlags:")
			fs.PrintDefaults()
		}
		fmt.Fprintln(w, "\nSettings (environment variables):")
		printSettings(w)
	}
	return fs
}

// parseArgs parses args with fs, positional arguments allowed: -h prints
// the help on stdout (ErrHelp), a bad flag prints the error and the help on
// fs's output (stderr) and returns errUsage.
func parseArgs(fs *flag.FlagSet, args []string, stdout io.Writer) error {
	if wantsHelp(args) {
		fs.SetOutput(stdout)
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return flag.ErrHelp
		}
		return errUsage
	}
	return nil
}

// parseFlags is parseArgs for a command that takes no positional argument.
func parseFlags(fs *flag.FlagSet, args []string, stdout io.Writer) error {
	if err := parseArgs(fs, args, stdout); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(fs.Output(), "unexpected arguments: %v\n", fs.Args())
		return errUsage
	}
	return nil
}

// wantsHelp reports whether args ask for help (-h, -help, --help) before
// "--".
func wantsHelp(args []string) bool {
	for _, a := range args {
		switch a {
		case "--":
			return false
		case "-h", "-help", "--help", "--h":
			return true
		}
	}
	return false
}

func helpOK(err error) error {
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	return err
}

func cmdServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flags("serve", "Runs the service. Applies pending migrations first.", stderr)
	if err := parseFlags(fs, args, stdout); err != nil {
		return helpOK(err)
	}
	cfg, err := loadConfig()
	if err != nil {
		return err
	}
	logw := newAsyncWriter(stderr)
	defer logw.Close()
	log := cfg.logger(logw)
	logw.reportDropsTo(log)
	quietRedis(log)
	warnUnknownSettings(log, os.Environ())
	s, err := OpenWaiting(ctx, cfg, log, ServerOptions{})
	if err != nil {
		if ctx.Err() != nil {
			return nil // stopped by a signal while Postgres could not be reached
		}
		return err
	}
	warnSchemaAhead(ctx, s)
	return serveUntilDone(ctx, s, cfg)
}

// schemaAhead describes a database whose schema is newer than this binary's
// newest migration, or returns "" when it is not.
func schemaAhead(ctx context.Context, db *store.DB) (string, error) {
	dbVersion, binVersion, err := db.SchemaVersions(ctx)
	if err != nil || dbVersion <= binVersion {
		return "", err
	}
	return fmt.Sprintf("database schema is at version %d, newer than this binary's %d: a newer redfence migrated it", dbVersion, binVersion), nil
}

// warnSchemaAhead logs a warning when the database's schema is newer than
// this binary's: serving on is right during a rolling upgrade, and wrong
// for long.
func warnSchemaAhead(ctx context.Context, s *Server) {
	msg, err := schemaAhead(ctx, s.db)
	switch {
	case err != nil:
		s.log.Warn("could not read the database's schema version", slog.String("error", err.Error()))
	case msg != "":
		s.log.Warn(msg + "; serving on, which is right only while a rolling upgrade replaces this server")
	}
}

// errSecondSignal cuts the shutdown's grace period short.
var errSecondSignal = errors.New("a second signal ended the grace period")

// serveUntilDone waits for a signal (ctx) or a serving error, then shuts
// down, giving requests in flight cfg.ShutdownTimeout; a second signal
// (shutdownSignals) meanwhile ends that grace period at once, and a third
// ends the process at once (the signal's default action).
func serveUntilDone(ctx context.Context, s *Server, cfg *Config) error {
	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-s.Done():
	}
	if d := cfg.ShutdownDelay; d > 0 && serveErr == nil {
		// Out of the load balancer's pool first: /readyz fails while
		// everything else is served as before.
		s.api.Unready()
		s.log.Info("not ready: serving on until the shutdown delay ends (a second signal ends it)", "delay", d.String())
		next, stopNext := signal.NotifyContext(context.Background(), shutdownSignals()...)
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-next.Done(): // the grace period below still runs
		case serveErr = <-s.Done():
		}
		t.Stop()
		stopNext()
	}
	again, stopAgain := lastSignal()
	defer stopAgain()
	s.log.Info("shutting down", "grace", cfg.ShutdownTimeout.String())
	sctx, cancel := context.WithTimeoutCause(context.Background(), cfg.ShutdownTimeout,
		fmt.Errorf("the grace period (REDFENCE_SHUTDOWN_TIMEOUT=%s) ran out", cfg.ShutdownTimeout))
	defer cancel()
	sctx, cut := context.WithCancelCause(sctx)
	defer cut(nil)
	defer context.AfterFunc(again, func() {
		s.log.Warn("second signal: stopping now, without waiting for the requests in flight")
		cut(errSecondSignal)
	})()
	if err := s.Close(sctx); err != nil {
		if cause := context.Cause(sctx); cause != nil {
			err = fmt.Errorf("%w: %w", cause, err)
		}
		return errors.Join(serveErr, fmt.Errorf("shutdown: %w", err))
	}
	if errors.Is(serveErr, http.ErrServerClosed) {
		serveErr = nil
	}
	return serveErr
}

func cmdMigrate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flags("migrate", "Applies pending migrations to REDFENCE_DATABASE_URL. Safe to run concurrently.", stderr)
	if err := parseFlags(fs, args, stdout); err != nil {
		return helpOK(err)
	}
	cfg, err := loadConfig()
	if err != nil {
		return err
	}
	if cfg.DatabaseURL == "" {
		return errors.New("REDFENCE_DATABASE_URL is empty")
	}
	db, err := store.Open(ctx, cfg.DatabaseURL, store.Options{Logger: cfg.logger(stderr)})
	if err != nil {
		return err
	}
	defer db.Close()
	applied, err := db.Migrate(ctx)
	if err != nil {
		return err
	}
	if len(applied) == 0 {
		msg, err := schemaAhead(ctx, db)
		if err != nil {
			return err
		}
		if msg == "" {
			msg = "database is up to date"
		}
		fmt.Fprintln(stdout, msg)
	}
	for _, m := range applied {
		fmt.Fprintln(stdout, "applied", m)
	}
	return nil
}

func cmdHealthcheck(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flags("healthcheck", "Exits 0 if the server listening on REDFENCE_LISTEN_ADDR answers GET /healthz with 200 (a wildcard address is asked on loopback), else 1.", stderr)
	if err := parseFlags(fs, args, stdout); err != nil {
		return helpOK(err)
	}
	cfg, err := loadConfig()
	if err != nil {
		return err
	}
	host, port, err := probeAddr(cfg.ListenAddr)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	client, base, err := cfg.healthClient(host, port)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/healthz", nil)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("healthcheck: %w", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("healthcheck: status %d", resp.StatusCode)
	}
	return nil
}

// probeAddr returns the host and numeric port to reach a server listening on
// listen: its own host, or loopback (of the same family) for a wildcard.
func probeAddr(listen string) (host, port string, err error) {
	host, port, err = net.SplitHostPort(listen)
	if err != nil {
		return "", "", fmt.Errorf("REDFENCE_LISTEN_ADDR %q: %w", listen, err)
	}
	n, err := net.LookupPort("tcp", port) // a service name such as "http" too
	if err != nil || n == 0 {
		return "", "", fmt.Errorf("REDFENCE_LISTEN_ADDR %q: no port to probe", listen)
	}
	switch ip := net.ParseIP(host); {
	case host == "" || (ip != nil && ip.IsUnspecified() && ip.To4() != nil):
		host = "127.0.0.1"
	case ip != nil && ip.IsUnspecified():
		host = "::1"
	}
	return host, strconv.Itoa(n), nil
}
