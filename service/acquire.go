// Acquire: the waiting loop and its wake-ups, one try (a quorum round, then
// issuance), and the undoing of a try that failed.

package service

import (
	"context"
	"crypto/sha1" //nolint:gosec // matches Redis' sha1hex; not a security use
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/keyspace"
)

// Request asks for a lock.
type Request struct {
	// TTL is the lease length, within [MinTTL, MaxTTL].
	TTL time.Duration
	// Wait is how long to keep trying while the lock is held or no quorum is
	// reachable; 0 tries once.
	Wait time.Duration
	// Owner is a free-form label recorded with the grant (not a secret).
	Owner string
	// Continue, if set, is called before every try after the first: a
	// non-nil error ends the acquire with that error (wrapped), nothing
	// granted. The API checks there that the caller's key is still valid,
	// so a key revoked during a long wait gets nothing afterwards.
	Continue func(ctx context.Context) error
	// Stop, if set, ends the wait of a blocking acquire when it is closed
	// (a server closes it as it shuts down): a try under way finishes, and
	// instead of waiting for the next one Acquire returns an error matching
	// ErrWaitStopped and the last try's reason (usually ErrHeld).
	Stop <-chan struct{}
}

// Grant is a held lock.
type Grant struct {
	// Key is the lock's storage key.
	Key string
	// Token is the lock token: the holder's secret, needed to extend and release.
	Token string
	// Fencing is the grant's fencing token.
	Fencing fencing.Token
	// TTL is the lease length requested.
	TTL time.Duration
	// Start is when the winning round began (monotonic).
	Start time.Time
	// Expires is when the lease ends at the latest, allowing for drift:
	// Start + TTL - drift.
	Expires time.Time
	// Owner is the label given at acquire.
	Owner string
	// DriftFactor is the clock-drift allowance Expires makes over the TTL
	// (Options.DriftFactor).
	DriftFactor float64
}

// Validity returns how much of the lease is left at now.
func (g *Grant) Validity(now time.Time) time.Duration { return g.Expires.Sub(now) }

// ValidityFrom returns how much of the lease a client may count from t, an
// instant before the winning round began (when its request arrived, say):
// the time from t to Expires, less the drift allowance on the part before
// Start. Expires allows for drift over the TTL only; with this, a client
// whose clock runs slow by up to DriftFactor still stops in time when it
// counts from any instant before t, however long it waited.
func (g *Grant) ValidityFrom(t time.Time) time.Duration {
	d := g.Expires.Sub(t)
	if w := g.Start.Sub(t); w > 0 {
		d -= time.Duration(math.Ceil(float64(w) * g.DriftFactor))
	}
	return d
}

// HolderID returns the non-secret digest of a lock token that is recorded
// with its fencing token.
func HolderID(token string) string {
	sum := sha256.Sum256([]byte(token))
	return hex.EncodeToString(sum[:16])
}

func (l *Locker) drift(ttl time.Duration) time.Duration {
	return time.Duration(float64(ttl)*l.opts.DriftFactor) + 2*time.Millisecond
}

// CheckTTL returns an error matching ErrInvalid when ttl is out of bounds.
func (l *Locker) CheckTTL(ttl time.Duration) error {
	if ttl < l.opts.MinTTL || ttl > l.opts.MaxTTL {
		return &InvalidError{Field: "ttl", Reason: fmt.Sprintf("%v is outside [%v, %v]", ttl, l.opts.MinTTL, l.opts.MaxTTL)}
	}
	return nil
}

func (l *Locker) newToken() (string, error) {
	var b [20]byte
	if _, err := io.ReadFull(l.opts.TokenSource, b[:]); err != nil {
		return "", fmt.Errorf("service: lock token: %w", err)
	}
	return base64.RawURLEncoding.EncodeToString(b[:]), nil
}

// Acquire takes the lock on key (see keyspace.Key). It tries once, and keeps
// trying after a jittered delay while the lock is held or no quorum answers,
// until req.Wait has passed. Waiters for one key in this process get it in
// arrival order: only the first of them tries, and a release here wakes it at
// once. A cancelled ctx ends the wait at once with an error matching
// ctx.Err().
func (l *Locker) Acquire(ctx context.Context, key string, req Request) (*Grant, error) {
	if err := l.CheckTTL(req.TTL); err != nil {
		return nil, err
	}
	if req.Wait < 0 || req.Wait > l.opts.MaxWait {
		return nil, &InvalidError{Field: "wait", Reason: fmt.Sprintf("%v is outside [0, %v]", req.Wait, l.opts.MaxWait)}
	}
	deadline := l.opts.Now().Add(req.Wait)
	var w *waiter
	granted, refreshed := false, false
	// heldUntil is when the lease a try of this acquire last found held
	// ends (zero: none found held).
	var heldUntil time.Time
	// backWoken: the last pause ended because a majority answered again.
	backWoken := false
	defer func() {
		if w != nil {
			l.leave(key, w, granted)
		}
	}()
	for first := true; ; first = false {
		behind := false
		if w == nil && req.Wait > 0 {
			// Queued before the first try, so a release during it wakes us.
			w = l.enqueue(key)
		}
		if !first && req.Continue != nil {
			if err := req.Continue(ctx); err != nil {
				return nil, fmt.Errorf("acquire %q: %w", key, err)
			}
		}
		var aerr *Error
		if w != nil && !l.first(key, w) {
			// Behind another waiter: it tries, and the lock is ours after
			// it. A try of ours could take it first. Until then we report
			// what its last try found.
			aerr = l.lastRefusal(key)
			behind = true
		} else {
			// A caller gone already (before the first try, or during the
			// wait) gets no round: its SETs would hold the name, for
			// nobody, until the clean-up after the quorum.
			if err := ctx.Err(); err != nil {
				return nil, fmt.Errorf("acquire %q: %w", key, err)
			}
			// A fresh lock token per try: a node that refuses a try holds
			// somebody else's token, never one of ours, so the clean-up
			// after a failed try can skip the nodes that said no.
			token, err := l.newToken()
			if err != nil {
				return nil, err
			}
			var g *Grant
			g, aerr = l.try(ctx, key, token, req)
			if aerr != nil && !refreshed && ctx.Err() == nil && l.refreshed(ctx, aerr, req, deadline) {
				// Nodes this server had not known restarted count again:
				// once, the refusal was this server's news, not the nodes'.
				refreshed = true
				if token, err = l.newToken(); err != nil {
					return nil, err
				}
				g, aerr = l.try(ctx, key, token, req)
			}
			if aerr == nil {
				granted = true
				if w != nil {
					// Those behind now wait for this grant.
					l.noteRefusal(key, &Error{Op: "acquire", Key: key, Err: ErrHeld, RetryAfter: g.TTL})
				}
				return g, nil
			}
			if err := ctx.Err(); err != nil {
				return nil, fmt.Errorf("acquire %q: %w", key, err)
			}
			if errors.Is(aerr, ErrInvalid) {
				return nil, aerr
			}
			if w != nil {
				l.noteRefusal(key, aerr)
			}
			if errors.Is(aerr, ErrHeld) && aerr.RetryAfter > 0 {
				heldUntil = l.opts.Now().Add(aerr.RetryAfter)
			}
		}
		left := deadline.Sub(l.opts.Now())
		if left <= 0 {
			if req.Wait == 0 {
				return nil, aerr
			}
			return nil, &Error{Op: "acquire", Key: key, Err: ErrWaitTimeout, Nodes: aerr.Nodes, RetryAfter: aerr.RetryAfter, Cause: aerr}
		}
		delay := l.jitter(aerr)
		var back <-chan struct{}
		switch held := heldUntil.Sub(l.opts.Now()); {
		case behind:
			// Not the first waiter's retry delay: a waiter behind it
			// makes no try, and is woken when it becomes first (see
			// leave, wake). Meanwhile it only checks its caller
			// (Continue) and its deadline, so thousands of waiters on
			// one name cost no wake-ups per retry of the first while too
			// few nodes answer, nor while the first's try runs once the
			// lease it found has ended. As while the lock is held, it
			// looks once a second at most, which bounds a turn that came
			// unwoken (the first waiter granted, its lock then freed
			// unannounced); sooner only at the end of a lease the first
			// waiter found still running.
			d := max(heldRetryMax, l.opts.RetryDelayMax)
			if errors.Is(aerr, ErrHeld) && aerr.RetryAfter > l.opts.RetryDelayMin {
				d = min(d, delay)
			}
			delay = d
		case errors.Is(aerr, ErrQuorum) && held > 0:
			// Too few nodes answered, but a try of ours found the lock
			// held until then: that news is not stale (a release wakes
			// us), so it waits as while the lock is held rather than
			// the short retry delay. Otherwise, when the nodes fall
			// behind for a moment, every waiter for a held name would
			// retry 10-100 times a second, keep them behind, and never
			// let them catch up.
			delay = l.jitter(&Error{Op: "acquire", Key: key, Err: ErrHeld, RetryAfter: held})
		case errors.Is(aerr, ErrQuorum) && l.majorityBack() != nil:
			// Fewer nodes than a majority answer: a try now can only
			// time out on them, and thousands of waiting names trying
			// 10-100 times a second each would bury the server in tries
			// and their clean-ups. It tries about once a second, spread,
			// and sooner once the answers of a request (any round on this
			// server) show a majority back (unless it was woken so last
			// time: a majority that comes and goes at the request rate
			// must not wake it each time).
			delay = max(delay, l.outageDelay())
			if !backWoken {
				back = l.majorityBack()
			}
		case errors.Is(aerr, ErrQuorum) && aerr.RetryAfter > 0, errors.Is(aerr, ErrFencing):
			// Nodes quarantined (until RetryAfter), or no token could be
			// issued (Postgres down or slow): each try would take the
			// name on the nodes and clean up after itself for nothing, so
			// it tries about once a second (at the quarantine's end if
			// sooner).
			d := l.outageDelay()
			if aerr.RetryAfter > 0 {
				d = min(d, aerr.RetryAfter+l.opts.RetryDelayMin)
			}
			delay = max(delay, d)
		}
		delay = min(delay, left)
		var wake <-chan struct{}
		if w != nil {
			wake = w.wake
		}
		why, err := l.pause(ctx, delay, wake, back, req.Stop)
		if err != nil {
			return nil, fmt.Errorf("acquire %q: %w", key, err)
		}
		backWoken = why == pausedBack
		if why == pausedWake {
			// A release (or our turn): the lease a try found is over.
			heldUntil = time.Time{}
		}
		if why == pausedStop {
			return nil, &Error{Op: "acquire", Key: key, Err: ErrWaitStopped, Nodes: aerr.Nodes, RetryAfter: aerr.RetryAfter, Cause: aerr}
		}
	}
}

// outageDelay is how long a try waits while fewer nodes than a majority
// answer (unless they answer again sooner): a random delay in
// [heldRetryMax/2, heldRetryMax), or RetryDelayMax if that is longer.
func (l *Locker) outageDelay() time.Duration {
	l.randMu.Lock()
	d := heldRetryMax/2 + time.Duration(l.rand.Int64N(int64(heldRetryMax/2)))
	l.randMu.Unlock()
	return max(d, l.opts.RetryDelayMax)
}

// pauseEnd says what ended a pause.
type pauseEnd int

const (
	pausedTimer pauseEnd = iota // the delay passed
	pausedWake                  // wake: a release, or the waiter's turn
	pausedBack                  // back: a majority of nodes answers again
	pausedStop                  // stop
)

// backSpread is the window over which the waiters woken by a majority
// answering again (see pause) make their tries.
const backSpread = 100 * time.Millisecond

// pause waits for d, a wake-up (wake or back), stop or the end of ctx,
// counted as waiting, and says which ended it. A wake-up by back is spread
// over backSpread (every waiter of the outage gets it at once), during which
// a wake, stop or ctx still ends the pause.
func (l *Locker) pause(ctx context.Context, d time.Duration, wake, back, stop <-chan struct{}) (pauseEnd, error) {
	select {
	case <-stop: // closed before the wait: no timer, no waiting counted
		return pausedStop, nil
	default:
	}
	l.opts.Observer.Waiting(1)
	defer l.opts.Observer.Waiting(-1)
	until := time.Now().Add(d)
	timer := time.NewTimer(d)
	defer timer.Stop()
	end := pausedTimer
	for {
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-stop:
			return pausedStop, nil
		case <-wake:
			return pausedWake, nil
		case <-back:
			back, end = nil, pausedBack
			l.randMu.Lock()
			spread := time.Duration(l.rand.Int64N(int64(backSpread)))
			l.randMu.Unlock()
			timer.Reset(min(time.Until(until), spread))
			continue
		case <-timer.C:
		}
		return end, nil
	}
}

// jitter returns a random delay in [RetryDelayMin, RetryDelayMax), shortened
// to just past the holder's remaining TTL when that comes sooner.
func (l *Locker) jitter(aerr *Error) time.Duration {
	lo, hi := l.opts.RetryDelayMin, l.opts.RetryDelayMax
	l.randMu.Lock()
	d := lo
	if hi > lo {
		d += time.Duration(l.rand.Int64N(int64(hi - lo)))
	}
	small := time.Duration(l.rand.Int64N(int64(lo) + 1))
	l.randMu.Unlock()
	if aerr.RetryAfter > 0 && aerr.RetryAfter+small < d {
		d = aerr.RetryAfter + small
	}
	if errors.Is(aerr, ErrHeld) && len(l.watchers) == len(l.nodes) && aerr.RetryAfter > d {
		// Held, and every node announces releases: a release wakes the
		// waiter (here at once, from another server by Pub/Sub), so it
		// need not poll the nodes while the holder's lease runs. It tries
		// again just after that lease ends, or after heldRetryMax at most,
		// which bounds the cost of a lost announcement.
		d = min(aerr.RetryAfter+small, max(heldRetryMax, l.opts.RetryDelayMax))
	}
	return d
}

// heldRetryMax is the longest a waiter for a held lock waits between
// tries when releases are announced (see jitter).
const heldRetryMax = time.Second

// waiter is one blocked acquire in a key's queue.
type waiter struct {
	// wake holds at most one pending wake-up.
	wake chan struct{}
}

// waitQueue is a key's waiters in arrival order.
type waitQueue struct {
	q []*waiter
	// last is why the last try of one of them failed (that the lock is
	// held, once one of them got it), and lastAt when: what the waiters
	// behind the first report when their wait ends.
	last   *Error
	lastAt time.Time
	// released is the digest of the last release that woke the queue, and
	// releasedBy how many nodes made it, as far as this process knows (see
	// wake).
	released   string
	releasedBy int
}

// enqueue adds a waiter for key at the back of its queue. The first waiter
// for a key starts watching its releases on the nodes that announce them.
func (l *Locker) enqueue(key string) *waiter {
	w := &waiter{wake: make(chan struct{}, 1)}
	l.waitMu.Lock()
	wq := l.waiters[key]
	if wq == nil {
		wq = &waitQueue{}
		l.waiters[key] = wq
		l.watch(key, true)
	}
	wq.q = append(wq.q, w)
	l.waitMu.Unlock()
	return w
}

func (l *Locker) watch(key string, on bool) {
	if len(l.watchers) == 0 {
		return
	}
	rkey := keyspace.RedisKey(key)
	for _, w := range l.watchers {
		w.WatchReleases(rkey, on)
	}
}

// leave removes w from key's queue. When the first waiter leaves without the
// lock, the next one is woken to try at once: the lock may be free.
func (l *Locker) leave(key string, w *waiter, granted bool) {
	l.waitMu.Lock()
	defer l.waitMu.Unlock()
	wq := l.waiters[key]
	if wq == nil {
		return
	}
	i := slices.Index(wq.q, w)
	if i < 0 {
		return
	}
	wq.q = slices.Delete(wq.q, i, i+1)
	if len(wq.q) == 0 {
		delete(l.waiters, key)
		l.watch(key, false)
		return
	}
	if i == 0 && !granted {
		signal(wq.q[0])
	}
}

// first reports whether w is the first of key's waiters: the one that tries.
func (l *Locker) first(key string, w *waiter) bool {
	l.waitMu.Lock()
	defer l.waitMu.Unlock()
	wq := l.waiters[key]
	return wq != nil && len(wq.q) > 0 && wq.q[0] == w
}

// noteRefusal records why a waiter's try for key failed.
func (l *Locker) noteRefusal(key string, aerr *Error) {
	now := l.opts.Now()
	l.waitMu.Lock()
	defer l.waitMu.Unlock()
	if wq := l.waiters[key]; wq != nil {
		wq.last, wq.lastAt = aerr, now
	}
}

// lastRefusal returns why the last try of key's waiters failed (its
// RetryAfter counted down since) or, before any did, that the lock is held
// (by the waiter ahead, as far as we know).
func (l *Locker) lastRefusal(key string) *Error {
	now := l.opts.Now()
	l.waitMu.Lock()
	defer l.waitMu.Unlock()
	wq := l.waiters[key]
	if wq == nil || wq.last == nil {
		return &Error{Op: "acquire", Key: key, Err: ErrHeld}
	}
	e := *wq.last
	if e.RetryAfter > 0 {
		e.RetryAfter = max(e.RetryAfter-now.Sub(wq.lastAt), time.Millisecond)
	}
	return &e
}

// wake wakes the first waiter for key in this process, if any, for the
// release of the lock token whose digest is digest, which nodes more nodes
// have made (a release of this process: a majority at once; an
// announcement: one). A release wakes it twice at most: at its first news,
// and again once a majority made it, in case the try the first news began
// found the other nodes not released yet (an announcement can overtake the
// deletes of other nodes). Further news of it wakes nobody.
func (l *Locker) wake(key, digest string, nodes int) {
	l.waitMu.Lock()
	defer l.waitMu.Unlock()
	wq := l.waiters[key]
	if wq == nil || len(wq.q) == 0 {
		return
	}
	if wq.released != digest {
		wq.released, wq.releasedBy = digest, nodes
		signal(wq.q[0])
		return
	}
	before := wq.releasedBy
	wq.releasedBy += nodes
	if before < l.quorum && wq.releasedBy >= l.quorum {
		signal(wq.q[0])
	}
}

// announced is called by the nodes that announce releases.
func (l *Locker) announced(rkey, digest string) {
	l.wake(strings.TrimPrefix(rkey, keyspace.RedisPrefix), digest, 1)
}

// releaseDigest is the digest a node announces a release of token with.
func releaseDigest(token string) string {
	sum := sha1.Sum([]byte(token))
	return hex.EncodeToString(sum[:])
}

func signal(w *waiter) {
	select {
	case w.wake <- struct{}{}:
	default: // one is pending already
	}
}

// try runs one Redlock round plus issuance.
func (l *Locker) try(ctx context.Context, key, token string, req Request) (*Grant, *Error) {
	l.tries.Add(1)
	defer l.tries.Add(-1)
	// The lease runs from start, so the heartbeat is checked after it is
	// read: checked first, a pause of this server in between (a stopped
	// process, a stalled VM) could start a lease long after the check,
	// when the registry may no longer count this server (and a server of
	// another node list may grant beside it).
	start := l.opts.Now()
	if err := l.heartbeatStale(); err != nil {
		return nil, &Error{Op: "acquire", Key: key, Err: ErrFencing, Cause: err}
	}
	rkey := keyspace.RedisKey(key)
	expires := start.Add(req.TTL - l.drift(req.TTL))
	claim := fencing.Claim{Key: key, Owner: req.Owner, Holder: HolderID(token)}
	// Sent first: the commit takes longer than the round.
	spec := l.speculate(ctx, claim, req.Wait > 0)

	// Every node's answer is noted until the decision; on failure the
	// decision deletes what the nodes that answered may have set, and nodes
	// answering later delete theirs (see lateRound). The round runs on a
	// context the client cannot cancel (each call is still bounded by
	// NodeTimeout): a straggler's SET completes even after the grant was
	// returned, so the lock lives on as many nodes as possible.
	lr := &lateRound{rkey: rkey, left: len(l.nodes)}
	args := acquireArgs(rkey, token, req.TTL)
	var wg *sync.WaitGroup
	votes, wg := l.round(context.WithoutCancel(ctx), "acquire", nodeOp{
		sync: func(ctx context.Context, i int, n Node) (bool, time.Duration, error) {
			epoch, _ := l.members[i].state()
			ok, rem, err := n.Acquire(ctx, rkey, token, req.TTL, epoch)
			l.noteLoss(i, epoch, err)
			return ok, rem, err
		},
		async: func(ctx context.Context, i int, n asyncNode, done func(bool, time.Duration, error)) {
			epoch, _ := l.members[i].state()
			n.acquireAsync(ctx, args, epoch, func(ok bool, rem time.Duration, err error) {
				l.noteLoss(i, epoch, err)
				done(ok, rem, err)
			})
		},
	}, func(i int, wrote, unsure bool) {
		lr.mu.Lock()
		lr.left--
		if !lr.decided {
			if wrote {
				lr.wrote = append(lr.wrote, wroteNode{i, unsure})
			}
			lr.mu.Unlock()
			return
		}
		// A node that refused holds another try's token (tokens are per
		// try), so deleting ours there would change nothing.
		undo := wrote && (lr.failed || lr.released)
		last := lr.left == 0 && lr.tracked
		lr.mu.Unlock()
		if undo {
			l.undo(ctx, wg, i, rkey, token, unsure)
		}
		if last {
			l.lateMu.Lock()
			delete(l.late, token)
			l.lateMu.Unlock()
		}
	}, l.decided)
	t := l.collect(votes)

	// decide ends the round's waiting: on failure it deletes what the nodes
	// that answered may have set (counted in undos); on success it leaves
	// the stragglers tracked for Release.
	var undos sync.WaitGroup
	decide := func(failed bool) {
		lr.mu.Lock()
		lr.decided, lr.failed = true, failed
		wrote := lr.wrote
		lr.wrote = nil
		if !failed && lr.left > 0 {
			lr.tracked = true
			l.lateMu.Lock()
			l.late[token] = lr
			l.lateMu.Unlock()
		}
		lr.mu.Unlock()
		if failed {
			for _, w := range wrote {
				l.undo(ctx, &undos, w.i, rkey, token, w.unsure)
			}
		}
	}

	fail := func(sentinel error, cause error) *Error {
		decide(true)
		if spec != nil {
			spec.abandon(ctx)
		}
		if sentinel == nil && l.refused(t) {
			// Held: the answers in decide it, and slow nodes are not
			// waited for (each deletes what it set when it answers, see
			// lateRound); those that said yes have deleted it. The nodes
			// still to answer are reported pending. (A waiting acquire's
			// next try may find this try's key on such a node until its
			// delete lands there, and get a no from it: liveness only.)
			undos.Wait()
			l.drainReady(t, votes)
			for i := range t.results {
				if t.results[i].Addr == "" {
					t.results[i].Addr = l.nodes[i].Addr()
				}
			}
			return &Error{Op: "acquire", Key: key, Err: ErrHeld, Nodes: t.results, RetryAfter: l.retryAfter(t)}
		}
		undos.Wait()
		wg.Wait() // every node answered and deleted what it set
		l.drain(t, votes)
		var retry time.Duration
		if sentinel == nil { // no quorum: decide why on every node's answer
			if l.refused(t) {
				sentinel, retry = ErrHeld, l.retryAfter(t)
			} else {
				sentinel, cause, retry = ErrQuorum, nodeErrors(t.results), l.quarantineRetryAfter(t)
			}
		}
		return &Error{Op: "acquire", Key: key, Err: sentinel, Nodes: t.results, Cause: cause, RetryAfter: retry}
	}

	if t.yes < l.quorum {
		return nil, fail(nil, nil)
	}
	if err := ctx.Err(); err != nil {
		return nil, fail(ErrQuorum, err)
	}
	if !l.opts.Now().Before(expires) {
		return nil, fail(ErrExpired, nil)
	}
	if l.opts.AfterQuorum != nil {
		l.opts.AfterQuorum(ctx, key)
	}
	if err := ctx.Err(); err != nil {
		// The caller left before issuance: nothing is issued, and a
		// speculative token stays unused (fail), as on every other path
		// that refuses before the token is confirmed.
		return nil, fail(ErrQuorum, err)
	}
	if !l.opts.Now().Before(expires) {
		// Stalled past the lease (a pause, a slow speculation): a token
		// issued now would be newer than a grant made meanwhile, and fence
		// that live holder out for nothing.
		return nil, fail(ErrExpired, nil)
	}
	// Bounded by the lease too: a claim still queued when the lease ends is
	// dropped unissued, and the store issues nothing for one whose row it
	// reaches after that deadline. Committed later, its token would be
	// newer than that of a grant made after the lease, and fence that live
	// holder out.
	ictx, cancel := context.WithTimeout(ctx, min(l.opts.IssueTimeout, expires.Sub(l.opts.Now())))
	ft, err := l.issue(ictx, claim, spec, expires)
	spec = nil // confirmed or not, it is over
	cancel()
	if errors.Is(err, errLeaseOver) || err != nil && ctx.Err() == nil && !l.opts.Now().Before(expires) {
		return nil, fail(ErrExpired, nil)
	}
	if err != nil {
		if ctx.Err() != nil {
			err = errors.Join(err, ctx.Err())
		}
		return nil, fail(ErrFencing, err)
	}
	if err := ctx.Err(); err != nil {
		// The caller left during issuance (an inline batch does not
		// stop for it): nobody would learn the lock token, and the name
		// would stay held for the whole TTL. The token is spent.
		return nil, fail(ErrQuorum, err)
	}
	if !l.opts.Now().Before(expires) {
		return nil, fail(ErrExpired, nil)
	}
	decide(false)
	l.remember(key, recentGrant{lock: token, fencing: ft})
	return &Grant{Key: key, Token: token, Fencing: ft, TTL: req.TTL, Start: start, Expires: expires, Owner: req.Owner, DriftFactor: l.opts.DriftFactor}, nil
}

// undo deletes token's key on node i in the background, counted in wg,
// within the per-node timeout. It does not block. unsure says node i gave
// no answer to the SET: unless this delete removes the key, the SET may
// still land after it, so the sweeper deletes again until that is ruled
// out; so it does when this delete gets no answer. The delete on a node
// that gave no answer is not counted in wg: the node may be frozen, and the
// refusal waiting for it would take another node timeout for a delete the
// sweeper makes sure of anyway.
func (l *Locker) undo(ctx context.Context, wg *sync.WaitGroup, i int, rkey, token string, unsure bool) {
	cctx, cancel := l.cleanupContext(ctx)
	if unsure {
		wg = nil
	} else {
		wg.Add(1)
	}
	done := func(ok bool, err error) {
		cancel()
		if !ok && (unsure || err != nil) {
			l.sweep.add(i, rkey, token)
		}
		if wg != nil {
			wg.Done()
		}
	}
	if an, ok := l.nodes[i].(asyncNode); ok && an.async() {
		an.releaseAsync(cctx, withdrawArgs(rkey, token), done)
		return
	}
	go func() { done(withdraw(cctx, l.nodes[i], rkey, token)) }()
}

// withdrawer is a Node that can delete what a failed try set without
// announcing a release (RedisNode; see withdrawArgs).
type withdrawer interface {
	Withdraw(ctx context.Context, key, token string) (bool, error)
}

// withdraw deletes key on n if it holds token, unannounced when n can.
func withdraw(ctx context.Context, n Node, key, token string) (bool, error) {
	if w, ok := n.(withdrawer); ok {
		return w.Withdraw(ctx, key, token)
	}
	return n.Release(ctx, key, token)
}

// retryAfter is when enough holders' keys expire for a majority to be free:
// the (N-quorum+1)-th longest remaining TTL among the No answers.
func (l *Locker) retryAfter(t *tally) time.Duration {
	var rem []time.Duration
	for _, r := range t.results {
		if r.Outcome == No {
			rem = append(rem, r.Remaining)
		}
	}
	k := len(l.nodes) - l.quorum // index of the (N-quorum+1)-th largest
	if k >= len(rem) {
		return 0
	}
	slices.SortFunc(rem, func(a, b time.Duration) int { return int(b - a) })
	return rem[k]
}

// quarantineRetryAfter is, for a round that missed the quorum only because
// quarantined nodes do not count (every other node said yes), when enough
// of their quarantines end for a majority to count; 0 otherwise: a node
// that failed may answer again at any moment, one that may evict keys is
// counted out for as long as it may, and one whose loss is being recorded
// gets a quarantine of its own, not known yet.
func (l *Locker) quarantineRetryAfter(t *tally) time.Duration {
	now := l.opts.Now()
	var ends []time.Time
	for i, r := range t.results {
		switch r.Outcome {
		case Yes:
		case Quarantined:
			if r.Err != nil {
				return 0 // found without its data: a new quarantine, not yet recorded
			}
			m := l.members[i]
			m.mu.Lock()
			end, known := m.end(), m.evicting == "" && !m.unrecorded && m.recovery == nil
			m.mu.Unlock()
			if !known {
				return 0
			}
			ends = append(ends, end)
		default:
			return 0
		}
	}
	need := l.quorum - t.yes
	if need <= 0 || need > len(ends) {
		return 0
	}
	slices.SortFunc(ends, time.Time.Compare)
	return max(ends[need-1].Sub(now), 0)
}
