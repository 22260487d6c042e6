package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// RegisterNode records the Redis node addr with epoch unless it is known, and
// returns its epoch and quarantine end (zero if none); created reports that
// it was unknown. It implements service.Registry.
func (db *DB) RegisterNode(ctx context.Context, addr, epoch string) (string, time.Time, bool, error) {
	var cur string
	var until *time.Time
	err := db.pool.QueryRow(ctx, `
INSERT INTO redfence_nodes (addr, epoch) VALUES ($1, $2)
ON CONFLICT (addr) DO NOTHING
RETURNING epoch, quarantined_until`, addr, epoch).Scan(&cur, &until)
	if err == nil {
		return cur, deref(until), true, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return "", time.Time{}, false, fmt.Errorf("store: register node %s: %w", addr, classify(err))
	}
	if err := db.pool.QueryRow(ctx, `SELECT epoch, quarantined_until FROM redfence_nodes WHERE addr = $1`, addr).Scan(&cur, &until); err != nil {
		return "", time.Time{}, false, fmt.Errorf("store: register node %s: %w", addr, classify(err))
	}
	return cur, deref(until), false, nil
}

// QuarantineNode records that addr lost the marker expected. If addr's epoch
// is still expected and no quarantine is running, it moves addr to epoch next
// and quarantines it until now + d, by Postgres' clock, so every server
// sharing the nodes agrees on the end. Either way it returns addr's epoch and
// quarantine end after the statement. It implements service.Registry.
func (db *DB) QuarantineNode(ctx context.Context, addr, expected, next string, d time.Duration) (string, time.Time, error) {
	var cur string
	var until *time.Time
	err := db.pool.QueryRow(ctx, `
WITH moved AS (
    UPDATE redfence_nodes
       SET epoch = $3,
           quarantined_until = now() + make_interval(secs => $4::float8 / 1000),
           memory_losses = memory_losses + 1,
           updated_at = now()
     WHERE addr = $1 AND epoch = $2 AND (quarantined_until IS NULL OR quarantined_until <= now())
 RETURNING epoch, quarantined_until
)
SELECT epoch, quarantined_until FROM moved
UNION ALL
SELECT epoch, quarantined_until FROM redfence_nodes WHERE addr = $1 AND NOT EXISTS (SELECT 1 FROM moved)`,
		addr, expected, next, d.Milliseconds()).Scan(&cur, &until)
	if err != nil {
		return "", time.Time{}, fmt.Errorf("store: quarantine node %s: %w", addr, classify(err))
	}
	return cur, deref(until), nil
}

func deref(t *time.Time) time.Time {
	if t == nil {
		return time.Time{}
	}
	return *t
}
