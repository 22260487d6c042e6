package store

// API keys (the model is internal/apikey). Guarantees: the database never
// holds a key, only the SHA-256 of the whole key, so reading the table
// reveals no key; every change to the table (made here or by hand) is
// announced on KeysChannel on commit, so WatchKeys tells every server about a
// revocation at once. Not guaranteed: delivery of notifications while a
// watcher is disconnected (it then reports "everything changed" when it is
// back, and callers bound staleness with a cache TTL).

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/redfence/redfence/internal/apikey"
)

// KeysChannel is the Postgres LISTEN/NOTIFY channel on which every change to
// an API key is announced (by a trigger), with the key's id as payload.
const KeysChannel = "redfence_api_keys"

// ErrKeyNotFound is returned when no API key has the given id.
var ErrKeyNotFound = apikey.ErrNotFound

// APIKey is an API key as stored (see internal/apikey, the model this store
// shares with the api package).
type APIKey = apikey.Key

// KeyChange tells a watcher that an API key may have changed.
type KeyChange = apikey.Change

// CreateKey creates an API key for tenant with scopes (at least one of
// apikey.AllScopes) and returns it. The key itself is returned only here: the
// database keeps its hash.
func (db *DB) CreateKey(ctx context.Context, tenant string, scopes []string) (string, *APIKey, error) {
	return db.createKey(ctx, tenant, scopes, nil)
}

// KeyCreator is a process that an API key lives no longer than: Host names
// where PID means something (the host and its PID namespace).
type KeyCreator struct {
	Host string
	PID  int
}

// CreateProcessKey is CreateKey for a key that must not outlive the
// process creator: it revokes the key when it stops, and if it is killed
// first, RevokeOrphanKeys on that host does.
func (db *DB) CreateProcessKey(ctx context.Context, tenant string, scopes []string, creator KeyCreator) (string, *APIKey, error) {
	if creator.Host == "" || creator.PID <= 0 {
		return "", nil, fmt.Errorf("store: create api key: creator %+v: want a host and a PID", creator)
	}
	return db.createKey(ctx, tenant, scopes, &creator)
}

func (db *DB) createKey(ctx context.Context, tenant string, scopes []string, creator *KeyCreator) (string, *APIKey, error) {
	var host *string
	var pid *int
	if creator != nil {
		host, pid = &creator.Host, &creator.PID
	}
	if reason := apikey.ValidTenant(tenant); reason != "" {
		return "", nil, fmt.Errorf("store: tenant %q: %s", apikey.Redact(tenant), reason)
	}
	scopes, err := apikey.CanonicalScopes(scopes)
	if err != nil {
		return "", nil, fmt.Errorf("store: %w", err)
	}
	for attempt := 0; ; attempt++ {
		key, id := apikey.New()
		k := &APIKey{ID: id, Tenant: tenant, Scopes: scopes, Hash: apikey.Hash(key)}
		err := db.pool.QueryRow(ctx,
			`INSERT INTO redfence_api_keys (id, hash, tenant, scopes, creator_host, creator_pid) VALUES ($1, $2, $3, $4, $5, $6) RETURNING created_at`,
			k.ID, k.Hash, k.Tenant, k.Scopes, host, pid).Scan(&k.CreatedAt)
		var pe *pgconn.PgError
		if errors.As(err, &pe) && pe.Code == "23505" && attempt < 3 {
			continue // an id collision (1 in 2^64): draw again
		}
		if err != nil {
			return "", nil, fmt.Errorf("store: create api key: %w", classify(err))
		}
		return key, k, nil
	}
}

const keyColumns = `id, tenant, scopes, created_at, revoked_at, hash`

func scanKey(row pgx.Row) (*APIKey, error) {
	k := &APIKey{}
	var revoked *time.Time
	if err := row.Scan(&k.ID, &k.Tenant, &k.Scopes, &k.CreatedAt, &revoked, &k.Hash); err != nil {
		return nil, err
	}
	if revoked != nil {
		k.RevokedAt = *revoked
	}
	return k, nil
}

// Key returns the API key with the given id (revoked or not), or
// ErrKeyNotFound.
func (db *DB) Key(ctx context.Context, id string) (*APIKey, error) {
	if !apikey.ValidID(id) {
		return nil, fmt.Errorf("store: api key %q: %w", id, ErrKeyNotFound)
	}
	k, err := scanKey(db.pool.QueryRow(ctx, `SELECT `+keyColumns+` FROM redfence_api_keys WHERE id = $1`, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("store: api key %q: %w", id, ErrKeyNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("store: api key %q: %w", id, classify(err))
	}
	return k, nil
}

// Keys returns every API key, oldest first.
func (db *DB) Keys(ctx context.Context) ([]*APIKey, error) {
	rows, err := db.pool.Query(ctx, `SELECT `+keyColumns+` FROM redfence_api_keys ORDER BY created_at, id`)
	if err != nil {
		return nil, fmt.Errorf("store: list api keys: %w", classify(err))
	}
	keys, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (*APIKey, error) { return scanKey(r) })
	if err != nil {
		return nil, fmt.Errorf("store: list api keys: %w", classify(err))
	}
	return keys, nil
}

// RevokeKey revokes the API key with the given id and returns it, or
// ErrKeyNotFound. Revoking a revoked key changes nothing and returns its
// first revocation time. Every server watching (WatchKeys) is told on commit.
func (db *DB) RevokeKey(ctx context.Context, id string) (*APIKey, error) {
	if !apikey.ValidID(id) {
		return nil, fmt.Errorf("store: revoke api key %q: %w", id, ErrKeyNotFound)
	}
	k, err := scanKey(db.pool.QueryRow(ctx,
		`UPDATE redfence_api_keys SET revoked_at = coalesce(revoked_at, now()) WHERE id = $1 RETURNING `+keyColumns, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("store: revoke api key %q: %w", id, ErrKeyNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("store: revoke api key %q: %w", id, classify(err))
	}
	return k, nil
}

// RevokeOrphanKeys revokes the active keys that a process of host created
// (CreateProcessKey) and that gone says no longer exists, and returns them.
func (db *DB) RevokeOrphanKeys(ctx context.Context, host string, gone func(pid int) bool) ([]*APIKey, error) {
	rows, err := db.pool.Query(ctx,
		`SELECT id, creator_pid FROM redfence_api_keys WHERE creator_host = $1 AND revoked_at IS NULL`, host)
	if err != nil {
		return nil, fmt.Errorf("store: orphan api keys: %w", classify(err))
	}
	var ids []string
	var id string
	var pid int
	_, err = pgx.ForEachRow(rows, []any{&id, &pid}, func() error {
		if gone(pid) {
			ids = append(ids, id)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("store: orphan api keys: %w", classify(err))
	}
	if len(ids) == 0 {
		return nil, nil
	}
	rows, err = db.pool.Query(ctx,
		`UPDATE redfence_api_keys SET revoked_at = now() WHERE id = ANY($1) AND revoked_at IS NULL RETURNING `+keyColumns, ids)
	if err != nil {
		return nil, fmt.Errorf("store: revoke orphan api keys: %w", classify(err))
	}
	keys, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (*APIKey, error) { return scanKey(r) })
	if err != nil {
		return nil, fmt.Errorf("store: revoke orphan api keys: %w", classify(err))
	}
	return keys, nil
}

// KeyWatcher delivers API key changes from Postgres LISTEN/NOTIFY until
// Close.
type KeyWatcher struct {
	cancel context.CancelFunc
	done   chan struct{}
}

// Close stops watching and waits until the watcher's connection is closed
// and no more changes will be delivered.
func (w *KeyWatcher) Close() {
	w.cancel()
	<-w.done
}

// Watch intervals. Variables of the algorithm, not tunables.
const (
	// watchProbe is how long the watcher waits for a notification before it
	// pings its connection, so a silently dead connection is found.
	watchProbe = 15 * time.Second
	// watchBackoffMin and watchBackoffMax bound the delay between
	// reconnection attempts.
	watchBackoffMin = 100 * time.Millisecond
	watchBackoffMax = 5 * time.Second
)

// WatchKeys listens on KeysChannel on a connection of its own and calls
// changed for every change to an API key, one call at a time, in order. It
// connects and calls changed(KeyChange{}) before returning (so a bad setup
// fails at once, and whatever was cached before it listened is dropped
// before anything is cached under the watch), and calls it again after
// every reconnection: notifications sent while it was not listening are
// lost, so everything cached must go.
// When the connection fails it logs a warning and reconnects with backoff
// until Close. ctx bounds the first connection only.
func (db *DB) WatchKeys(ctx context.Context, changed func(KeyChange)) (*KeyWatcher, error) {
	conn, err := db.listen(ctx)
	if err != nil {
		return nil, err
	}
	changed(KeyChange{})
	wctx, cancel := context.WithCancel(context.Background())
	w := &KeyWatcher{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(w.done)
		db.watch(wctx, conn, changed)
	}()
	return w, nil
}

// listen opens a connection (outside the pool) and LISTENs on KeysChannel.
func (db *DB) listen(ctx context.Context) (*pgx.Conn, error) {
	cfg := db.pool.Config().ConnConfig
	cfg.RuntimeParams["application_name"] = "redfence"
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("store: watch api keys: %w", classify(err))
	}
	if _, err := conn.Exec(ctx, "LISTEN "+KeysChannel); err != nil {
		_ = conn.Close(context.Background())
		return nil, fmt.Errorf("store: watch api keys: %w", classify(err))
	}
	return conn, nil
}

func (db *DB) watch(ctx context.Context, conn *pgx.Conn, changed func(KeyChange)) {
	log := db.opts.Logger
	closeConn := func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}
	for {
		err := db.wait(ctx, conn, changed)
		closeConn()
		if ctx.Err() != nil {
			return
		}
		log.LogAttrs(ctx, slog.LevelWarn, "api key notifications lost; reconnecting (revocations still apply within the auth cache TTL)",
			slog.String("error", err.Error()))
		for backoff := watchBackoffMin; ; backoff = min(2*backoff, watchBackoffMax) {
			t := time.NewTimer(backoff)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			conn, err = db.listen(lctx)
			cancel()
			if err == nil {
				break
			}
			if ctx.Err() != nil {
				return
			}
			log.LogAttrs(ctx, slog.LevelWarn, "api key notifications: reconnect failed", slog.String("error", err.Error()))
		}
		log.LogAttrs(ctx, slog.LevelInfo, "api key notifications: listening again; cached keys dropped")
		changed(KeyChange{})
	}
}

// wait delivers notifications from conn until it fails or ctx ends. Every
// watchProbe without a notification it pings the connection.
func (db *DB) wait(ctx context.Context, conn *pgx.Conn, changed func(KeyChange)) error {
	for {
		wctx, cancel := context.WithTimeout(ctx, watchProbe)
		n, err := conn.WaitForNotification(wctx)
		cancel()
		switch {
		case err == nil:
			changed(KeyChange{ID: n.Payload})
			continue
		case ctx.Err() != nil:
			return ctx.Err()
		case !errors.Is(err, context.DeadlineExceeded) || conn.IsClosed():
			return err
		}
		// Quiet for watchProbe: a timeout leaves the connection usable, so
		// check that the server is still there.
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err = conn.Ping(pctx)
		cancel()
		if err != nil {
			return fmt.Errorf("ping: %w", err)
		}
	}
}
