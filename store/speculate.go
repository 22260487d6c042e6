package store

// Speculative issuance (fencing.Speculator): a token issued while its grant
// is still being won, so that the durable commit overlaps the Redis round.
//
// Speculate takes a connection of its own, puts it in pipeline mode and sends
// one conditional statement: issue the next token for the key only if the
// newest one is the token the caller names (or, with 0, only if none was
// ever issued). It returns without waiting; Postgres commits it, durably,
// while the caller's round runs. Like an issuance's batch, the statement
// waits at most Options.IssueLockWait for the key's row (a lock_timeout set
// for its implicit transaction): when another transaction holds it (an
// outside session, a slow document write), it issues nothing, so neither
// Confirm nor Abandon waits for the row; a grant that was won then issues
// its token the ordinary way, where a held row waits alone.
//
// Confirm, once the grant is won, sends a read of the key's newest token
// behind that statement on the same connection, so it costs no round trip of
// its own: Postgres runs it right after the commit. The token is grantable
// when the statement issued it and the read still finds it newest. As every
// issuance bumps the one row, any token issued before the read is then no
// larger, so "larger than every token issued before the grant" holds as it
// does for Issue.
//
// Abandon, when the grant is lost, ends the speculation: the token, if the
// statement issued it, stays unused (burned), never withdrawn, so a name's
// token only ever goes up and no number is issued twice. That is safe
// because of the condition: the token it replaced belonged to a grant
// already given up, so a speculative token can never fence out a live
// holder.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/redfence/redfence/fencing"
)

var _ fencing.Speculator = (*DB)(nil)

// Names of the statements a speculation prepares on its connection.
const (
	specStmt    = "redfence_speculate"
	confirmStmt = "redfence_speculate_confirm"
)

// specSQL issues the next token for $1 only if the newest is $4 (0: only if
// the key has no row), and returns it. Its row comes from a subquery that
// first sets lock_timeout to $5 ms for the transaction (the implicit one of
// the statement): the insert, and so its wait for the key's row, comes
// after it (set_config is volatile: it runs as the statement does, not when
// it is planned). One statement, not a SET before it: about 4% of the lone
// acquire's latency. (A lock on the whole table, which only a migration or
// an operator's LOCK TABLE takes, is waited for as the statement starts,
// before the setting: up to the issue timeout, while every issuance waits
// for it too.)
const specSQL = `
INSERT INTO redfence_fencing AS f (key, token, owner, holder, issued_at)
SELECT $1::text, 1, $2::text, $3::text, now() FROM (SELECT set_config('lock_timeout', $5::text, true)) AS lock_wait
ON CONFLICT (key) DO UPDATE
   SET token = f.token + 1, owner = excluded.owner, holder = excluded.holder, issued_at = excluded.issued_at
 WHERE f.token = $4::bigint
RETURNING f.token`

// confirmSQL reads the newest token of $1.
const confirmSQL = `SELECT token FROM redfence_fencing WHERE key = $1`

// errNoIdleConn is returned by Speculate when every pooled connection is in
// use.
var errNoIdleConn = errors.New("no idle connection")

// speculation is the fencing.Speculation of a DB.
type speculation struct {
	db     *DB
	claim  fencing.Claim
	conn   *pgxpool.Conn
	pl     *pgconn.Pipeline
	cancel context.CancelFunc
	ended  bool // Confirm or Abandon was called
	closed bool // the pipeline was closed (the connection is out of pipeline mode)

	// What the conditional statement returned, once read.
	read   bool
	issued fencing.Token // 0: the condition did not hold, or the row was held
	// held: the key's row was held by another transaction past the lock
	// wait, and nothing was issued.
	held bool
}

// Speculate implements fencing.Speculator. The statement is sent before it
// returns; ctx bounds only that. The speculation's own work is bounded by the
// issue timeout (Options.IssueTimeout) and ends when Confirm or Abandon
// returns.
func (db *DB) Speculate(ctx context.Context, c fencing.Claim, last fencing.Token) (fencing.Speculation, error) {
	if db.pool.Stat().IdleConns() == 0 {
		// Speculation is for idle moments: never wait for a connection.
		return nil, fmt.Errorf("store: speculate token for %q: %w", c.Key, errNoIdleConn)
	}
	conn, err := db.pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("store: speculate token for %q: %w", c.Key, classify(err))
	}
	// Prepared once per connection (pgx keeps them by name); all must be
	// in place before the connection enters pipeline mode.
	var sd [2]*pgconn.StatementDescription
	for i, st := range [2][2]string{{specStmt, specSQL}, {confirmStmt, confirmSQL}} {
		if sd[i], err = conn.Conn().Prepare(ctx, st[0], st[1]); err != nil {
			conn.Release()
			return nil, fmt.Errorf("store: speculate token for %q: %w", c.Key, classify(err))
		}
	}
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), db.issuer.timeout)
	s := &speculation{db: db, claim: c, conn: conn, cancel: cancel}
	s.pl = conn.Conn().PgConn().StartPipeline(pctx)
	s.pl.SendQueryStatement(sd[0], [][]byte{
		[]byte(c.Key), []byte(c.Owner), []byte(c.Holder), strconv.AppendInt(nil, int64(last), 10), db.specLockWait,
	}, nil, nil)
	if err := s.pl.Sync(); err != nil {
		s.close(true)
		return nil, fmt.Errorf("store: speculate token for %q: %w", c.Key, classify(err))
	}
	return s, nil
}

// Confirm implements fencing.Speculation.
func (s *speculation) Confirm(ctx context.Context) (tok fencing.Token, err error) {
	if s.ended {
		return 0, fmt.Errorf("store: confirm token for %q: speculation already ended", s.claim.Key)
	}
	s.ended = true
	broken := true
	defer func() { s.close(broken) }()
	// The read goes out now, behind the statement (which Postgres may still
	// be committing): its answer follows the commit's.
	s.pl.SendQueryPrepared(confirmStmt, [][]byte{[]byte(s.claim.Key)}, nil, nil)
	if err := s.pl.Sync(); err != nil {
		return 0, s.fail("confirm", err)
	}
	if err := s.readIssued(ctx); err != nil {
		return 0, s.fail("confirm", err)
	}
	cur, err := s.readToken(ctx)
	if err != nil {
		return 0, s.fail("confirm", err)
	}
	broken = false
	switch {
	case s.held:
		return 0, fmt.Errorf("store: confirm token for %q: %w: its row was held by another transaction, and nothing was issued", s.claim.Key, fencing.ErrNotConfirmed)
	case s.issued == 0:
		return 0, fmt.Errorf("store: confirm token for %q: %w: the newest token was not the one expected", s.claim.Key, fencing.ErrNotConfirmed)
	case cur != s.issued:
		return 0, fmt.Errorf("store: confirm token %d for %q: %w: token %d was issued since", s.issued, s.claim.Key, fencing.ErrNotConfirmed, cur)
	}
	return s.issued, nil
}

// Abandon implements fencing.Speculation: it reads the statement's answer,
// so the connection goes back to the pool in a known state, and leaves the
// token, if one was issued, unused.
func (s *speculation) Abandon(ctx context.Context) error {
	if s.ended {
		return nil
	}
	s.ended = true
	if err := s.readIssued(ctx); err != nil {
		s.close(true)
		return s.fail("abandon", err)
	}
	s.close(false)
	return nil
}

// Issued returns the token the conditional statement issued, once Confirm
// or Abandon read its answer: 0 if the condition did not hold, or if the
// answer was not read. A token issued and not confirmed stays unused
// (burned); the metrics count it as issued.
func (s *speculation) Issued() fencing.Token { return s.issued }

// readIssued reads the conditional statement's answer and the Sync after
// it. A statement whose lock wait ran out (rowHeld) issued nothing: its
// transaction rolled back, and the connection is as usable as after any
// other answer.
func (s *speculation) readIssued(ctx context.Context) error {
	if s.read {
		return nil
	}
	s.read = true
	rr, err := s.results(ctx)
	if err == nil {
		for rr.NextRow() {
			t, err := parseToken(rr.Values()[0])
			if err != nil {
				_, _ = rr.Close()
				return err
			}
			s.issued = t
		}
		_, err = rr.Close()
	}
	if err != nil {
		// The statement's error comes with its result or at its end.
		if !rowHeld(err) {
			return err
		}
		s.issued, s.held = 0, true
	}
	return s.sync()
}

// readToken reads the confirming read's answer (0: no row) and its Sync.
func (s *speculation) readToken(ctx context.Context) (fencing.Token, error) {
	rr, err := s.results(ctx)
	if err != nil {
		return 0, err
	}
	var t fencing.Token
	for rr.NextRow() {
		if t, err = parseToken(rr.Values()[0]); err != nil {
			_, _ = rr.Close()
			return 0, err
		}
	}
	if _, err := rr.Close(); err != nil {
		return 0, err
	}
	return t, s.sync()
}

// parseToken parses a token column in text format.
func parseToken(b []byte) (fencing.Token, error) {
	t, err := strconv.ParseInt(string(b), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("token %q: %w", b, err)
	}
	return fencing.Token(t), nil
}

// results returns the next statement's result reader. ctx can only end the
// wait by closing the connection (the pipeline's own context bounds it too).
func (s *speculation) results(ctx context.Context) (*pgconn.ResultReader, error) {
	stop := context.AfterFunc(ctx, func() { s.cancel() })
	defer stop()
	res, err := s.pl.GetResults()
	if err != nil {
		return nil, err
	}
	rr, ok := res.(*pgconn.ResultReader)
	if !ok {
		return nil, fmt.Errorf("pipeline: got %T, want a result", res)
	}
	return rr, nil
}

// sync reads the Sync that ends a statement's implicit transaction.
func (s *speculation) sync() error {
	res, err := s.pl.GetResults()
	if err != nil {
		return err
	}
	if _, ok := res.(*pgconn.PipelineSync); !ok {
		return fmt.Errorf("pipeline: got %T, want a sync", res)
	}
	return nil
}

// fail wraps err as the error of a speculation step.
func (s *speculation) fail(step string, err error) error {
	if s.issued != 0 {
		return fmt.Errorf("store: %s token %d for %q: %w", step, s.issued, s.claim.Key, classify(err))
	}
	return fmt.Errorf("store: %s token for %q: %w", step, s.claim.Key, classify(err))
}

// close ends pipeline mode and returns the connection to the pool; a broken
// speculation closes the connection instead, as its state is unknown.
func (s *speculation) close(broken bool) {
	if s.conn == nil {
		return
	}
	if !broken && !s.closed {
		s.closed = true
		if err := s.pl.Close(); err != nil {
			broken = true
		}
	}
	if broken {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = s.conn.Conn().Close(ctx)
		cancel()
	}
	s.conn.Release()
	s.conn = nil
	s.cancel()
}
