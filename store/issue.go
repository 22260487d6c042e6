package store

// Fencing-token issuance with group commit.
//
// Issuance runs in at most Options.IssueCommitters batches at once: that
// many committer slots. A batch is the oldest waiting claims (up to
// Options.IssueBatchMax, one per key), issued in ONE statement; every caller
// gets its token once that statement's commit is durable.
//
// Issue queues its claim. If a slot is free, the caller takes it and runs
// the next batch on its own goroutine, like the leader of a group commit: it
// takes the oldest takeable claims (its own among them in queue order,
// unless its key is in flight), runs the statement, delivers every result,
// frees the slot and wakes a committer if claims are left. So a lone caller
// pays for one statement and no goroutine hand-off. If every slot is busy,
// the claim waits; as slots free up, committer goroutines (one per slot,
// idle until then) take the claims that piled up, which share the next
// commit. Nothing waits for a batch to fill, and no claim stays queued while
// a slot is free and its key is not in flight: whoever frees a slot or a
// key takes the queue or wakes a committer.
//
// Guarantees: a token is delivered only after the transaction that issued
// it committed with synchronous_commit on (its COMMIT answered; see
// issueTx). A key appears at most
// once per statement, and claims for one key are issued in the order Issue
// queued them: a batch skips a key that another batch of this DB has in
// flight, leaving later claims queued in order. Each batch locks its rows in
// ascending byte order of the keys, so batches of any number of processes
// sharing the database cannot deadlock on each other.
//
// A claim's deadline (its caller's context's) holds on the server too: a
// row reached after the claim's deadline, counted on Postgres' clock from
// the start of the transaction, which began before the time left was
// measured, is left as it is (issueSQL, issueTx). So a batch held up (on
// one key's row: another server's issuance, a slow document write; or on
// its way: a table lock, the network) never issues a claim whose lease
// ended meanwhile, after a token another server issued since. That holds
// while the two clocks run at about the same rate, as Redlock assumes.
//
// A row another transaction holds (a document's write on that key, an
// outside session) holds up only its own key. A batch's
// transaction waits at most Options.IssueLockWait for any row
// (lock_timeout); when that runs out, nothing of it was committed, and the
// batch runs again around the rows held: it locks those that are free
// (SKIP LOCKED, so it waits for none) and issues their claims, and each
// claim whose row is held is set aside to wait for it alone, on a goroutine
// of its own and a connection of a pool kept for such waits (heldRowConns
// of them, so held rows cannot take the connections of the other keys'
// batches, heartbeats, node records and API keys), with no lock timeout but
// its deadline. Its key stays in flight until then, so later claims for it
// stay queued behind it, while its slot is freed for the other keys.
//
// A caller who leaves (its context is cancelled) while its claim is queued
// gets no token issued, and Issue returns at once. Once a batch took the
// claim, the token may still be issued (and is then burned, as
// fencing.Issuer allows): Issue then waits for the batch's outcome, until
// the claim's deadline at most. Returning at once would let the caller free
// its name (its lease) while the batch has not reached the claim's row (it
// waits for another key's row, or has not sent its statement yet), and
// another server's grant of the name could then be issued a token before
// this one, and be fenced out by it. Past the claim's deadline nothing of
// it is issued that has not locked its row (issueSQL), and a row locked
// orders later tokens after it. A claim set aside stops waiting for its row
// when its caller leaves. A caller running a batch inline does not leave
// before that batch ends (others wait on it): it then returns its own
// result even if its context ended meanwhile.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/redfence/redfence/fencing"
)

// Defaults of the issuance Options.
const (
	defaultIssueCommitters = 2
	defaultIssueBatchMax   = 256
	defaultIssueTimeout    = 10 * time.Second
	defaultIssueLockWait   = 50 * time.Millisecond
)

// ErrClosed is returned (wrapped) by Issue once Close was called. It matches
// ErrUnavailable too.
var ErrClosed = fmt.Errorf("%w: closed", ErrUnavailable)

var _ fencing.Issuer = (*DB)(nil)

// issueSQL issues the token of one claim. It serves batches of one. $4 is
// the claim's budget in microseconds, counted from the start of the
// transaction (see issueTx): a row reached only once it has run out (held
// by another transaction meanwhile, or the statement held up on its way) is
// left as it is, and no row comes back (errLate).
const issueSQL = `
INSERT INTO redfence_fencing AS f (key, token, owner, holder, issued_at)
VALUES ($1, 1, $2, $3, now())
ON CONFLICT (key) DO UPDATE
   SET token = f.token + 1, owner = excluded.owner, holder = excluded.holder, issued_at = excluded.issued_at
 WHERE clock_timestamp() < transaction_timestamp() + $4::bigint * interval '1 microsecond'
RETURNING token`

// issueBatchSQL issues the tokens of several claims with distinct keys. The
// rows are inserted (and so locked) in the order of the arrays, which the
// caller sorts by key. $4 holds each claim's budget, as in issueSQL: a claim
// whose row is reached too late gets no row back, and the others go on.
const issueBatchSQL = `
INSERT INTO redfence_fencing AS f (key, token, owner, holder, issued_at)
SELECT u.k, 1, u.o, u.h, now()
  FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS u(k, o, h, i)
 ORDER BY u.i
ON CONFLICT (key) DO UPDATE
   SET token = f.token + 1, owner = excluded.owner, holder = excluded.holder, issued_at = excluded.issued_at
 WHERE clock_timestamp() < transaction_timestamp()
       + ($4::bigint[])[array_position($1::text[], excluded.key)] * interval '1 microsecond'
RETURNING key, token`

// errLate is the result of a claim whose row was reached only after its
// budget ran out (issueSQL): nothing was issued for it. Its caller has given
// up by then, and its lease may be over: a token committed now could come
// after one another server issued since for a newer grant, and fence that
// live holder out.
var errLate = fmt.Errorf("its deadline passed while it waited for the row of its key; nothing was issued: %w", context.DeadlineExceeded)

// Issue implements fencing.Issuer: it returns a new token for c.Key, larger
// than every token issued before for it, once the commit that recorded it is
// durable. Concurrent calls share one statement and one commit (see
// Options.IssueCommitters); when a committer slot is free, the statement
// runs on the calling goroutine. When ctx ends first, Issue returns an error
// wrapping ctx.Err() at once if the claim was still queued (nothing is
// issued) or ctx's deadline passed (the token may still be issued, and is
// then burned, but only if its row was locked before the deadline, so every
// token issued after Issue returns comes after it). If ctx was cancelled
// after a batch took the claim, Issue returns that batch's outcome once it
// is known (a token then, which the caller who left must not grant: it is
// burned), or that error at the deadline (see the top of this file).
// Errors from Postgres match ErrUnavailable or ErrInvalidData; after Close
// they match ErrClosed; a ctx that ends first gives one matching ctx.Err(),
// but for a token that came in as it ended.
func (db *DB) Issue(ctx context.Context, c fencing.Claim) (fencing.Token, error) {
	if err := ctx.Err(); err != nil {
		return 0, fmt.Errorf("store: issue token for %q: %w", c.Key, err)
	}
	r := &issueReq{ctx: ctx, claim: c, done: make(chan issueResult, 1)}
	if err := db.issuer.submit(r); err != nil {
		return 0, err
	}
	select {
	case res := <-r.done:
		return res.tok, res.err
	case <-ctx.Done():
	}
	select {
	case res := <-r.done: // it came in just now (or ran inline): do not burn it
		return res.tok, res.err
	default:
	}
	if !db.issuer.withdraw(r) {
		return 0, fmt.Errorf("store: issue token for %q: gave up waiting before a batch took it; nothing was issued: %w", c.Key, ctx.Err())
	}
	if errors.Is(ctx.Err(), context.Canceled) {
		db.issuer.leftWaits.Add(1)
		var deadline <-chan time.Time
		if d, ok := ctx.Deadline(); ok {
			t := time.NewTimer(time.Until(d))
			defer t.Stop()
			deadline = t.C
		}
		select {
		case res := <-r.done:
			if res.err != nil && !errors.Is(res.err, ctx.Err()) {
				res.err = fmt.Errorf("%w (its caller left: %w)", res.err, ctx.Err())
			}
			return res.tok, res.err
		case <-deadline:
		}
	}
	return 0, fmt.Errorf("store: issue token for %q: gave up waiting at its deadline (the token may still be issued): %w", c.Key, ctx.Err())
}

// issueResult is what a batch hands to a waiting Issue.
type issueResult struct {
	tok fencing.Token
	err error
}

// issueReq is one queued claim.
type issueReq struct {
	// ctx is the caller's: it is checked (a claim whose caller left is
	// dropped unissued) and its deadline bounds the batch, but it never
	// cancels a batch.
	ctx   context.Context
	claim fencing.Claim
	// done has room for the one result, so a batch never blocks on a
	// caller that left.
	done chan issueResult
	// setAside is set, by the batch that took the claim, when its row was
	// held by another transaction: the claim waits for it on a goroutine
	// of its own (see issuer.setAside), which frees its key.
	setAside bool
	// taken is set, under issuer.mu, when a batch takes the claim: its
	// result will come on done.
	taken bool
}

// issueHooks let tests observe and stall issuance. Set them before the first
// Issue.
type issueHooks struct {
	// enqueued runs in Issue after c was queued (also when Issue then runs
	// the batch itself, before it does), with the queue length then.
	enqueued func(c fencing.Claim, queued int)
	// batch runs before a batch's statement, on the goroutine running the
	// batch (a committer's or an inline Issue's), with its claims in
	// statement order.
	batch func(claims []fencing.Claim)
}

// issuer queues claims and runs their batches in a fixed number of slots,
// inline in Issue or in committer goroutines.
type issuer struct {
	pool     *pgxpool.Pool
	batchMax int
	timeout  time.Duration
	// begin starts an issuance transaction whose statements wait at most
	// Options.IssueLockWait for a row lock.
	begin string
	// slots is the most batches running at once (IssueCommitters).
	slots int
	// waits is the pool of the claims set aside for a held row (see
	// setAside), apart from pool.
	waits *pgxpool.Pool

	// stop ends every running batch; it is cancelled by close.
	stop   context.Context
	cancel context.CancelFunc
	// wg counts the committer goroutines and the inline batches running.
	wg sync.WaitGroup

	mu sync.Mutex
	// cond wakes the committer goroutines (only they wait on it): it is
	// signalled when a slot frees up with claims queued, and on close.
	cond *sync.Cond
	// queue holds the waiting claims, oldest first.
	queue []*issueReq
	// inflight holds the keys of the claims taken by running batches.
	inflight map[string]struct{}
	// busy is the number of slots taken by running batches, at most slots.
	busy   int
	closed bool
	hooks  issueHooks

	// statements counts the statements run (a claim taken apart around a
	// held row, or run again alone, is in several); claims counts the
	// claims that got their result from a statement (a token or an error),
	// each once.
	statements, claims atomic.Int64
	// setAsides counts the claims set aside for a held row.
	setAsides atomic.Int64
	// leftWaits counts the Issue calls whose caller left after a batch
	// took their claim, and which wait for its outcome (see Issue).
	leftWaits atomic.Int64
}

// newIssuer returns an issuer with the given number of slots, issuing over
// pool, and starts a committer goroutine per slot; close stops them.
func newIssuer(pool, waits *pgxpool.Pool, committers, batchMax int, timeout, lockWait time.Duration) *issuer {
	q := &issuer{
		pool:     pool,
		waits:    waits,
		batchMax: batchMax,
		timeout:  timeout,
		begin:    fmt.Sprintf("BEGIN; SET LOCAL lock_timeout = %d", max(lockWait.Milliseconds(), 1)),
		slots:    committers,
		inflight: make(map[string]struct{}),
	}
	q.cond = sync.NewCond(&q.mu)
	q.stop, q.cancel = context.WithCancel(context.Background())
	q.wg.Add(committers)
	for range committers {
		go q.committer()
	}
	return q
}

// submit queues r. If a slot is free, the calling goroutine takes it and
// runs the next batch (which holds r unless r's key is in flight) before
// returning; either way r's result is then, or will be, on r.done.
func (q *issuer) submit(r *issueReq) error {
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return fmt.Errorf("store: issue token for %q: %w", r.claim.Key, ErrClosed)
	}
	q.queue = append(q.queue, r)
	n, enqueued := len(q.queue), q.hooks.enqueued
	// No signal here: with a slot free, this goroutine takes the batch; with
	// every slot busy, whoever frees one takes the queue or hands it on.
	batch := q.takeLocked()
	if batch != nil {
		q.wg.Add(1) // under q.mu while open: close waits for this batch
	}
	hook := q.hooks.batch
	q.mu.Unlock()
	if enqueued != nil {
		enqueued(r.claim, n)
	}
	if batch == nil {
		return nil
	}
	defer q.wg.Done()
	q.run(batch, hook)
	q.mu.Lock()
	q.release(batch)
	if len(q.queue) > 0 {
		q.cond.Signal() // a committer takes what is left (or finds it in flight)
	}
	q.mu.Unlock()
	return nil
}

// withdraw reports whether a batch took r (its result will come); if none
// did, r is taken out of the queue, if still there, and no batch ever will.
func (q *issuer) withdraw(r *issueReq) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if r.taken {
		return true
	}
	if i := slices.Index(q.queue, r); i >= 0 {
		q.queue = slices.Delete(q.queue, i, i+1)
	}
	return false
}

// close fails every queued claim with ErrClosed, ends the running batches
// (their claims fail) and waits for the committer goroutines and the inline
// batches to return. It may be called more than once.
func (q *issuer) close() {
	q.mu.Lock()
	pending := q.queue
	q.queue = nil
	q.closed = true
	q.cond.Broadcast()
	q.mu.Unlock()
	q.cancel() // before any caller hears of the close: running batches fail from now on
	for _, r := range pending {
		r.done <- issueResult{err: fmt.Errorf("store: issue token for %q: %w", r.claim.Key, ErrClosed)}
	}
	q.wg.Wait()
}

// committer runs batches until close. Having run one, it frees its slot and
// looks at the queue again itself, under the same lock: it needs no wake-up.
func (q *issuer) committer() {
	defer q.wg.Done()
	q.mu.Lock()
	for {
		batch := q.take()
		if batch == nil {
			q.mu.Unlock()
			return
		}
		hook := q.hooks.batch
		q.mu.Unlock()
		q.run(batch, hook)
		q.mu.Lock()
		q.release(batch)
	}
}

// take waits, with q.mu held, until it can take a batch (see takeLocked) and
// returns it, or nil once closed.
func (q *issuer) take() []*issueReq {
	for !q.closed {
		if batch := q.takeLocked(); batch != nil {
			return batch
		}
		q.cond.Wait()
	}
	return nil
}

// takeLocked takes a free slot and removes the next batch from the queue:
// the oldest claims, at most batchMax, one per key and none for a key in
// flight; claims whose caller left are dropped. It returns nil, taking no
// slot, when every slot is busy or no claim can be taken. q.mu is held.
func (q *issuer) takeLocked() []*issueReq {
	if q.busy == q.slots {
		return nil
	}
	var batch []*issueReq
	rest := q.queue[:0] // filtered in place, order kept
	for i, r := range q.queue {
		if len(batch) == q.batchMax {
			rest = append(rest, q.queue[i:]...)
			break
		}
		if r.ctx.Err() != nil {
			continue // its Issue has returned or is returning ctx.Err()
		}
		if _, busy := q.inflight[r.claim.Key]; busy {
			rest = append(rest, r)
			continue
		}
		q.inflight[r.claim.Key] = struct{}{}
		r.taken = true
		batch = append(batch, r)
	}
	clear(q.queue[len(rest):])
	q.queue = rest
	if len(batch) == 0 {
		return nil
	}
	q.busy++
	if len(q.queue) > 0 && q.busy < q.slots {
		// Some may be takeable by another committer (batch full).
		q.cond.Signal()
	}
	return batch
}

// release frees the slot and the keys of a batch that ran, but those of
// claims set aside (their own goroutine frees them). q.mu is held.
func (q *issuer) release(batch []*issueReq) {
	for _, r := range batch {
		if !r.setAside {
			delete(q.inflight, r.claim.Key)
		}
	}
	q.busy--
}

// run issues the tokens of batch and delivers them, but for claims whose
// rows another transaction holds, which it sets aside.
func (q *issuer) run(batch []*issueReq, hook func([]fencing.Claim)) {
	// Every batch locks its rows in the same order, so batches (of this and
	// other processes) cannot deadlock.
	slices.SortFunc(batch, func(a, b *issueReq) int { return strings.Compare(a.claim.Key, b.claim.Key) })
	if hook != nil {
		claims := make([]fencing.Claim, len(batch))
		for i, r := range batch {
			claims[i] = r.claim
		}
		hook(claims)
	}
	ctx, cancel := q.batchContext(batch)
	defer cancel()
	res := q.exec(ctx, batch, true)
	if len(batch) > 1 {
		switch {
		case rowHeld(res[0].err):
			// A row was held past the lock wait; nothing was committed.
			res = q.execAround(ctx, batch)
		case isDataException(res[0].err):
			// Postgres refused one claim's data (a NUL byte, a token past
			// 2^53-1...) and the statement changed nothing. Issue each
			// claim alone so the others do not fail for it.
			res = q.execEach(ctx, batch)
		}
	}
	for i, r := range batch {
		if rowHeld(res[i].err) {
			q.setAside(r)
			continue
		}
		q.deliver(r, res[i])
	}
}

// deliver hands res to r's caller, its error (if any) classified.
func (q *issuer) deliver(r *issueReq, res issueResult) {
	q.claims.Add(1)
	if err := res.err; err != nil {
		if q.stop.Err() != nil {
			err = fmt.Errorf("%w: %w", ErrClosed, err)
		} else {
			err = classify(err)
		}
		res.err = fmt.Errorf("store: issue token for %q: %w", r.claim.Key, err)
	}
	r.done <- res
}

// setAside issues r's token on a goroutine of its own, waiting for its row
// as long as r's deadline allows (no lock timeout), and then frees r's key,
// which stays in flight meanwhile: later claims for it stay queued. It is
// called by the batch that took r, which leaves r's key to it (release).
//
// The wait holds a connection of q.waits, not of q.pool: rows held on many
// keys cannot take the connections of the other keys' batches and of the
// pool's other users. With every one of q.waits taken, r waits for one.
// Unlike a batch, which serves several callers, r's wait ends when its
// caller leaves: nothing is issued then, unless its COMMIT was already on
// its way (the token is then burned, as Issue allows).
func (q *issuer) setAside(r *issueReq) {
	r.setAside = true
	q.setAsides.Add(1)
	q.wg.Add(1) // the batch calling this is counted: close has not returned
	go func() {
		defer q.wg.Done()
		ctx, cancel := q.batchContext([]*issueReq{r})
		stop := context.AfterFunc(r.ctx, cancel)
		res := q.exec(ctx, []*issueReq{r}, false)[0]
		stop()
		cancel()
		if err := r.ctx.Err(); res.err != nil && err != nil {
			// Ended by its caller's end: say which (its deadline, or a
			// cancellation), not the cancellation it caused here.
			res.err = fmt.Errorf("its caller's context ended: %w (%w)", err, res.err)
		}
		q.deliver(r, res)
		q.mu.Lock()
		delete(q.inflight, r.claim.Key)
		if len(q.queue) > 0 {
			q.cond.Signal() // a committer takes the claims queued behind it
		}
		q.mu.Unlock()
	}()
}

// rowHeld reports whether err is an issuance statement's lock wait running
// out (lock_timeout: SQLSTATE 55P03), or errRowHeld: a row was held by
// another transaction, and nothing was issued.
func rowHeld(err error) bool {
	var pe *pgconn.PgError
	return errors.Is(err, errRowHeld) || errors.As(err, &pe) && pe.Code == "55P03"
}

// errRowHeld is the result execAround gives a claim whose row another
// transaction holds.
var errRowHeld = errors.New("its key's row is held by another transaction")

// execEach issues each claim of batch in a statement of its own.
func (q *issuer) execEach(ctx context.Context, batch []*issueReq) []issueResult {
	res := make([]issueResult, len(batch))
	for i, r := range batch {
		res[i] = q.exec(ctx, []*issueReq{r}, true)[0]
	}
	return res
}

// isDataException reports whether Postgres refused a statement for its data
// (SQLSTATE class 22, as classify tells ErrInvalidData).
func isDataException(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && (strings.HasPrefix(pe.Code, "22") || pe.ConstraintName == tokenMaxConstraint)
}

// lockFreeSQL locks the rows of the keys $1 that no other transaction
// holds, waiting for none; existingSQL, run after it in the same
// transaction, names the keys that have a row. Those with a row this
// transaction did not lock are held by another (or were created since).
const (
	lockFreeSQL = `SELECT key FROM redfence_fencing WHERE key = ANY($1::text[]) ORDER BY key FOR UPDATE SKIP LOCKED`
	existingSQL = `SELECT key FROM redfence_fencing WHERE key = ANY($1::text[])`
)

// execAround runs batch (keys distinct and sorted) again after its
// statement's lock wait ran out: in one transaction, it locks the rows no
// other transaction holds and issues their claims (and those of keys
// without a row), and gives each claim whose row is held errRowHeld, with
// nothing issued for it. Results come, as from exec, once the COMMIT
// answered. A claim whose key has no row yet may still meet another
// transaction creating it; the lock wait then runs out again, and every
// claim left gets that error (see rowHeld).
func (q *issuer) execAround(ctx context.Context, batch []*issueReq) []issueResult {
	keys := make([]string, len(batch))
	for i, r := range batch {
		keys[i] = r.claim.Key
	}
	res := make([]issueResult, len(batch))
	var free []*issueReq
	held := make(map[string]bool, len(batch))
	got := make(map[string]int64, len(batch))
	err := retryPooled(q.pool, func() error {
		free = free[:0]
		clear(held)
		clear(got) // rows of an attempt that failed were never committed
		conn, err := q.pool.Acquire(ctx)
		if err != nil {
			return err
		}
		defer conn.Release()
		if _, err := conn.Exec(ctx, q.begin); err != nil {
			return err
		}
		now := time.Now() // after BEGIN answered, as in issueTx
		b := &pgx.Batch{}
		b.Queue(lockFreeSQL, keys)
		b.Queue(existingSQL, keys)
		br := conn.SendBatch(ctx, b)
		locked := make(map[string]bool, len(batch))
		for _, mark := range []func(string){
			func(k string) { locked[k] = true },
			func(k string) { held[k] = !locked[k] },
		} {
			rows, err := br.Query()
			if err == nil {
				var k string
				_, err = pgx.ForEachRow(rows, []any{&k}, func() error {
					mark(k)
					return nil
				})
			}
			if err != nil {
				_ = br.Close()
				return err
			}
		}
		if err := br.Close(); err != nil {
			return err
		}
		for _, r := range batch {
			if !held[r.claim.Key] {
				free = append(free, r)
			}
		}
		if len(free) == 0 {
			_, err := conn.Exec(ctx, "COMMIT")
			return err
		}
		q.statements.Add(1)
		return issueCommit(ctx, conn, issueBatchSQL, batchArgs(ctx, free, now), scanTokens(got))
	})
	if err != nil && len(free) > 1 && isDataException(err) {
		// As in run: one claim's data was refused, and nothing changed.
		each := q.execEach(ctx, free)
		for i, r := range batch {
			if held[r.claim.Key] {
				res[i].err = errRowHeld
				continue
			}
			j := slices.Index(free, r)
			res[i] = each[j]
		}
		return res
	}
	for i, r := range batch {
		if held[r.claim.Key] {
			res[i].err = errRowHeld
		} else {
			res[i] = batchResult(got, r.claim.Key, err)
		}
	}
	return res
}

// batchContext bounds a batch by the latest deadline of its callers, but
// never beyond the issue timeout (which also bounds callers without one).
// No caller's cancellation ends it; close does.
func (q *issuer) batchContext(batch []*issueReq) (context.Context, context.CancelFunc) {
	deadline := time.Now().Add(q.timeout)
	var latest time.Time
	for _, r := range batch {
		d, ok := r.ctx.Deadline()
		if !ok {
			latest = deadline
			break
		}
		if d.After(latest) {
			latest = d
		}
	}
	if latest.After(deadline) {
		latest = deadline
	}
	return context.WithDeadline(q.stop, latest)
}

// exec runs one statement for batch (keys distinct and sorted) and returns
// each claim's result, unwrapped. Results are returned only after the
// COMMIT answered (see issueTx). ctx is the batch's (see
// batchContext); each claim's own deadline bounds its row on the server (see
// issueSQL), so a claim whose caller left is not issued after its row waited
// past the caller's deadline, whatever the other claims' deadlines. With
// limited, the statement waits at most Options.IssueLockWait for a row (see
// rowHeld); otherwise as long as ctx and the claims' budgets allow, on a
// connection of q.waits (see setAside).
func (q *issuer) exec(ctx context.Context, batch []*issueReq, limited bool) []issueResult {
	begin, pool, commit := q.begin, q.pool, issueCommit
	if !limited {
		begin, pool, commit = "BEGIN", q.waits, issueThenCommit
	}
	q.statements.Add(1)
	res := make([]issueResult, len(batch))
	if len(batch) == 1 {
		c := batch[0].claim
		var t int64
		found := false
		err := retryPooled(pool, func() error {
			found = false
			return issueTx(ctx, pool, begin, commit, issueSQL, func(now time.Time) []any {
				return []any{c.Key, c.Owner, c.Holder, budget(ctx, batch[0], now)}
			}, func(rows pgx.Rows) error {
				_, err := pgx.ForEachRow(rows, []any{&t}, func() error {
					found = true
					return nil
				})
				return err
			})
		})
		if err == nil && !found {
			err = errLate
		}
		res[0] = issueResult{tok: fencing.Token(t), err: err}
		return res
	}
	got := make(map[string]int64, len(batch))
	err := retryPooled(pool, func() error {
		clear(got) // rows of an attempt that failed were never committed
		return issueTx(ctx, pool, begin, commit, issueBatchSQL, func(now time.Time) []any {
			return batchArgs(ctx, batch, now)
		}, scanTokens(got))
	})
	for i, r := range batch {
		res[i] = batchResult(got, r.claim.Key, err)
	}
	return res
}

// batchResult is the result of key's claim in a batch statement that gave
// got (the tokens by key) and err: err if it failed, else its token, or
// errLate if no row came back for it.
func batchResult(got map[string]int64, key string, err error) issueResult {
	t, ok := got[key]
	switch {
	case err != nil:
		return issueResult{err: err}
	case !ok:
		return issueResult{err: errLate}
	}
	return issueResult{tok: fencing.Token(t)}
}

// issueTx runs one issuance statement in a transaction of its own, on a
// connection of pool: begin (BEGIN and maybe a SET LOCAL), answered before args reads the time the
// budgets count from, so that the transaction's timestamp, from which
// Postgres counts them, comes before it, however long the statement then
// takes to arrive, be parsed (a table lock) or get its rows; then the
// statement, whose rows scan reads, and the COMMIT, sent by commit
// (issueCommit or issueThenCommit). The results count only once it returns
// nil: the COMMIT was durable. A connection left in a transaction (failed,
// or not committed) is closed by the pool, which rolls it back.
func issueTx(ctx context.Context, pool *pgxpool.Pool, begin string, commit commitFunc, sql string, args func(now time.Time) []any, scan func(pgx.Rows) error) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, begin); err != nil {
		return err
	}
	return commit(ctx, conn, sql, args(time.Now()), scan)
}

// commitFunc sends, in the transaction open on conn, the statement sql with
// args, whose rows scan reads, and the COMMIT; it returns nil once the
// COMMIT answered.
type commitFunc func(ctx context.Context, conn *pgxpool.Conn, sql string, args []any, scan func(pgx.Rows) error) error

// issueCommit sends, in the transaction open on conn, the statement sql
// with args, whose rows scan reads, and the COMMIT, together; it returns
// nil once the COMMIT answered.
func issueCommit(ctx context.Context, conn *pgxpool.Conn, sql string, args []any, scan func(pgx.Rows) error) error {
	b := &pgx.Batch{}
	b.Queue(sql, args...)
	b.Queue("COMMIT")
	br := conn.SendBatch(ctx, b)
	rows, err := br.Query()
	if err == nil {
		err = scan(rows)
	}
	if err == nil {
		_, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return err
}

// issueThenCommit is issueCommit for a claim set aside (see setAside): it
// sends the statement alone, and the COMMIT only once the statement
// answered, and only if ctx has not ended by then (the claim's caller
// left). Its statement may wait long for its row: sent with it, the COMMIT
// would already be at the server when the caller leaves, and only the
// cancel request pgx sends as it gives the connection up (best effort, in
// the background) would keep the token from being issued for nobody once
// the row is free. Without its COMMIT, the transaction is rolled back when
// the connection closes. It costs a round trip, on this path only.
func issueThenCommit(ctx context.Context, conn *pgxpool.Conn, sql string, args []any, scan func(pgx.Rows) error) error {
	rows, err := conn.Query(ctx, sql, args...)
	if err != nil {
		return err
	}
	if err := scan(rows); err != nil { // scan closes rows
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	_, err = conn.Exec(ctx, "COMMIT")
	return err
}

// batchArgs are issueBatchSQL's arguments for batch (keys distinct and
// sorted), each claim's budget counted from now.
func batchArgs(ctx context.Context, batch []*issueReq, now time.Time) []any {
	keys := make([]string, len(batch))
	owners := make([]string, len(batch))
	holders := make([]string, len(batch))
	budgets := make([]int64, len(batch))
	for i, r := range batch {
		keys[i], owners[i], holders[i] = r.claim.Key, r.claim.Owner, r.claim.Holder
		budgets[i] = budget(ctx, r, now)
	}
	return []any{keys, owners, holders, budgets}
}

// scanTokens reads issueBatchSQL's rows into got, the tokens by key.
func scanTokens(got map[string]int64) func(pgx.Rows) error {
	return func(rows pgx.Rows) error {
		var k string
		var t int64
		_, err := pgx.ForEachRow(rows, []any{&k, &t}, func() error {
			got[k] = t
			return nil
		})
		return err
	}
}

// budget is how long r's row may be waited for, in microseconds from now:
// until its caller's deadline, or the batch's (ctx) for a caller without
// one; 0 once it has passed.
func budget(ctx context.Context, r *issueReq, now time.Time) int64 {
	d, ok := r.ctx.Deadline()
	if !ok {
		d, _ = ctx.Deadline() // batchContext always sets one
	}
	return max(d.Sub(now).Microseconds(), 0)
}
