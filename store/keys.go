package store

// API keys. Guarantees: the database never holds a key, only the SHA-256 of
// the whole key, so reading the table reveals no key; Verify compares hashes
// in constant time; every change to the table (made here or by hand) is
// announced on KeysChannel on commit, so WatchKeys tells every server about a
// revocation at once. Not guaranteed: delivery of notifications while a
// watcher is disconnected (it then reports "everything changed" when it is
// back, and callers bound staleness with a cache TTL).

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/redfence/redfence/internal/keyspace"
)

// API key scopes: what a key may do.
const (
	// ScopeLocks allows acquiring, extending, releasing and reading locks.
	ScopeLocks = "locks"
	// ScopeResources allows reading and writing the reference store.
	ScopeResources = "resources"
	// ScopeAdmin allows the node view (/v1/nodes) and /metrics.
	ScopeAdmin = "admin"
)

// AllScopes returns every scope, in canonical order.
func AllScopes() []string { return []string{ScopeLocks, ScopeResources, ScopeAdmin} }

// DefaultScopes returns the scopes of a key created without any: locks and
// resources.
func DefaultScopes() []string { return []string{ScopeLocks, ScopeResources} }

// An API key reads "rf_<id>_<secret>": the id is 16 hex digits (8 random
// bytes), public and safe to log; the secret is 32 random bytes in unpadded
// base64url (43 characters).
const (
	// KeyPrefix starts every API key, so secret scanners can find leaked ones.
	KeyPrefix   = "rf_"
	keyIDLen    = 16
	keySecretLn = 43
	// KeyLen is the length of every API key.
	KeyLen = len(KeyPrefix) + keyIDLen + 1 + keySecretLn
)

// KeysChannel is the Postgres LISTEN/NOTIFY channel on which every change to
// an API key is announced (by a trigger), with the key's id as payload.
const KeysChannel = "redfence_api_keys"

// ErrKeyNotFound is returned when no API key has the given id.
var ErrKeyNotFound = errors.New("store: api key not found")

// APIKey is an API key as stored: never its secret, only the hash of the
// whole key.
type APIKey struct {
	// ID is the public part of the key.
	ID string
	// Tenant is the namespace of every lock and resource the key touches.
	Tenant string
	// Scopes are what the key may do, in canonical order.
	Scopes    []string
	CreatedAt time.Time
	// RevokedAt is when the key was revoked; zero while it is active.
	RevokedAt time.Time
	// Hash is the SHA-256 of the whole key.
	Hash []byte
}

// Revoked reports whether the key was revoked.
func (k *APIKey) Revoked() bool { return !k.RevokedAt.IsZero() }

// HasScope reports whether the key carries scope.
func (k *APIKey) HasScope(scope string) bool { return slices.Contains(k.Scopes, scope) }

// Verify reports whether key is this API key, comparing hashes in constant
// time so that the time taken reveals nothing about the stored hash.
func (k *APIKey) Verify(key string) bool {
	h := HashKey(key)
	return subtle.ConstantTimeCompare(h, k.Hash) == 1
}

// HashKey returns the SHA-256 of key.
//
// A fast hash is the right choice here, unlike for passwords: the secret is
// 256 bits from crypto/rand, so there is no dictionary or low-entropy space
// that a slow KDF (bcrypt, argon2) would protect; reversing SHA-256 of such a
// key is a 2^256 search either way. A fast hash lets every cache miss be
// checked in microseconds instead of costing tens of milliseconds of CPU that
// an unauthenticated client could make the server spend.
func HashKey(key string) []byte {
	h := sha256.Sum256([]byte(key))
	return h[:]
}

// KeyID returns the id of a well-formed API key, and false for anything that
// cannot be one. It looks at the form only: the key may still be unknown.
func KeyID(key string) (string, bool) {
	if len(key) != KeyLen || !strings.HasPrefix(key, KeyPrefix) || key[len(KeyPrefix)+keyIDLen] != '_' {
		return "", false
	}
	id := key[len(KeyPrefix) : len(KeyPrefix)+keyIDLen]
	if !validKeyID(id) {
		return "", false
	}
	for i := len(KeyPrefix) + keyIDLen + 1; i < len(key); i++ {
		c := key[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return "", false
		}
	}
	return id, true
}

func validKeyID(id string) bool {
	if len(id) != keyIDLen {
		return false
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// ParseScopes parses a comma-separated list of scopes ("locks,resources").
// It ignores spaces and repeats and returns the scopes in canonical order;
// an unknown or missing scope is an error.
func ParseScopes(list string) ([]string, error) {
	var out []string
	for s := range strings.SplitSeq(list, ",") {
		s = strings.TrimSpace(s)
		if !slices.Contains(AllScopes(), s) {
			return nil, fmt.Errorf("store: unknown scope %q (want %s)", s, strings.Join(AllScopes(), ", "))
		}
		if !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	return canonicalScopes(out), nil
}

func canonicalScopes(scopes []string) []string {
	var out []string
	for _, s := range AllScopes() {
		if slices.Contains(scopes, s) {
			out = append(out, s)
		}
	}
	return out
}

// ValidTenant reports why tenant cannot name a tenant, or "" when it can: 1
// to 200 characters of A-Z a-z 0-9 . _ - : (a keyspace namespace).
func ValidTenant(tenant string) string {
	if tenant == "" {
		return "must not be empty"
	}
	if !keyspace.ValidNamespace(tenant) {
		return keyspace.ValidName(tenant)
	}
	return ""
}

// newKey returns a fresh API key and its id.
func newKey() (key, id string) {
	var b [8 + 32]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand, Go 1.24+)
	id = hex.EncodeToString(b[:8])
	return KeyPrefix + id + "_" + base64.RawURLEncoding.EncodeToString(b[8:]), id
}

// CreateKey creates an API key for tenant with scopes (at least one of
// AllScopes) and returns it. The key itself is returned only here: the
// database keeps its hash.
func (db *DB) CreateKey(ctx context.Context, tenant string, scopes []string) (string, *APIKey, error) {
	if reason := ValidTenant(tenant); reason != "" {
		return "", nil, fmt.Errorf("store: tenant %q: %s", tenant, reason)
	}
	for _, s := range scopes {
		if !slices.Contains(AllScopes(), s) {
			return "", nil, fmt.Errorf("store: unknown scope %q (want %s)", s, strings.Join(AllScopes(), ", "))
		}
	}
	scopes = canonicalScopes(scopes)
	if len(scopes) == 0 {
		return "", nil, errors.New("store: an API key needs at least one scope")
	}
	for attempt := 0; ; attempt++ {
		key, id := newKey()
		k := &APIKey{ID: id, Tenant: tenant, Scopes: scopes, Hash: HashKey(key)}
		err := db.pool.QueryRow(ctx,
			`INSERT INTO redfence_api_keys (id, hash, tenant, scopes) VALUES ($1, $2, $3, $4) RETURNING created_at`,
			k.ID, k.Hash, k.Tenant, k.Scopes).Scan(&k.CreatedAt)
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
	if !validKeyID(id) {
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
	if !validKeyID(id) {
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

// KeyChange tells a watcher that an API key may have changed.
type KeyChange struct {
	// ID is the key that changed; "" means any key may have changed (the
	// watch connection was (re)established, so notifications may have been
	// missed, or the table was truncated): drop everything cached.
	ID string
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
// changed for every change to an API key, from one goroutine, in order. It
// connects before returning (so a bad setup fails at once) and then calls
// changed(KeyChange{}) as it does after every reconnection: notifications
// sent while it was not listening are lost, so everything cached must go.
// When the connection fails it logs a warning and reconnects with backoff
// until Close. ctx bounds the first connection only.
func (db *DB) WatchKeys(ctx context.Context, changed func(KeyChange)) (*KeyWatcher, error) {
	conn, err := db.listen(ctx)
	if err != nil {
		return nil, err
	}
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
	changed(KeyChange{})
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
