package store

// Speculative issuance (fencing.Speculator): a token issued while its grant
// is still being won, so that the durable commit overlaps the Redis round.
//
// Speculate takes a connection of its own, puts it in pipeline mode and sends
// one conditional statement: issue the next token for the key only if the
// newest one is the token the caller names (or, with 0, only if none was
// ever issued). It returns without waiting; Postgres commits it, durably,
// while the caller's round runs.
//
// Confirm, once the grant is won, sends a read of the key's newest token
// behind that statement on the same connection, so it costs no round trip of
// its own: Postgres runs it right after the commit. The token is grantable
// when the statement issued it and the read still finds it newest. As every
// issuance bumps the one row, any token issued before the read is then no
// larger, so "larger than every token issued before the grant" holds as it
// does for Issue.
//
// Abandon, when the grant is lost, withdraws the token if it was issued and
// is still the newest: the row goes back to what the statement replaced
// (or is deleted if the statement created it). A withdrawn token was never
// handed out, and the one it replaced belonged to a grant already given up,
// which is why the condition is there: a speculative token can never fence
// out a live holder. If the withdrawal cannot be made, the token stays
// burned, which is safe for the same reason.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
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
// the key has no row), and returns it with the row it replaced, for a
// withdrawal to restore.
const specSQL = `
WITH old AS (SELECT owner, holder, issued_at FROM redfence_fencing WHERE key = $1)
INSERT INTO redfence_fencing AS f (key, token, owner, holder, issued_at)
VALUES ($1, 1, $2, $3, now())
ON CONFLICT (key) DO UPDATE
   SET token = f.token + 1, owner = excluded.owner, holder = excluded.holder, issued_at = excluded.issued_at
 WHERE f.token = $4::bigint
RETURNING f.token, (SELECT owner FROM old), (SELECT holder FROM old), (SELECT issued_at::text FROM old)`

// confirmSQL reads the newest token of $1.
const confirmSQL = `SELECT token FROM redfence_fencing WHERE key = $1`

// A withdrawal runs as lockRowSQL then withdrawSQL (or withdrawFirstSQL) in
// one transaction. The row lock waits for every write holding the token row
// (putSQL takes a share lock on it) and keeps new ones out; the statement
// after it, with a snapshot of its own, sees what those writes committed. A
// token that a write carried (the newest token is readable, GET
// /v1/locks/{name}, and a client may write with it) is not withdrawn: it
// stays burned, so the store never meets an older token after it, nor the
// same token again from a later grant.
const lockRowSQL = `SELECT token FROM redfence_fencing WHERE key = $1 FOR UPDATE`

// withdrawSQL puts back the row a speculative token $2 (> 1) replaced, if $2
// is still the newest and no write carried it.
const withdrawSQL = `
UPDATE redfence_fencing SET token = token - 1, owner = $3, holder = $4, issued_at = $5::timestamptz
 WHERE key = $1 AND token = $2
   AND NOT EXISTS (SELECT 1 FROM redfence_resources WHERE key = $1 AND fencing_token >= $2)`

// withdrawFirstSQL deletes the row a speculative first token created, if it
// is still the newest and no write carried it.
const withdrawFirstSQL = `
DELETE FROM redfence_fencing WHERE key = $1 AND token = 1
   AND NOT EXISTS (SELECT 1 FROM redfence_resources WHERE key = $1)`

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
	read     bool
	issued   fencing.Token // 0: the condition did not hold
	replaced bool          // it bumped a row (rather than creating one) ...
	old      [3]string     // ... which had this owner, holder and issued_at (text)
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
	// Prepared once per connection (pgx keeps them by name); both must be
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
		[]byte(c.Key), []byte(c.Owner), []byte(c.Holder), strconv.AppendInt(nil, int64(last), 10),
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
	case s.issued == 0:
		return 0, fmt.Errorf("store: confirm token for %q: %w: the newest token was not the one expected", s.claim.Key, fencing.ErrNotConfirmed)
	case cur != s.issued:
		return 0, fmt.Errorf("store: confirm token %d for %q: %w: token %d was issued since", s.issued, s.claim.Key, fencing.ErrNotConfirmed, cur)
	}
	return s.issued, nil
}

// Abandon implements fencing.Speculation.
func (s *speculation) Abandon(ctx context.Context) error {
	if s.ended {
		return nil
	}
	s.ended = true
	if err := s.readIssued(ctx); err != nil {
		s.close(true)
		return s.fail("withdraw", err)
	}
	s.closed = true
	if err := s.pl.Close(); err != nil {
		s.close(true)
		return s.fail("withdraw", err)
	}
	defer s.close(false)
	if s.issued == 0 {
		return nil
	}
	// One round trip: a batch runs in one implicit transaction.
	b := &pgx.Batch{}
	b.Queue(lockRowSQL, s.claim.Key)
	if s.replaced && s.issued > 1 {
		b.Queue(withdrawSQL, s.claim.Key, int64(s.issued), s.old[0], s.old[1], s.old[2])
	} else {
		b.Queue(withdrawFirstSQL, s.claim.Key)
	}
	if err := s.conn.SendBatch(ctx, b).Close(); err != nil {
		return s.fail("withdraw", err)
	}
	return nil
}

// readIssued reads the conditional statement's answer and the Sync after it.
func (s *speculation) readIssued(ctx context.Context) error {
	if s.read {
		return nil
	}
	s.read = true
	rr, err := s.results(ctx)
	if err != nil {
		return err
	}
	for rr.NextRow() {
		v := rr.Values()
		t, err := parseToken(v[0])
		if err != nil {
			_, _ = rr.Close()
			return err
		}
		s.issued = t
		s.replaced = v[3] != nil // issued_at is never NULL in a row
		for i := range s.old {
			s.old[i] = string(v[i+1]) // copied: v is reused by the next read
		}
	}
	if _, err := rr.Close(); err != nil {
		return err
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
