package service

// Speculative issuance: a try that runs alone sends its fencing-token
// issuance together with its SETs, so the durable commit overlaps the Redis
// round instead of following it. After the quorum the token is confirmed
// (still the newest for its key) before it is granted; a try that fails
// leaves it unused (burned). See fencing.Speculator for the issuer's side.
//
// When a try may speculate (speculable):
//   - speculation is on and the issuer supports it;
//   - the try is the only one running in this Locker (under load, issuance
//     is batched instead, and a speculation is a commit of its own);
//   - nobody else in this Locker waits for the key (a contended key would
//     mostly speculate for tries that lose);
//   - no node is failing (a round found it not answering or refusing a
//     lock's writes, or a background check got no answer: see
//     allAnswering), so the try is not likely to fail for want of a
//     majority and leave its token unused;
//   - the key's newest token fences out nobody: it is the token of a grant
//     this Locker made and saw released, or, as far as this Locker knows, the
//     key never had one. The issuer applies the speculation only if the
//     token named is indeed still the newest, so a grant made elsewhere is
//     never fenced out by a speculation here.
//
// Token order stays grant order: a token is granted only if it is still the
// newest after the quorum (fencing.Speculation.Confirm). A try that fails
// leaves its token unused: it is never withdrawn, so a key's token never
// goes back and no number is issued twice. A skipped number costs nothing
// but the number; and a try that fails stops speculation on its key until a
// grant of it here is released (see distrust), so a refused try costs at
// most one. Another try of this Locker that wins the key while a
// speculation for it is still ending does not wait for it: either the
// speculative statement committed first, and the winner's token comes after
// it, or the winner's token did, and the statement (conditional on the
// older token) issues nothing. Waiting would only spend the winner's lease.

import (
	"context"
	"errors"
	"time"

	"github.com/redfence/redfence/fencing"
)

// maxRecent bounds Locker.recent. A key it forgets is treated as one this
// Locker never granted.
const maxRecent = 4096

// recentGrant is the last grant of a key by a Locker.
type recentGrant struct {
	lock     string // the lock token; "" once speculation failed on the key
	fencing  fencing.Token
	released bool
}

// pending is a running speculation of a try.
type pending struct {
	l    *Locker
	key  string
	last fencing.Token // the newest token it was sent for
	spec fencing.Speculation
}

// speculate starts a speculative issuance for the try of c if it may (see
// speculable), or returns nil. A failure to start it is left for the
// ordinary issuance after the quorum to meet.
func (l *Locker) speculate(ctx context.Context, c fencing.Claim, queued bool) *pending {
	last, ok := l.speculable(c.Key, queued)
	if !ok {
		return nil
	}
	// Registered before the statement is sent, so no other try of this
	// Locker speculates on the key meanwhile.
	p := &pending{l: l, key: c.Key, last: last}
	l.specMu.Lock()
	if l.pending[c.Key] != nil {
		// Another try's, started meanwhile: not alone after all.
		l.specMu.Unlock()
		return nil
	}
	l.pending[c.Key] = p
	l.specMu.Unlock()
	// Bounded by the per-node timeout: the round has not started yet, and a
	// speculation is only worth it when Postgres answers at once (the store
	// also declines when no pooled connection is idle).
	sctx, cancel := context.WithTimeout(ctx, l.opts.NodeTimeout)
	defer cancel()
	s, err := l.speculator.Speculate(sctx, c, last)
	if err != nil {
		p.end()
		return nil
	}
	p.spec = s
	return p
}

// speculable reports whether a try for key may speculate, and on which newest
// token (see the top of this file). queued says the try's acquire is itself
// among key's waiters.
func (l *Locker) speculable(key string, queued bool) (fencing.Token, bool) {
	if l.speculator == nil || l.tries.Load() != 1 || !l.allAnswering() {
		return 0, false
	}
	others := 0
	l.waitMu.Lock()
	if wq := l.waiters[key]; wq != nil {
		others = len(wq.q)
	}
	l.waitMu.Unlock()
	if queued {
		others--
	}
	if others > 0 {
		return 0, false
	}
	l.specMu.Lock()
	defer l.specMu.Unlock()
	g, ok := l.recent[key]
	if !ok {
		return 0, true
	}
	return g.fencing, g.released
}

// abandon ends p's speculation, before the refusal of its try is returned:
// its token, if issued, stays unused, which fences out no live grant (see
// fencing.Speculation). The key is not speculated on again until a grant of
// it here is released: a key held elsewhere would otherwise cost a durable
// commit and a token number for every refused try.
func (p *pending) abandon(ctx context.Context) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), p.l.opts.IssueTimeout)
	if err := p.spec.Abandon(cctx); err != nil {
		p.l.opts.Logger.Warn("a speculative fencing token's statement could not be read; its token, if issued, stays unused (safe: it fences out no live grant)",
			"name", p.key, "error", err.Error())
	}
	cancel()
	p.l.distrust(p.key, p.last)
	p.end()
}

// end removes p from the running speculations.
func (p *pending) end() {
	p.l.specMu.Lock()
	if p.l.pending[p.key] == p {
		delete(p.l.pending, p.key)
	}
	p.l.specMu.Unlock()
}

// errLeaseOver reports that a grant's lease ran out before its token was
// issued: none was.
var errLeaseOver = errors.New("service: the lease ran out before issuance")

// issue returns the token of a won grant, whose lease ends at expires:
// spec's, when it is confirmed, else one issued now, unless the lease is
// over by then (errLeaseOver).
func (l *Locker) issue(ctx context.Context, c fencing.Claim, spec *pending, expires time.Time) (fencing.Token, error) {
	if spec != nil {
		ft, err := spec.spec.Confirm(ctx)
		spec.end()
		if err == nil {
			return ft, nil
		}
		l.distrust(c.Key, spec.last)
		if !l.opts.Now().Before(expires) {
			// The confirmation took the lease: most likely a token was
			// issued meanwhile for a live grant, which a new one would
			// fence out.
			return 0, errLeaseOver
		}
	}
	return l.issuer.Issue(ctx, c)
}

// distrust notes that key's newest token was not last, as this Locker
// thought: it does not speculate on key again until a grant here is
// released. A record of a newer grant here is kept.
func (l *Locker) distrust(key string, last fencing.Token) {
	l.specMu.Lock()
	defer l.specMu.Unlock()
	if g, ok := l.recent[key]; !ok || g.released && g.fencing == last {
		l.rememberLocked(key, recentGrant{})
	}
}

// remember records g as key's recent grant.
func (l *Locker) remember(key string, g recentGrant) {
	l.specMu.Lock()
	defer l.specMu.Unlock()
	l.rememberLocked(key, g)
}

// rememberLocked is remember with l.specMu held.
func (l *Locker) rememberLocked(key string, g recentGrant) {
	if _, ok := l.recent[key]; !ok && len(l.recent) >= maxRecent {
		for k := range l.recent { // forget one, any one
			delete(l.recent, k)
			break
		}
	}
	l.recent[key] = g
}

// released notes that the grant of key with lock token token was released.
func (l *Locker) released(key, token string) {
	l.specMu.Lock()
	defer l.specMu.Unlock()
	if g, ok := l.recent[key]; ok && g.lock == token {
		g.released = true
		l.recent[key] = g
	}
}
