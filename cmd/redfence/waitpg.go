package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/redfence/redfence/store"
)

// Retry delays of OpenWaiting: the first, doubled after each try up to the
// last.
const (
	waitPostgresFirst = 500 * time.Millisecond
	waitPostgresMax   = 5 * time.Second
)

// OpenWaiting is Open, tried again for as long as Postgres cannot be
// reached (down, starting up or shutting down, out of connections, or not
// answering): a server started or restarted during a Postgres outage comes
// up when the outage ends, as a running server rides it out, instead of
// exiting. Any other error (a bad setting, refused credentials, a missing
// database, Redis nodes that refuse the credentials) is returned at once.
// It returns ctx's error, wrapping the last one, if ctx ends first.
func OpenWaiting(ctx context.Context, cfg *Config, log *slog.Logger, opts ServerOptions) (*Server, error) {
	delay := waitPostgresFirst
	for {
		s, err := Open(ctx, cfg, log, opts)
		switch {
		case err == nil:
			return s, nil
		case ctx.Err() != nil:
			return nil, errors.Join(ctx.Err(), err)
		case !postgresUnreachable(err):
			return nil, err
		}
		log.Warn("Postgres cannot be reached: the server starts once it can (SIGINT or SIGTERM stops waiting)",
			slog.String("error", err.Error()), slog.String("retry_in", delay.String()))
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, errors.Join(ctx.Err(), err)
		case <-t.C:
		}
		delay = min(2*delay, waitPostgresMax)
	}
}

// postgresUnreachable reports whether err says Postgres could not be
// reached or could not take a session now, which time may mend, rather
// than that it refused what it was asked (see OpenWaiting).
func postgresUnreachable(err error) bool {
	_, connecting := errors.AsType[*pgconn.ConnectError](err)
	if !connecting && !errors.Is(err, store.ErrUnavailable) {
		return false // not Postgres's (an address to listen on that is taken, say)
	}
	if pe, ok := errors.AsType[*pgconn.PgError](err); ok {
		switch pe.Code {
		case "57P01", "57P02", "57P03", "53300": // admin_shutdown, crash_shutdown, cannot_connect_now, too_many_connections
			return true
		}
		// Class 08, connection exception: a pooler (PgBouncer) that
		// cannot reach Postgres says so with 08P01 or 08006.
		return strings.HasPrefix(pe.Code, "08")
	}
	// Refused, unreachable, timed out; a host name that does not resolve
	// is waited for too, as in Docker and Kubernetes a name goes with
	// its container (the log names the error every few seconds).
	if _, ok := errors.AsType[net.Error](err); ok {
		return true
	}
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
}
