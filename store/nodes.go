package store

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// leftSQL is the time left of a node row's quarantine in milliseconds, by
// Postgres' clock (0 if none).
const leftSQL = `GREATEST(COALESCE(EXTRACT(EPOCH FROM quarantined_until - now()) * 1000, 0), 0)::float8`

// liveNeedSQL is the longest quarantine, in milliseconds, that a server which
// may still hold a lease needs (0 if none): one whose last heartbeat is
// younger than its own quarantine plus its grace, as the leases it granted
// before stopping end within that (see Heartbeat).
const liveNeedSQL = `(SELECT COALESCE(max(quarantine_ms), 0) FROM redfence_servers
   WHERE seen_at + make_interval(secs => (quarantine_ms + grace_ms)::float8 / 1000) > now())`

// RegisterNode records the Redis node addr with epoch unless it is known, and
// returns its epoch and the time left of its quarantine (0 if none); created
// reports that it was unknown. An address first seen while some server may
// still hold a lease is quarantined at once, as a node that lost its memory
// would be: it may be a node those servers know under another address, just
// restarted. Only a brand-new cluster's nodes count at once. An unknown
// addr's record is committed only once check (if not nil) has returned
// nil, in the transaction that inserts it: a RegisterNode of addr by another
// server meanwhile waits for the row, and then reads it, or inserts its own
// if check failed. So no server adopts an epoch whose record check refused
// (a node marked by another database's servers, see
// service.ErrForeignNode). It implements service.Registry.
func (db *DB) RegisterNode(ctx context.Context, addr, epoch string, check func(ctx context.Context) error) (string, time.Duration, bool, error) {
	tx, err := db.pool.Begin(ctx)
	if err != nil {
		return "", 0, false, fmt.Errorf("store: register node %s: %w", addr, classify(err))
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }() // a no-op once committed
	var cur string
	var left float64
	err = tx.QueryRow(ctx, `
INSERT INTO redfence_nodes (addr, epoch, quarantined_until)
SELECT $1, $2, CASE WHEN need > 0 THEN now() + make_interval(secs => need::float8 / 1000) END
  FROM (SELECT `+liveNeedSQL+` AS need) n
ON CONFLICT (addr) DO NOTHING
RETURNING epoch, `+leftSQL, addr, epoch).Scan(&cur, &left)
	created := err == nil
	switch {
	case created && check != nil:
		if err := check(ctx); err != nil {
			return "", 0, false, err
		}
	case errors.Is(err, pgx.ErrNoRows):
		// Known: committed by another server (an INSERT that found its
		// row not committed yet waited for it).
		err = tx.QueryRow(ctx, `SELECT epoch, `+leftSQL+` FROM redfence_nodes WHERE addr = $1`, addr).Scan(&cur, &left)
	}
	if err == nil {
		err = tx.Commit(ctx)
	}
	if err != nil {
		return "", 0, false, fmt.Errorf("store: register node %s: %w", addr, classify(err))
	}
	return cur, millis(left), created, nil
}

// QuarantineNode records that addr lost the marker expected, or, with a
// runID, that its Redis process was found restarted as runID. If addr's epoch
// is still expected, or runID is not the process on record (so no server
// has handled this restart yet, even if the epoch moved on for an earlier
// one), it moves addr to epoch next, records runID and whether it fsyncs
// every write (durable), and quarantines it until
// now + d, or longer if a server that may still hold a lease needs more (see
// Heartbeat), or if a quarantine already running ends later, by Postgres'
// clock, so every server sharing the nodes agrees on the end. (A loss during
// a running quarantine restarts it: a server that knows the node under
// another address may have counted it meanwhile.) Either way it returns
// addr's epoch and the time left of its quarantine after the statement (0 if
// none), by Postgres' clock: a server's clock may be set differently, and
// counts the time left instead. It implements service.Registry.
func (db *DB) QuarantineNode(ctx context.Context, addr, expected, next, runID string, durable bool, d time.Duration) (string, time.Duration, error) {
	var cur string
	var left float64
	err := db.pool.QueryRow(ctx, `
UPDATE redfence_nodes
   SET epoch = $3,
       quarantined_until = GREATEST(COALESCE(quarantined_until, now()),
           now() + make_interval(secs => GREATEST($4::bigint, `+liveNeedSQL+`)::float8 / 1000)),
       memory_losses = memory_losses + 1,
       run_id = COALESCE(NULLIF($5, ''), run_id),
       run_durable = CASE WHEN $5 <> '' THEN $6 ELSE run_durable END,
       updated_at = now()
 WHERE addr = $1 AND (epoch = $2 OR ($5 <> '' AND run_id IS DISTINCT FROM $5))
RETURNING epoch, `+leftSQL, addr, expected, next, ceilMillis(d), runID, durable).Scan(&cur, &left)
	if errors.Is(err, pgx.ErrNoRows) {
		// Another server moved it first. Read it in a statement of its own:
		// within the UPDATE's, a read would see the row as it was before
		// that server's move committed (READ COMMITTED re-checks only the
		// rows it updates), and hand back the epoch the node just proved
		// it lacks.
		err = db.pool.QueryRow(ctx, `SELECT epoch, `+leftSQL+` FROM redfence_nodes WHERE addr = $1`, addr).Scan(&cur, &left)
	}
	if err != nil {
		return "", 0, fmt.Errorf("store: quarantine node %s: %w", addr, classify(err))
	}
	return cur, millis(left), nil
}

// NodeProcess records that addr's Redis process is runID, durable (it fsyncs
// every write) or not, as a server found it when it had not been watching
// the node (at its start, or on its first connection to a node that was down
// then) or saw it restart with every write kept. If the record names another
// process, the node restarted and may have come back from a snapshot without
// the locks written since: unless both that process and runID are durable,
// or no server may still hold a lease, it moves addr to epoch next and
// quarantines it for as long as the servers that may hold leases need (see
// Heartbeat), never shortening a running quarantine. A record without a
// process just gets runID. It returns addr's epoch and the time left of its
// quarantine after the statement (0 if none), by Postgres' clock; the epoch
// is next if this call started the quarantine. It implements
// service.Registry.
func (db *DB) NodeProcess(ctx context.Context, addr, runID, next string, durable bool) (string, time.Duration, error) {
	// In SET, n.run_id and n.quarantined_until are the row's values before
	// the statement. A concurrent call for the same restart waits for the
	// row lock and then sees runID on record: it reports the quarantine
	// the first one started instead of starting another.
	const restarted = `(n.run_id IS NOT NULL AND n.run_id <> $2 AND NOT ($4 AND n.run_durable) AND r.need > 0)`
	if runID == "" {
		return "", 0, fmt.Errorf("store: record process of node %s: no run_id", addr)
	}
	var cur string
	var left float64
	err := db.pool.QueryRow(ctx, `
UPDATE redfence_nodes AS n
   SET epoch = CASE WHEN `+restarted+` THEN $3 ELSE n.epoch END,
       quarantined_until = CASE WHEN `+restarted+`
           THEN GREATEST(COALESCE(n.quarantined_until, now()), now() + make_interval(secs => r.need::float8 / 1000))
           ELSE n.quarantined_until END,
       memory_losses = n.memory_losses + CASE WHEN `+restarted+` THEN 1 ELSE 0 END,
       updated_at = CASE WHEN `+restarted+` THEN now() ELSE n.updated_at END,
       run_id = $2,
       run_durable = $4
  FROM (SELECT `+liveNeedSQL+` AS need) r
 WHERE n.addr = $1
RETURNING n.epoch, `+leftSQL, addr, runID, next, durable).Scan(&cur, &left)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", 0, fmt.Errorf("store: record process of node %s: node not registered", addr)
	}
	if err != nil {
		return "", 0, fmt.Errorf("store: record process of node %s: %w", addr, classify(err))
	}
	return cur, millis(left), nil
}

// ceilMillis is d in whole milliseconds, rounded up so that a quarantine
// never ends early.
func ceilMillis(d time.Duration) int64 {
	return (d + time.Millisecond - 1).Milliseconds()
}

// millis converts a number of milliseconds, rounded up so that a quarantine
// never ends early.
func millis(ms float64) time.Duration {
	return time.Duration(math.Ceil(ms * float64(time.Millisecond)))
}

// Heartbeat records that the server id runs, that a node that lost its
// memory must be quarantined for at least quarantine for its leases, and
// which Redis nodes it lists (their addresses, sorted; nil records none). A
// server whose heartbeats stopped counts until its quarantine plus grace has
// passed since the last one; a day after that its row is deleted.
//
// Majorities of two different node lists need not overlap: servers listing
// them could both grant one name at once. So when another server that may
// still hold a lease lists other nodes, Heartbeat records nothing and fails
// with an error matching ErrNodeListDiffers, which says until when that
// server's leases may last. A server's first heartbeat is checked, and one
// that comes after the server stopped counting (a long Postgres outage);
// not the beats of a server that counts, which a record changing under it
// (a node's run_id, see otherNodesSQL) must not stop. Heartbeats are
// serialised for that check, so
// two servers with different lists starting together cannot both pass it.
// Servers that recorded no list (older versions) are not compared. It
// implements service.Registry.
func (db *DB) Heartbeat(ctx context.Context, id string, quarantine, grace time.Duration, nodes []string) error {
	var other otherServer
	err := retryPooled(db.pool, func() error {
		other = otherServer{}
		// One batch, in one implicit transaction: Postgres holds the
		// lock only while it runs the batch, never while it waits for
		// this client (a link that stalls mid-beat would hold up every
		// server's beat). The second statement sees what the beats
		// before the lock committed (READ COMMITTED).
		b := &pgx.Batch{}
		b.Queue(heartbeatLockSQL)
		b.Queue(beatSQL, id, ceilMillis(quarantine), ceilMillis(grace), nodes).QueryRow(func(row pgx.Row) error {
			err := row.Scan(&other.id, &other.nodes, &other.sinceMS, &other.leftMS)
			if errors.Is(err, pgx.ErrNoRows) {
				return nil
			}
			other.found = err == nil
			return err
		})
		return db.pool.SendBatch(ctx, b).Close()
	})
	if err != nil {
		return fmt.Errorf("store: heartbeat of server %s: %w", id, classify(err))
	}
	if other.found {
		advice := "Change the list of nodes with every server stopped, then start them when the old servers' leases have ended"
		if unknown := db.unknownProcesses(ctx, nodes); len(unknown) > 0 {
			advice = fmt.Sprintf("This list has addresses compared as themselves, with no Redis process on record for %s: "+
				"if they only spell listed nodes another way (their nodes did not answer there yet), start this server again once they answer; "+
				"otherwise change the list of nodes with every server stopped, then start them when the old servers' leases have ended",
				strings.Join(unknown, ","))
		}
		return fmt.Errorf("store: heartbeat of server %s: %w: server %s (last heartbeat %v ago; its leases may last %v more) lists %s, this one %s. "+
			"Majorities of different lists need not overlap, so both could grant one lock at once. %s",
			id, ErrNodeListDiffers, other.id, millis(other.sinceMS).Round(time.Millisecond), millis(other.leftMS).Round(time.Millisecond),
			strings.Join(other.nodes, ","), strings.Join(nodes, ","), advice)
	}
	return nil
}

// unknownProcesses returns the addresses of nodes (sorted) that have no
// Redis process on record (see NodeProcess), which otherNodesSQL compares as
// themselves: a refused list holding one may be a respelling of the other
// server's whose node has not answered under the new address yet. Best
// effort, for a refusal's message: none if Postgres does not answer.
func (db *DB) unknownProcesses(ctx context.Context, nodes []string) []string {
	var unknown []string
	err := db.pool.QueryRow(ctx, `
SELECT COALESCE(array_agg(a ORDER BY a), '{}')
  FROM unnest($1::text[]) AS a LEFT JOIN redfence_nodes n ON n.addr = a
 WHERE n.run_id IS NULL`, nodes).Scan(&unknown)
	if err != nil {
		return nil
	}
	return unknown
}

// heartbeatLockSQL takes the lock that serialises heartbeats' checks of the
// node lists, until the end of the transaction.
const heartbeatLockSQL = `SELECT pg_advisory_xact_lock(hashtextextended('redfence_servers.nodes', 0))`

// otherServer is a server found by otherNodesSQL.
type otherServer struct {
	found           bool
	id              string
	nodes           []string
	sinceMS, leftMS float64
}

// otherNodesSQL finds, unless server $1 still counts (its heartbeat
// passed this check, and is recent enough that it may hold leases), a
// server other than $1 that may still hold a lease
// (see liveNeedSQL) and lists other nodes than $4 (none when $4 is NULL),
// the one whose leases may last longest: its id, its nodes, the time since
// its last heartbeat and the time its leases may last, in milliseconds.
// Lists whose addresses differ but whose Redis processes are the same (each
// address's run_id on record, see NodeProcess: one node's address spelt
// another way) are the same nodes; an address without a run_id on record is
// compared as itself. Whether a server counts is judged at clock.now, the
// time the statement holding it runs (after the heartbeats' lock was
// taken), not as its transaction began (now()): a beat that waited for the
// lock past the end of its server's count, while a server with another
// list started, must be checked. It is a part of beatSQL.
const otherNodesSQL = `
SELECT id, nodes,
       (EXTRACT(EPOCH FROM clock.now - seen_at) * 1000)::float8 AS since_ms,
       (EXTRACT(EPOCH FROM seen_at + make_interval(secs => (quarantine_ms + grace_ms)::float8 / 1000) - clock.now) * 1000)::float8 AS left_ms
  FROM redfence_servers, clock
 WHERE id <> $1 AND nodes IS NOT NULL AND nodes <> $4::text[]
   AND NOT EXISTS (SELECT 1 FROM redfence_servers WHERE id = $1
                      AND seen_at + make_interval(secs => (quarantine_ms + grace_ms)::float8 / 1000) > clock.now)
   AND seen_at + make_interval(secs => (quarantine_ms + grace_ms)::float8 / 1000) > clock.now
   AND (SELECT array_agg(COALESCE(n.run_id, a) ORDER BY COALESCE(n.run_id, a))
          FROM unnest(nodes) AS a LEFT JOIN redfence_nodes n ON n.addr = a)
       IS DISTINCT FROM
       (SELECT array_agg(COALESCE(n.run_id, a) ORDER BY COALESCE(n.run_id, a))
          FROM unnest($4::text[]) AS a LEFT JOIN redfence_nodes n ON n.addr = a)
 ORDER BY left_ms DESC
 LIMIT 1`

// beatSQL returns the server otherNodesSQL finds; unless it finds one, it
// records server $1's heartbeat, with its quarantine ($2 ms), grace ($3 ms)
// and nodes ($4), and forgets servers silent for a day past theirs.
const beatSQL = `
WITH clock AS MATERIALIZED (SELECT clock_timestamp() AS now),
other AS MATERIALIZED (` + otherNodesSQL + `),
gone AS (
    DELETE FROM redfence_servers
     WHERE seen_at + make_interval(secs => (quarantine_ms + grace_ms)::float8 / 1000) < now() - interval '1 day' AND id <> $1
       AND NOT EXISTS (SELECT 1 FROM other)),
beat AS (
    INSERT INTO redfence_servers (id, quarantine_ms, grace_ms, nodes)
    SELECT $1, $2, $3, $4 WHERE NOT EXISTS (SELECT 1 FROM other)
    ON CONFLICT (id) DO UPDATE SET quarantine_ms = excluded.quarantine_ms, grace_ms = excluded.grace_ms, nodes = excluded.nodes, seen_at = now())
SELECT id, nodes, since_ms, left_ms FROM other`
