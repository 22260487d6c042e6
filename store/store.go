// Package store is Redfence's Postgres layer: it issues fencing tokens
// (implementing fencing.Issuer), keeps the fenced reference store, and applies
// the embedded schema migrations.
//
// Guarantees: a token is returned only after the statement that issued it has
// committed with synchronous_commit on (forced per connection; concurrent
// issuances share one statement and one commit, see Options.IssueCommitters),
// so tokens never go backwards across restarts of Postgres or of Redfence,
// provided Postgres itself runs with fsync on. A reference-store write is applied only when its
// token equals the newest token issued for its key, checked and written in one
// statement that locks the token row, so no write with an older token can land
// after a newer token was issued.
//
// Not guaranteed: anything when fsync is off or a replica that lost
// acknowledged commits is promoted.
package store

import (
	"bytes"
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/refstore"
	"github.com/redfence/redfence/migrations"
)

// Errors of the reference store, shared with its consumers (see
// internal/refstore). Match them with errors.Is.
var (
	// ErrNotFound is returned when a resource does not exist.
	ErrNotFound = refstore.ErrNotFound
	// ErrUnavailable is returned (wrapped with the cause) when Postgres could
	// not be reached or did not answer in time.
	ErrUnavailable = refstore.ErrUnavailable
	// ErrInvalidData is returned when a document is refused for what it
	// holds (for example a JSON string holding \u0000, which Postgres's JSON
	// functions cannot read).
	ErrInvalidData = refstore.ErrInvalidData
	// ErrOutcomeUnknown is returned (with ErrUnavailable) by a PutResource
	// whose COMMIT was sent but not answered: the write may have been
	// applied. One that failed without it was not.
	ErrOutcomeUnknown = refstore.ErrOutcomeUnknown
	// ErrTokensExhausted is returned (with ErrUnavailable) when a name's
	// next fencing token would pass 2^53-1, the most every JSON parser
	// holds exactly: the name is granted no more.
	ErrTokensExhausted = fencing.ErrExhausted
	// ErrNodeListDiffers is returned by Heartbeat when another server that
	// may still hold a lease lists other Redis nodes.
	ErrNodeListDiffers = errors.New("a server that may still hold leases lists other Redis nodes")
)

// classify wraps a failed statement's error with ErrInvalidData for data
// exceptions (SQLSTATE class 22) and ErrUnavailable otherwise.
// tokenMaxConstraint bounds fencing tokens (migration 00006).
const tokenMaxConstraint = "redfence_fencing_token_max"

func classify(err error) error {
	var pe *pgconn.PgError
	if errors.As(err, &pe) && strings.HasPrefix(pe.Code, "22") {
		return fmt.Errorf("%w: %s", ErrInvalidData, pe.Message)
	}
	if errors.As(err, &pe) && pe.ConstraintName == tokenMaxConstraint {
		return fmt.Errorf("%w: %w", ErrUnavailable, ErrTokensExhausted)
	}
	if errors.Is(err, context.Canceled) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrUnavailable, err)
}

// Options tunes a DB. Zero fields take the documented defaults.
type Options struct {
	// MaxConns is the size of the pool of the locks (token issuance,
	// heartbeats, node records, API keys). The default is pgxpool's (max(4,
	// CPUs)), unless the URL sets pool_max_conns.
	MaxConns int32
	// DocMaxConns is the size of the reference store's own pool (documents),
	// kept apart so that document traffic, however heavy, cannot take the
	// connections lock grants and heartbeats need. The default is the size
	// of the locks' pool.
	DocMaxConns int32
	// StatementTimeout bounds every statement on the server. The default is 5s.
	StatementTimeout time.Duration
	// Logger receives warnings about unsafe server settings. The default discards.
	Logger *slog.Logger
	// IssueCommitters is the most issuance statements that run at once.
	// Each takes all the claims waiting (see IssueBatchMax) and issues them
	// in one statement and one durable commit; a lone claim is taken at
	// once, never held back to fill a batch. An Issue that finds one of them
	// free runs the statement on its own goroutine; otherwise committer
	// goroutines take what piled up. It bounds the pool connections
	// issuance holds at once (claims waiting for a row another transaction
	// holds wait on connections of their own: see IssueLockWait), so keep
	// it below MaxConns. The default is 2.
	IssueCommitters int
	// IssueBatchMax is the most claims one issuance statement serves. The
	// default is 256.
	IssueBatchMax int
	// IssueTimeout bounds one issuance statement: it ends at the latest
	// deadline of the Issue calls it serves, but never later than
	// IssueTimeout after it started. The default is 10s.
	IssueTimeout time.Duration
	// IssueLockWait bounds how long an issuance statement waits for a row
	// another transaction holds (a document's write on that name, an
	// outside session) before its claims are taken apart: the
	// others are issued at once, and each claim whose row is held waits on
	// its own, until its caller's deadline, keeping its name's later claims
	// queued behind it. These waits use a pool of their own, of
	// heldRowConns connections (opened when needed), so held rows cannot
	// take the connections of other names' grants, heartbeats and API key
	// lookups. So one held row holds up only its own name's grants, not the
	// batch's nor the committer's. The default is 50ms.
	IssueLockWait time.Duration
	// ConnectTimeout bounds opening one connection, the startup exchange
	// included, unless the URL sets connect_timeout: a server that accepts
	// connections but never answers fails Open instead of hanging it. The
	// default is 10s.
	ConnectTimeout time.Duration
	// Unfenced makes PutResource skip the token check. It exists only so fault
	// tests can show their checker catches the violations fencing prevents;
	// never set it elsewhere.
	Unfenced bool
}

// DB is a Postgres connection pool with Redfence's queries.
type DB struct {
	pool   *pgxpool.Pool // the locks'
	docs   *pgxpool.Pool // the reference store's (see Options.DocMaxConns)
	waits  *pgxpool.Pool // issuance waiting for held rows (see Options.IssueLockWait)
	opts   Options
	issuer *issuer
	// putRefused, if set (tests), runs when a write was refused by its
	// document's state, before the document is read to say why.
	putRefused func()
	// specLockWait is Options.IssueLockWait in milliseconds, as text: a
	// speculation's lock_timeout (see Speculate).
	specLockWait []byte
}

// Open connects to the Postgres at url (a postgres:// URL or DSN) and checks
// that it answers.
func Open(ctx context.Context, url string, opts Options) (*DB, error) {
	if opts.StatementTimeout <= 0 {
		opts.StatementTimeout = 5 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.IssueCommitters <= 0 {
		opts.IssueCommitters = defaultIssueCommitters
	}
	if opts.IssueLockWait <= 0 {
		opts.IssueLockWait = defaultIssueLockWait
	}
	if opts.IssueBatchMax <= 0 {
		opts.IssueBatchMax = defaultIssueBatchMax
	}
	if opts.IssueTimeout <= 0 {
		opts.IssueTimeout = defaultIssueTimeout
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("store: parse database URL: %w", redactErr(err))
	}
	if err := checkHosts(&cfg.ConnConfig.Config); err != nil {
		return nil, fmt.Errorf("store: parse database URL: %w", err)
	}
	if opts.MaxConns > 0 {
		cfg.MaxConns = opts.MaxConns
	}
	if cfg.ConnConfig.ConnectTimeout == 0 { // the URL set none
		cfg.ConnConfig.ConnectTimeout = cmp.Or(opts.ConnectTimeout, 10*time.Second)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "redfence"
	// A token acknowledged before its commit is durable could be issued again
	// after a crash. Force the session to wait for the WAL flush, whatever
	// the server default is (keep a stricter remote_* setting if
	// configured), and set it for the session even when the default is
	// already durable: a session value outlives a reload of the server's
	// configuration, which would otherwise turn it off under a live pool.
	//
	// No transaction of Redfence's waits between its statements: one idle
	// in a transaction lost its client (a COMMIT that never came), and its
	// locks must not outlive it for long. A document's write holds a share
	// lock on its name's token row until its COMMIT, which holds up the
	// name's token issuance: that pool's sessions end such a transaction
	// after docIdleInTx.
	sessionSetup := func(stmt, idle time.Duration) func(context.Context, *pgx.Conn) error {
		st, ms := fmt.Sprint(stmt.Milliseconds()), fmt.Sprint(idle.Milliseconds())
		return func(ctx context.Context, c *pgx.Conn) error {
			_, err := c.Exec(ctx, sessionSQL, st, ms)
			return err
		}
	}
	cfg.AfterConnect = sessionSetup(opts.StatementTimeout, opts.StatementTimeout)
	dcfg := cfg.Copy()
	dcfg.AfterConnect = sessionSetup(opts.StatementTimeout, min(docIdleInTx, opts.StatementTimeout))
	if opts.DocMaxConns > 0 {
		dcfg.MaxConns = opts.DocMaxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("store: connect: %w", err)
	}
	docs, err := pgxpool.NewWithConfig(ctx, dcfg) // connects when first used
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("store: connect: %w", err)
	}
	wcfg := cfg.Copy()
	wcfg.MaxConns = heldRowConns
	// A claim set aside waits for its row until its caller's deadline, at
	// most IssueTimeout: a shorter statement timeout would cut it short.
	wcfg.AfterConnect = sessionSetup(max(opts.StatementTimeout, opts.IssueTimeout), opts.StatementTimeout)
	waits, err := pgxpool.NewWithConfig(ctx, wcfg) // connects when first used
	if err != nil {
		pool.Close()
		docs.Close()
		return nil, fmt.Errorf("store: connect: %w", err)
	}
	db := &DB{pool: pool, docs: docs, waits: waits, opts: opts,
		specLockWait: strconv.AppendInt(nil, max(opts.IssueLockWait.Milliseconds(), 1), 10)}
	if err := db.Ping(ctx); err != nil {
		pool.Close()
		docs.Close()
		waits.Close()
		return nil, err
	}
	var fsync string
	if err := pool.QueryRow(ctx, "SHOW fsync").Scan(&fsync); err == nil && fsync == "off" {
		opts.Logger.Warn("postgres runs with fsync=off: a crash of its host can lose issued fencing tokens and let them go backwards")
	}
	if opts.Unfenced {
		opts.Logger.Warn("reference store fencing is DISABLED (test-only switch): stale writes will be accepted")
	}
	db.issuer = newIssuer(pool, waits, opts.IssueCommitters, opts.IssueBatchMax, opts.IssueTimeout, opts.IssueLockWait)
	return db, nil
}

// redactErr keeps a URL (which may hold a password) out of a parse error
// while still saying what is wrong with it: pgx's own message names the
// part it refused. Every quoted piece of it is cut (pgx and net/url quote
// bits of the input, which can be bits of the password), and a cause that
// may spell the input unquoted (an escape error) is dropped.
func redactErr(err error) error {
	var pe *pgconn.ParseConfigError
	if !errors.As(err, &pe) {
		return err
	}
	// pgx formats "cannot parse `<conn string>`: <msg>[ (<cause>)]"; only
	// the part after the conn string is free of it.
	msg := pe.Error()
	if i := strings.LastIndex(msg, "`: "); i >= 0 {
		msg = msg[i+3:]
	} else {
		msg = ""
	}
	cause := pe.Unwrap()
	if cause != nil {
		msg = strings.TrimSuffix(msg, " ("+cause.Error()+")")
		var esc url.EscapeError
		if ue, ok := errors.AsType[*url.Error](cause); ok {
			cause = ue.Err // without the URL
		}
		if !errors.As(cause, &esc) {
			msg += ": " + cause.Error()
		}
	}
	msg = quoted.ReplaceAllString(msg, `"…"`)
	if msg == "" || pe.ConnString != "" && strings.Contains(msg, pe.ConnString) {
		return errors.New("invalid connection string")
	}
	return fmt.Errorf("invalid connection string: %s", msg)
}

// checkHosts refuses a host name holding "@". pgx splits a URL's user
// information from its hosts at the first "@", so a password holding an
// "@" that is not percent-encoded (postgres://u:pa@ss@db/x) leaves the rest
// of the password in the host name, and every error of a connection to it
// ("lookup ss@db: no such host") would log that. No host name or IP
// address holds one; a Unix socket directory (starting with "/") may.
func checkHosts(cfg *pgconn.Config) error {
	hosts := []string{cfg.Host}
	for _, fb := range cfg.Fallbacks {
		hosts = append(hosts, fb.Host)
	}
	for _, h := range hosts {
		if !strings.HasPrefix(h, "/") && strings.Contains(h, "@") {
			return errors.New(`invalid connection string: a host holds "@" (not quoted: it may be part of the password); percent-encode an "@" in the user name or password as %40`)
		}
	}
	return nil
}

// quoted matches a Go-quoted string (%q): redactErr cuts them.
var quoted = regexp.MustCompile(`"(?:[^"\\]|\\.)*"`)

// Close stops token issuance and closes the pools. Issue calls still waiting
// fail with ErrClosed, later ones too (a statement running for them is
// cancelled, best effort: one that commits all the same issues a token that
// is never granted, as a caller that left does), and the committer
// goroutines have returned when Close does. It may be called more than once.
func (db *DB) Close() {
	db.issuer.close()
	db.pool.Close()
	db.docs.Close()
	db.waits.Close()
}

// Ping checks that Postgres answers a query.
func (db *DB) Ping(ctx context.Context) error {
	if err := db.pool.Ping(ctx); err != nil {
		return fmt.Errorf("store: ping: %w", err)
	}
	return nil
}

// Migrate applies every pending migration. It is safe to run from several
// processes at once: a Postgres advisory lock, held on one connection,
// serialises them, and each migration runs in its own transaction. A
// failure is classified as a statement's is (see classify): a Postgres that
// went away meanwhile (restarted while this process waited for another's
// migrations, or ran its own) matches ErrUnavailable, so a server starting
// waits for it as it does for one down before the start.
func (db *DB) Migrate(ctx context.Context) (applied []string, err error) {
	sqlDB := stdlib.OpenDBFromPool(db.pool)
	defer sqlDB.Close()
	return migrate(ctx, sqlDB)
}

// migrationsTable is goose's record of the applied migrations.
const migrationsTable = "redfence_schema_migrations"

// migrationLockID is the Postgres advisory lock key that serialises migrations
// ("redfence" in ASCII).
const migrationLockID = 0x72656466656e6365

func migrate(ctx context.Context, sqlDB *sql.DB) ([]string, error) {
	// A Redfence-specific advisory lock id (so other goose users of the same
	// database do not contend with us), polled every second for up to 5 minutes.
	locker, err := lock.NewPostgresSessionLocker(lock.WithLockID(migrationLockID), lock.WithLockTimeout(1, 300))
	if err != nil {
		return nil, fmt.Errorf("store: migrate: %w", err)
	}
	p, err := provider(sqlDB, goose.WithSessionLocker(locker))
	if err != nil {
		return nil, fmt.Errorf("store: migrate: %w", err)
	}
	res, err := p.Up(ctx)
	if err != nil {
		return nil, fmt.Errorf("store: migrate: %w", classify(err))
	}
	var applied []string
	for _, r := range res {
		applied = append(applied, r.Source.Path)
	}
	return applied, nil
}

// provider is the goose provider of the embedded migrations on sqlDB.
func provider(sqlDB *sql.DB, opts ...goose.ProviderOption) (*goose.Provider, error) {
	return goose.NewProvider(goose.DialectPostgres, sqlDB, migrations.FS,
		append([]goose.ProviderOption{goose.WithTableName(migrationsTable), goose.WithDisableGlobalRegistry(true)}, opts...)...)
}

// SchemaVersions returns the version of the database's schema (its newest
// applied migration; 0 before any) and the newest migration this binary
// embeds. A database ahead of the binary was migrated by a newer Redfence,
// whose schema this one may not know how to use.
func (db *DB) SchemaVersions(ctx context.Context) (database, binary int64, err error) {
	sqlDB := stdlib.OpenDBFromPool(db.pool)
	defer sqlDB.Close()
	p, err := provider(sqlDB)
	if err != nil {
		return 0, 0, fmt.Errorf("store: schema version: %w", err)
	}
	database, binary, err = p.GetVersions(ctx)
	if err != nil {
		return 0, 0, fmt.Errorf("store: schema version: %w", classify(err))
	}
	return database, binary, nil
}

// Last returns the newest token record for key; its Token is 0 if none.
func (db *DB) Last(ctx context.Context, key string) (fencing.Record, error) {
	return lastRecord(ctx, db.pool, key)
}

// lastRecord is Last on pool.
func lastRecord(ctx context.Context, pool *pgxpool.Pool, key string) (fencing.Record, error) {
	r := fencing.Record{Claim: fencing.Claim{Key: key}}
	var t int64
	err := retryPooled(pool, func() error {
		return pool.QueryRow(ctx,
			`SELECT token, owner, holder, issued_at FROM redfence_fencing WHERE key = $1`, key).
			Scan(&t, &r.Owner, &r.Holder, &r.IssuedAt)
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return r, nil
	}
	if err != nil {
		return r, fmt.Errorf("store: last token for %q: %w", key, classify(err))
	}
	r.Token = fencing.Token(t)
	return r, nil
}

// sessionSQL sets the session's synchronous_commit to the server's default,
// or to on where that is off, its statement_timeout to $1 ms and its
// idle_in_transaction_session_timeout to $2 ms (see Open). Set once
// connected, not as startup parameters, which poolers such as PgBouncer
// refuse unless told to ignore them.
const sessionSQL = `SELECT set_config('synchronous_commit',
  CASE current_setting('synchronous_commit') WHEN 'off' THEN 'on' ELSE current_setting('synchronous_commit') END, false),
  set_config('statement_timeout', $1, false),
  set_config('idle_in_transaction_session_timeout', $2, false)`

// heldRowConns is the size of the pool of the issuance claims waiting for
// a row another transaction holds (see Options.IssueLockWait): that many
// held rows are waited for at once, the claims of more wait for a
// connection.
const heldRowConns = 4

// docIdleInTx bounds how long a document's write whose COMMIT did not come
// (a stalled network, a paused process) keeps its name's token row locked.
const docIdleInTx = 500 * time.Millisecond

// Resource is one document of the reference store.
type Resource = refstore.Resource

// The CTE takes a share lock on the token row: an issuance waiting to bump it
// waits for this write to commit, and a write waiting behind an issuance sees
// the new token and is refused. So a write either lands before the next
// token is issued (and its holder's successor reads it) or not at all. The
// document's own token never goes back either, whatever the token row says.
// putSQL writes the document if $2 is the newest token on record, and the
// document is in the state refstore.Condition asks: $4 it must exist, $5
// the versions it may have (NULL: any), $6 it must not exist, $7 versions
// it must not have. An existing document's state is checked on its row,
// locked (ON CONFLICT's WHERE), so concurrent writes cannot both pass it.
// Its one row names, besides what was written (NULLs when nothing was), the
// token on record it was compared with, read in the same statement: a
// refusal names the token that refused it; and whether the document
// existed as the statement saw it (its snapshot, as $4's check), so a
// write refused for want of a document (no row was locked) says so.
const putSQL = `
WITH cur AS (SELECT token FROM redfence_fencing WHERE key = $1 FOR SHARE),
ins AS (
INSERT INTO redfence_resources AS r (key, data, fencing_token, version, updated_at)
SELECT $1, $3, $2, 1, now() FROM cur WHERE cur.token = $2
   AND (NOT $4::boolean OR EXISTS (SELECT 1 FROM redfence_resources WHERE key = $1))
ON CONFLICT (key) DO UPDATE
   SET data = excluded.data, fencing_token = excluded.fencing_token,
       version = r.version + 1, updated_at = excluded.updated_at
 WHERE r.fencing_token <= excluded.fencing_token
   AND NOT $6::boolean
   AND ($5::bigint[] IS NULL OR r.version = ANY($5::bigint[]))
   AND NOT (r.version = ANY(coalesce($7::bigint[], '{}')))
RETURNING data, fencing_token, version, updated_at)
SELECT (SELECT token FROM cur), ins.data, ins.fencing_token, ins.version, ins.updated_at,
       EXISTS (SELECT 1 FROM redfence_resources WHERE key = $1)
  FROM (SELECT) AS one LEFT JOIN ins ON true`

const putUnfencedSQL = `
INSERT INTO redfence_resources AS r (key, data, fencing_token, version, updated_at)
VALUES ($1, $3, $2, 1, now())
ON CONFLICT (key) DO UPDATE
   SET data = excluded.data, fencing_token = excluded.fencing_token,
       version = r.version + 1, updated_at = excluded.updated_at
RETURNING data, fencing_token, version, updated_at`

// PutResource writes data under key if token is the newest token issued for
// key. Otherwise it changes nothing and returns a *fencing.StaleError. The
// document is kept as sent without its insignificant whitespace: object
// keys in their order, numbers in their form.
func (db *DB) PutResource(ctx context.Context, key string, token fencing.Token, data json.RawMessage) (*Resource, error) {
	return db.PutResourceIf(ctx, key, token, data, refstore.Condition{})
}

// PutResourceIf is PutResource, applied only if the document is in the
// state cond asks (HTTP's If-Match and If-None-Match on its version).
// Otherwise it changes nothing and returns a *refstore.PreconditionError;
// a stale token is refused first, as by PutResource. (Options.Unfenced
// ignores cond as it ignores the token.)
func (db *DB) PutResourceIf(ctx context.Context, key string, token fencing.Token, data json.RawMessage, cond refstore.Condition) (*Resource, error) {
	if err := refstore.CheckJSON(data); err != nil {
		return nil, fmt.Errorf("store: put %q: %w", key, err)
	}
	var compact bytes.Buffer
	compact.Grow(len(data))
	if err := json.Compact(&compact, data); err != nil {
		return nil, fmt.Errorf("store: put %q: %w", key, &refstore.DataError{Reason: "must be valid JSON"})
	}
	data = compact.Bytes()
	r := &Resource{Key: key}
	var (
		t       *int64
		version *int64
		updated *time.Time
		cur     *int64 // the token on record it was compared with
	)
	// In a transaction of its own, committed only once the statement's
	// answer is back: a statement held up on its way (a stalled network)
	// and delivered after this call gave up finds its connection closed
	// behind it, and Postgres rolls it back, instead of committing a write
	// whose holder was told 503 and may have written again since. (A
	// COMMIT held up the same way can still commit late, but its row lock
	// made every later write wait for it; after docIdleInTx Postgres rolls
	// it back instead.)
	//
	// So a write that fails before its COMMIT is sent was not applied, and
	// one whose COMMIT got an answer from Postgres (an error: it rolled
	// back) neither; only one whose COMMIT went unanswered may have been
	// (ErrOutcomeUnknown).
	committing := false
	var doc, ver int64 // a refused write's document, as it refused it
	err := db.retryStalePlan(func() error {
		committing = false // a retry follows only a try that took no effect
		doc, ver = 0, 0
		return pgx.BeginFunc(ctx, db.docs, func(tx pgx.Tx) error {
			var err error
			if db.opts.Unfenced {
				var tt, v int64
				var u time.Time
				err = tx.QueryRow(ctx, putUnfencedSQL, key, int64(token), []byte(data)).Scan(&r.Data, &tt, &v, &u)
				t, version, updated = &tt, &v, &u
			} else {
				exists := cond.Exists || cond.Versions != nil
				var existed bool
				err = tx.QueryRow(ctx, putSQL, key, int64(token), []byte(data),
					exists, cond.Versions, cond.Absent, cond.NotVersions).
					Scan(&cur, &r.Data, &t, &version, &updated, &existed)
				if err == nil && t == nil && cur != nil && fencing.Token(*cur) == token {
					if db.putRefused != nil {
						db.putRefused()
					}
					if exists && !existed {
						// Refused for want of a document: there was
						// no row to lock, and one written since is
						// not what refused it.
						return nil
					}
					// Refused by the document: read it in this
					// transaction, which holds its row (ON CONFLICT
					// locks the row it finds even when its WHERE
					// refuses the update), so the version named is the
					// one that refused the write, not a later one.
					err = tx.QueryRow(ctx, `SELECT fencing_token, version FROM redfence_resources WHERE key = $1`, key).Scan(&doc, &ver)
					if errors.Is(err, pgx.ErrNoRows) {
						err = nil
					} else if err != nil {
						err = fmt.Errorf("refused, and the document could not be read to say why: %w", err)
					}
					return err // nothing was written: a failed COMMIT loses nothing
				}
			}
			committing = err == nil // BeginFunc commits next
			return err
		})
	})
	if err == nil && t == nil {
		// Refused: the token on record is another, or the document's own
		// is newer, or the document is not in the state cond asks.
		var current fencing.Token
		if cur != nil {
			current = fencing.Token(*cur)
		}
		if current != token {
			return nil, &fencing.StaleError{Key: key, Got: token, Current: current}
		}
		if fencing.Token(doc) > token || !cond.Set() {
			// The document's own token is newer than the one on record
			// (a token row lowered by hand, or by a build that withdrew
			// speculative tokens).
			return nil, &fencing.StaleError{Key: key, Got: token, Current: max(token, fencing.Token(doc))}
		}
		return nil, &refstore.PreconditionError{Key: key, Version: ver}
	}
	var pe *pgconn.PgError
	if err != nil && committing && !errors.As(err, &pe) && !pgconn.SafeToRetry(err) {
		return nil, fmt.Errorf("store: put %q: %w: %w", key, ErrOutcomeUnknown, classify(err))
	}
	if err != nil {
		return nil, fmt.Errorf("store: put %q: %w", key, classify(err))
	}
	r.FencingToken, r.Version, r.UpdatedAt = fencing.Token(*t), *version, *updated
	return r, nil
}

// retryStalePlan is retryPooled on the documents' pool.
func (db *DB) retryStalePlan(query func() error) error {
	return retryPooled(db.docs, query)
}

// retryPooled runs query on pool, and again while it fails on a pooled
// connection without having run (see notRun), at most once per connection
// of the pool: each failure leaves one connection behind (forgotten or
// closed), so the next try takes another, or a new one.
func retryPooled(pool *pgxpool.Pool, query func() error) error {
	err := query()
	for i := int32(0); notRun(err) && i < pool.Config().MaxConns; i++ {
		err = query()
	}
	return err
}

// notRun reports whether err says the statement did not take effect, so
// that it may be sent again on another connection: a statement pgx prepared
// on a pooled connection that no longer matches the table (stalePlan); a
// backend terminated (57P01: pg_terminate_backend, a fast shutdown) while
// its connection sat in the pool, or while the statement ran, which rolls
// it back (Postgres sends 57P01 only before a commit); or a failure before
// anything was sent; or a session ended for idling in a transaction
// (25P03: an issuance whose statement came late after its BEGIN), which
// Postgres raises only before a COMMIT, so the transaction rolled back; or
// a session ended for idling outside a transaction (57P05:
// idle_session_timeout), whose next statement never ran.
func notRun(err error) bool {
	var pe *pgconn.PgError
	return stalePlan(err) || errors.As(err, &pe) && (pe.Code == "57P01" || pe.Code == "25P03" || pe.Code == "57P05") || err != nil && pgconn.SafeToRetry(err)
}

// stalePlan reports whether err is Postgres refusing a prepared statement
// whose result type changed since it was prepared ("cached plan must not
// change result type"): the statement did not run.
func stalePlan(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "0A000" && strings.Contains(pe.Message, "cached plan")
}

// GetResource returns the document under key, or ErrNotFound.
func (db *DB) GetResource(ctx context.Context, key string) (*Resource, error) {
	r := &Resource{Key: key}
	var t int64
	err := db.retryStalePlan(func() error {
		return db.docs.QueryRow(ctx,
			`SELECT data, fencing_token, version, updated_at FROM redfence_resources WHERE key = $1`, key).
			Scan(&r.Data, &t, &r.Version, &r.UpdatedAt)
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("store: get %q: %w", key, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("store: get %q: %w", key, classify(err))
	}
	r.FencingToken = fencing.Token(t)
	return r, nil
}
