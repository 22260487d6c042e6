package main

import (
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/redfence/redfence/fencing"
)

//go:embed schema.sql
var schema string

// putSQL is the recipe: one conditional upsert. The write is applied only
// when its fencing token is at least as new as the token of the last write
// applied to the row (">=": one holder may write many times), and, when the
// client sends a version ($4 not null), only if the row is still at that
// version (compare-and-set for read-modify-write; a row that does not exist
// is at no version, so such a write does not create it). Version 0 means
// "no row yet" (If-None-Match: *): it only creates. A refused write changes
// nothing and returns no row.
const putSQL = `
INSERT INTO documents AS d (id, body, fencing_token)
SELECT $1, $2, $3
 WHERE $4::bigint IS NULL OR $4 = 0 OR EXISTS (SELECT 1 FROM documents WHERE id = $1)
ON CONFLICT (id) DO UPDATE
   SET body = EXCLUDED.body,
       fencing_token = EXCLUDED.fencing_token,
       version = d.version + 1,
       updated_at = now()
 WHERE d.fencing_token <= EXCLUDED.fencing_token
   AND ($4::bigint IS NULL OR d.version = $4)
RETURNING version, updated_at`

// Document is one stored document.
type Document struct {
	ID           string          `json:"id"`
	Body         json.RawMessage `json:"body"`
	FencingToken fencing.Token   `json:"fencing_token"`
	Version      int64           `json:"version"`
	UpdatedAt    time.Time       `json:"updated_at"`
}

// ErrNotFound: no document under that id.
var ErrNotFound = errors.New("fenced-store: not found")

// ErrVersion: the document is no longer at the version the write was based on.
var ErrVersion = errors.New("fenced-store: version changed")

// Store keeps documents in Postgres, guarded by fencing tokens.
type Store struct{ pool *pgxpool.Pool }

// Migrate creates the table if it is missing.
func (s *Store) Migrate(ctx context.Context) error {
	_, err := s.pool.Exec(ctx, schema)
	return err
}

// Put writes body under id with token; ifVersion, if not nil, is the version
// the write was based on (0: none, the write only creates the document). It
// returns the new version, or an error matching fencing.ErrStale (a
// *fencing.StaleError) or ErrVersion.
func (s *Store) Put(ctx context.Context, id string, body json.RawMessage, token fencing.Token, ifVersion *int64) (*Document, error) {
	d := &Document{ID: id, Body: body, FencingToken: token}
	err := s.pool.QueryRow(ctx, putSQL, id, body, int64(token), ifVersion).Scan(&d.Version, &d.UpdatedAt)
	if err == nil {
		return d, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return nil, err
	}
	// Refused: tell why (informational; the refusal itself was atomic).
	cur, err := s.Get(ctx, id)
	if errors.Is(err, ErrNotFound) && ifVersion != nil {
		return nil, fmt.Errorf("%w: no document, not version %d", ErrVersion, *ifVersion)
	}
	if err != nil {
		return nil, err
	}
	if cur.FencingToken > token || ifVersion == nil {
		return nil, &fencing.StaleError{Key: id, Got: token, Current: cur.FencingToken}
	}
	return nil, fmt.Errorf("%w: at version %d, not %d", ErrVersion, cur.Version, *ifVersion)
}

// Get reads the document under id.
func (s *Store) Get(ctx context.Context, id string) (*Document, error) {
	d := &Document{ID: id}
	var token int64
	err := s.pool.QueryRow(ctx, `SELECT body, fencing_token, version, updated_at FROM documents WHERE id = $1`, id).
		Scan(&d.Body, &token, &d.Version, &d.UpdatedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, ErrNotFound
	}
	d.FencingToken = fencing.Token(token)
	return d, err
}
