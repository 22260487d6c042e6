// Extend and Release of a grant.

package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/redfence/redfence/internal/keyspace"
)

// Extend renews the lease of the grant holding key with token to at least
// ttl from now (a renewal never shortens a lease). It succeeds only if the
// grant's token was the newest issued for key when Extend began, and a
// majority renewed within the new validity (which no newer grant can follow
// on: see below); the fencing token stays the same. A node that lost its
// memory (its marker) does not count. On ErrLost the client must acquire
// anew: after a round that a majority refused, the nodes that renewed get
// their earlier lease back (see undoRenewals); when a newer token exists
// (the grant is fenced out), nothing is touched. Either way the lease runs
// on those nodes until its old deadline or its release, so no other client
// wins the name there while this one may still be at work. On any other
// error the lease runs at least until its old deadline.
func (l *Locker) Extend(ctx context.Context, key, token string, ttl time.Duration) (*Grant, error) {
	if err := l.CheckTTL(ttl); err != nil {
		return nil, err
	}
	rkey := keyspace.RedisKey(key)
	// The grant's record is read before any node is touched, so Postgres
	// being unavailable fails the extend with every lease as it was.
	rec, err := l.last(ctx, key)
	if err != nil {
		if cerr := ctx.Err(); cerr != nil { // the caller left: no news of Postgres
			return nil, fmt.Errorf("extend %q: %w", key, cerr)
		}
		return nil, &Error{Op: "extend", Key: key, Err: ErrFencing, Cause: err}
	}
	if rec.Holder != HolderID(token) {
		// Fenced out, but not deleted: if the token holds the name (a newer
		// token was issued for a try that was never granted), its lease
		// runs to the deadline its client was given, or until the client
		// releases it. Deleting it now would let another client win the
		// name before this one has heard that it lost it.
		return nil, &Error{Op: "extend", Key: key, Err: ErrLost, Cause: errors.New("the lock token is not that of the newest grant (a newer token was issued, or this token never held the name): its lease cannot be renewed, and runs until its deadline or its release")}
	}
	// A majority renewed by compare-and-pexpire after the read proves no
	// newer grant since: one would have needed the key gone from a
	// majority, and a renewal never recreates a key. (A token burned
	// meanwhile by a try that stalled before issuance is not a grant; the
	// reference store then refuses this grant's token, and the next extend
	// answers ErrLost.) A renewal also never
	// shortens a lease (see extendScript), so a failed or partial round
	// leaves every node's lease at least as long as the client believes.
	// Checked after the read, which may take IssueTimeout, and after start
	// is read: the lease runs from start, and a pause between a check and
	// start could begin it when the registry no longer counts this server.
	start := l.opts.Now()
	if err := l.heartbeatStale(); err != nil {
		return nil, &Error{Op: "extend", Key: key, Err: ErrFencing, Cause: err}
	}
	// prev[i]: the lease node i had before it renewed (when it did).
	prev := make([]time.Duration, len(l.nodes))
	votes, _ := l.round(context.WithoutCancel(ctx), "extend", nodeOp{sync: func(ctx context.Context, i int, n Node) (bool, time.Duration, error) {
		epoch, _ := l.members[i].state()
		lease, before, err := n.Extend(ctx, rkey, token, ttl, epoch)
		l.noteLoss(i, epoch, err)
		prev[i] = before
		return lease > 0, lease, err
	}}, nil, l.decided)
	t := l.collect(votes)
	if t.yes < l.quorum {
		l.drain(t, votes) // decide on every node's answer, each within NodeTimeout
		if l.refused(t) {
			l.undoRenewals(ctx, rkey, token, t, prev)
			return nil, &Error{Op: "extend", Key: key, Err: ErrLost, Nodes: t.results}
		}
		return nil, &Error{Op: "extend", Key: key, Err: ErrQuorum, Nodes: t.results, Cause: nodeErrors(t.results)}
	}
	// The lease a majority keeps: at least ttl, more where a node kept a
	// longer one. Each node measured its lease after start, so it lasts
	// at least that long from start. It is reported as MaxTTL at most: a
	// node's quarantine after a memory loss lasts MaxTTL (plus drift), so
	// no deadline given may be longer. Only a node whose clock stepped back
	// (its keys outlive their TTL by the step) or a key of a server with a
	// longer MaxTTL holds more, and a lower bound of the lease stays true.
	lease := min(l.majorityLease(t), l.opts.MaxTTL)
	expires := start.Add(lease - l.drift(lease))
	if !l.opts.Now().Before(expires) {
		// The renewed keys run out about now (within the drift allowance):
		// they are left as they are. Shortening them back could cut short
		// the lease of a renewal of the same token that succeeded meanwhile
		// (through another server, while this one stalled).
		l.drain(t, votes)
		return nil, &Error{Op: "extend", Key: key, Err: ErrLost, Nodes: t.results, Cause: errors.New("renewal took longer than the lease")}
	}
	return &Grant{Key: key, Token: token, Fencing: rec.Token, TTL: ttl, Start: start, Expires: expires, Owner: rec.Owner, DriftFactor: l.opts.DriftFactor}, nil
}

// undoRenewals puts back, on every node that renewed key for token in an
// extend a majority refused (t, every answer in), the lease it had before
// (prev). That cuts short no lease a client may still rely on: a renewal
// of the same token that succeeded had a majority, which shares a node with
// the majority that refused this one; that node no longer had the key, so
// the successful renewal's deadline had passed (short of a fault, an
// eviction or a clock jump, that breaks the lease anyway).
// Deleting the key instead would free the name on those nodes before the
// deadline the lease's client was given, and the majority that refused may
// be wrong (a node that evicted the key, or lost it and is not known to
// have yet). A node whose answer did not come keeps what it may have
// renewed, which only keeps the name from others longer. It waits for
// every answer, each within NodeTimeout.
func (l *Locker) undoRenewals(ctx context.Context, rkey, token string, t *tally, prev []time.Duration) {
	var wg sync.WaitGroup
	for i, r := range t.results {
		if r.Err != nil || r.Remaining <= prev[i] {
			continue // no answer, or not lengthened (a quarantined node's yes is restored too)
		}
		wg.Go(func() {
			cctx, cancel := l.cleanupContext(ctx)
			defer cancel()
			if _, err := l.nodes[i].Restore(cctx, rkey, token, prev[i]); err != nil {
				l.opts.Logger.Warn("restoring a lease after a failed extend", slog.String("node", l.nodes[i].Addr()), slog.String("error", err.Error()))
			}
		})
	}
	wg.Wait()
}

// keyToken is a Redis key and a lock token.
type keyToken struct{ rkey, token string }

// markReleased tells the granting round of token on rkey, if nodes of it are
// still to answer, to delete what they set when they do. A release naming
// another key (the token's holder mixed up its names) is refused by every
// node and changes nothing, so it marks nothing.
func (l *Locker) markReleased(rkey, token string) {
	l.lateMu.Lock()
	lr := l.late[token]
	l.lateMu.Unlock()
	if lr != nil && lr.rkey == rkey {
		lr.mu.Lock()
		lr.released = true
		lr.mu.Unlock()
	}
}

// releaseAll compare-and-deletes key on every node. It waits for every
// answer (each within NodeTimeout) when all is true; otherwise it returns as
// soon as a majority deleted the key, and the slower nodes finish in the
// background.
func (l *Locker) releaseAll(ctx context.Context, rkey, token string, all bool) *tally {
	l.markReleased(rkey, token)
	// Releases of one token on one key run one after the other: done is
	// closed once every node answered this one, and the next one waits for
	// it (so it sees this one's outcome rather than racing it).
	done := make(chan struct{})
	l.lateMu.Lock()
	kt := keyToken{rkey, token}
	prev := l.releasing[kt]
	l.releasing[kt] = done
	l.lateMu.Unlock()
	if prev != nil {
		<-prev // each of its nodes answers within NodeTimeout
	}
	var mu sync.Mutex
	left := len(l.nodes)
	// Nodes that answered that the key does not hold the token: if others
	// deleted it, the token was a grant's, and a straggling SET of that
	// grant may still land on them (see sweeper).
	var found bool
	var absent []int
	args := releaseArgs(rkey, token)
	votes, _ := l.round(context.WithoutCancel(ctx), "release", nodeOp{
		sync: func(ctx context.Context, _ int, n Node) (bool, time.Duration, error) {
			ok, err := n.Release(ctx, rkey, token)
			return ok, 0, err
		},
		async: func(ctx context.Context, _ int, n asyncNode, done func(bool, time.Duration, error)) {
			n.releaseAsync(ctx, args, func(ok bool, err error) { done(ok, 0, err) })
		},
	}, func(i int, wrote, unsure bool) {
		if unsure {
			// The delete may not have been applied: the sweeper retries.
			l.sweep.add(i, rkey, token)
		}
		mu.Lock()
		left--
		if wrote && !unsure {
			found = true
		} else if !unsure {
			absent = append(absent, i)
		}
		var sweep []int
		if left == 0 && found {
			sweep = absent
		}
		last := left == 0
		mu.Unlock()
		for _, i := range sweep {
			l.sweep.add(i, rkey, token)
		}
		if last {
			l.lateMu.Lock()
			if l.releasing[kt] == done { // no release of the token queued behind
				delete(l.releasing, kt)
			}
			l.lateMu.Unlock()
			close(done)
		}
	}, func(yes, _, got int) bool { return got == len(l.nodes) || !all && yes >= l.quorum })
	<-votes.ready
	t := &tally{results: make([]NodeResult, len(l.nodes))}
	for t.got < len(l.nodes) && (all || t.yes < l.quorum) {
		l.add(t, <-votes.ch)
	}
	return t
}

// Release deletes the lock on key wherever token holds it, even if the caller
// goes away. It returns once a majority deleted it (the rest complete in the
// background, each within its timeout) or every node answered. It returns an
// error matching ErrNotHolder when the token held it nowhere that answered,
// and ErrQuorum when too few nodes answered to tell.
func (l *Locker) Release(ctx context.Context, key, token string) error {
	t := l.releaseAll(ctx, keyspace.RedisKey(key), token, false)
	if t.yes > 0 {
		l.released(key, token)
		l.wake(key, releaseDigest(token), max(t.yes, l.quorum))
		return nil
	}
	if l.refused(t) {
		return &Error{Op: "release", Key: key, Err: ErrNotHolder, Nodes: t.results}
	}
	return &Error{Op: "release", Key: key, Err: ErrQuorum, Nodes: t.results, Cause: nodeErrors(t.results)}
}
