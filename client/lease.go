package client

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/redfence/redfence/fencing"
)

// LockOptions tunes one lease. The zero value (or nil) takes the documented
// defaults.
type LockOptions struct {
	// TTL is the lease length asked for, and the length of every renewal.
	// The default (0) is the server's default TTL (REDFENCE_DEFAULT_TTL, 10s
	// unless configured).
	TTL time.Duration
	// Wait is how long Acquire keeps trying while the lock is held. The
	// default (0) tries once and returns an error matching ErrHeld.
	Wait time.Duration
	// Owner labels the lease (not a secret). The default is Options.Owner.
	Owner string
	// NoRenew turns the watchdog's renewals off: the lease then ends at its
	// first deadline unless Extend is called.
	NoRenew bool
	// RenewFraction is when the watchdog renews: after this fraction of the
	// TTL has passed since the last (re)grant was requested. It must be in
	// (0, 1); the default is 1/3, so two renewals can fail before the lease
	// runs out. Failed renewals are retried sooner, until the deadline.
	RenewFraction float64
	// MaxRenewals caps the watchdog's renewals; after that the lease ends at
	// its deadline. The default (0) is no cap.
	MaxRenewals int
	// MaxHold caps the lease's total length: the watchdog renews no further
	// once a renewal would take the deadline past acquisition + MaxHold, so
	// the lease ends at the latest MaxHold after it was acquired. It must
	// not be shorter than the TTL (the server's default TTL is checked on
	// the grant, which is then released). The Redlock spec asks clients to
	// bound extensions; the default (0) is no cap.
	MaxHold time.Duration
	// Margin ends the lease (closes Done) this long before its deadline when
	// it has not been renewed by then, leaving the holder time to stop before
	// another client can be granted the lock. It must leave a renewal half
	// the renewal interval: at most the TTL less one and a half renewal
	// intervals (TTL/2 by default). The default is 0: Done closes at the
	// deadline itself.
	Margin time.Duration
	// OnRenew, if set, is called by the watchdog after each successful
	// renewal with the new deadline. It must not block, nor call Release
	// (which waits for the watchdog to return).
	OnRenew func(deadline time.Time)
}

func (o *LockOptions) withDefaults() (LockOptions, error) {
	var v LockOptions
	if o != nil {
		v = *o
	}
	if v.RenewFraction == 0 {
		v.RenewFraction = 1.0 / 3
	}
	if v.RenewFraction <= 0 || v.RenewFraction >= 1 {
		return v, fmt.Errorf("%w: RenewFraction %v is outside (0, 1)", ErrInvalid, v.RenewFraction)
	}
	if v.TTL < 0 || v.Wait < 0 || v.Margin < 0 || v.MaxHold < 0 || v.MaxRenewals < 0 {
		return v, fmt.Errorf("%w: negative lock option", ErrInvalid)
	}
	return v, nil
}

// Lease is a held lock. Its methods are safe for concurrent use.
//
// It is NOT safe to assume the lock is held until Done() closes: a paused
// process notices nothing. Send FencingToken() with every write, to storage
// that checks it.
type Lease struct {
	c        *Client
	name     string
	token    string // the lock token: the holder's secret
	fencing  fencing.Token
	owner    string
	ttl      time.Duration
	acquired time.Time
	opts     LockOptions

	// life is cancelled, with the reason as its cause, when the lease ends.
	life context.Context
	end  context.CancelCauseFunc

	// stopped is cancelled by Release: the watchdog returns and an
	// in-flight renewal is abandoned.
	stopped     context.Context
	stop        context.CancelFunc
	watchdogRet chan struct{} // closed when the watchdog has returned

	mu       sync.Mutex
	deadline time.Time // sent + validity of the newest (re)grant
	renewals int

	// relMu serialises Release; relDone says a release settled it (the
	// lock deleted, or nothing held: relErr), so later calls return that.
	relMu   sync.Mutex
	relDone bool
	relErr  error
}

// Acquire takes the lock on name and starts its watchdog. It tries once,
// or keeps trying until opts.Wait has passed (through a server that could
// not answer meanwhile, ErrUnavailable, too, unless its Retry-After ends
// after the wait); the error then matches ErrHeld (or ErrUnavailable). It
// returns ctx's error when ctx ends first, and ErrLost for a grant whose
// validity ran out before its answer arrived (released again).
func (c *Client) Acquire(ctx context.Context, name string, opts *LockOptions) (*Lease, error) {
	o, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	if o.TTL > 0 {
		// Known before asking: a bad Margin or MaxHold takes no lock (and
		// burns no token). With the server's default TTL they are checked
		// on the grant.
		if err := o.checkTTL(o.TTL); err != nil {
			return nil, err
		}
	}
	owner := o.Owner
	if owner == "" {
		owner = c.opts.Owner
	}
	waitEnd := time.Now().Add(o.Wait)
	backoff := 50 * time.Millisecond
	for {
		wait := min(time.Until(waitEnd), c.opts.MaxServerWait)
		g, err := c.acquireOnce(ctx, name, o.TTL, max(wait, 0), owner)
		if err == nil {
			return c.newLease(name, g, o)
		}
		left := time.Until(waitEnd)
		switch {
		case left <= 0:
			return nil, err
		case errors.Is(err, ErrHeld):
			continue // one chunk of a long wait ran out
		case errors.Is(err, ErrUnavailable):
			// Not reached, or it could not decide (a restart, a
			// majority of nodes down): try again while the wait lasts,
			// unless the server said it cannot succeed before the wait
			// ends (quarantines ending later: every other 503 says
			// "in a second").
			if e, ok := errors.AsType[*Error](err); ok && e.RetryAfter > time.Second && e.RetryAfter > left {
				return nil, err
			}
			d := min(retryDelay(err, backoff), left)
			backoff = min(2*backoff, time.Second)
			if !sleep(ctx, d) {
				// Only the context's error matches (see the sentinels).
				return nil, fmt.Errorf("client: acquire %q: %w (after: %v)", shownName(name), ctx.Err(), err)
			}
		default:
			return nil, err
		}
	}
}

// retryDelay is how long to wait before trying again after err: its
// Retry-After, if it gave one longer than floor, else floor; plus up to a
// fifth of that at random, so that clients told the same Retry-After do not
// all come back at once.
func retryDelay(err error, floor time.Duration) time.Duration {
	d := floor
	var e *Error
	if errors.As(err, &e) && e.RetryAfter > d {
		d = e.RetryAfter
	}
	if d <= 0 {
		return d
	}
	return d + rand.N(d/5+1)
}

// sleep waits d, or until ctx ends (then false).
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func (c *Client) newLease(name string, g *grant, o LockOptions) (*Lease, error) {
	// Granted when the deadline less the TTL was (after any wait on the
	// server), not when the request was sent: MaxHold counts from then.
	deadline := g.sent.Add(g.validity)
	l := &Lease{
		c: c, name: name, token: g.lock, fencing: g.fencing, owner: g.owner, ttl: g.ttl, acquired: later(g.sent, deadline.Add(-g.ttl)), opts: o,
		watchdogRet: make(chan struct{}), deadline: deadline,
	}
	refuse := func(err error) (*Lease, error) { // the grant is released again
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = c.release(ctx, name, g.lock)
		return nil, err
	}
	if err := o.checkTTL(l.ttl); err != nil {
		// The server's default TTL: renewal would come too late to keep
		// the lease, or the lease outlasts MaxHold.
		return refuse(err)
	}
	if !l.live() {
		// Granted, but its validity ran out before the answer arrived (a
		// pause, a slow network): never handed out as held.
		return refuse(fmt.Errorf("client: acquire %q: %w: the grant's validity ran out before its answer arrived (it was released)", shownName(name), ErrLost))
	}
	l.life, l.end = context.WithCancelCause(context.Background())
	l.stopped, l.stop = context.WithCancel(context.Background())
	go l.watch()
	return l, nil
}

// renewEvery is how often a lease of ttl is renewed.
func (o *LockOptions) renewEvery(ttl time.Duration) time.Duration {
	return time.Duration(float64(ttl) * o.RenewFraction)
}

// checkTTL checks o against a lease of ttl: its Margin must leave the
// renewal half the renewal interval at least before the end, and a first
// lease must end within its MaxHold.
func (o *LockOptions) checkTTL(ttl time.Duration) error {
	if o.MaxHold > 0 && ttl > o.MaxHold {
		return fmt.Errorf("%w: MaxHold %v is shorter than the TTL %v: the first lease would outlast it", ErrInvalid, o.MaxHold, ttl)
	}
	interval := o.renewEvery(ttl)
	if o.Margin > 0 && !o.NoRenew && o.Margin > ttl-interval-interval/2 {
		return fmt.Errorf("%w: Margin %v leaves too little room to renew a %v lease every %v (at most %v: the TTL less one and a half renewal intervals)",
			ErrInvalid, o.Margin, ttl, interval, ttl-interval-interval/2)
	}
	return nil
}

// Name returns the lock's name.
func (l *Lease) Name() string { return l.name }

// Owner returns the lease's owner label.
func (l *Lease) Owner() string { return l.owner }

// FencingToken returns the grant's fencing token. Send it with every write
// made under this lease; it stays the same across renewals.
func (l *Lease) FencingToken() fencing.Token { return l.fencing }

// TTL returns the lease length granted (and asked for at each renewal).
func (l *Lease) TTL() time.Duration { return l.ttl }

// Deadline returns when the lease ends unless renewed: the send time of the
// request that (re)granted it plus its validity_ms. The lease has ended once
// the monotonic clock or the wall clock says it passed (see live).
func (l *Lease) Deadline() time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.deadline
}

// Done returns a channel that is closed when the lease ends: lost, run out
// (Deadline less Margin passed without a renewal) or released.
func (l *Lease) Done() <-chan struct{} { return l.life.Done() }

// Context returns a context that is cancelled when the lease ends;
// context.Cause tells why (an error matching ErrLost, or ErrReleased).
func (l *Lease) Context() context.Context { return l.life }

// Err returns nil while the lease lasts, then why it ended: an error
// matching ErrLost, or ErrReleased. It checks the deadline itself, so it
// is not nil past it even before the watchdog has run (after a pause of
// the process, say).
func (l *Lease) Err() error {
	if l.life.Err() == nil {
		if l.live() {
			return nil
		}
		l.lose(fmt.Errorf("%w: the deadline passed", ErrLost))
	}
	return l.ended()
}

// ended is why the lease ended, or nil while Done is open (Err without its
// deadline check, for callers holding mu).
func (l *Lease) ended() error {
	if l.life.Err() == nil {
		return nil
	}
	return context.Cause(l.life)
}

// interval is the time from a (re)grant to its renewal.
func (l *Lease) interval() time.Duration {
	return l.opts.renewEvery(l.ttl)
}

// endAt is when Done closes unless the lease is renewed first.
func (l *Lease) endAt() time.Time { return l.Deadline().Add(-l.opts.Margin) }

// live reports whether endAt is still ahead by both clocks. The monotonic
// one is immune to clock steps but stops while the machine is suspended
// (CLOCK_MONOTONIC on Linux), and the Redis nodes' expiry does not: after
// an hour asleep only the wall clock knows the lease is long gone. A wall
// clock stepped forward can only end a lease early.
func (l *Lease) live() bool {
	end := l.endAt()
	return time.Now().Before(end) && l.c.wallNow().Before(end.Round(0))
}

// errLeaseEnded is the cause of an Extend cut short by the lease's end: the
// lease is gone (it matches ErrLost). (The watchdog's renewals keep their
// own account of why the lease ran out: see watch.)
var errLeaseEnded = fmt.Errorf("%w: the lease's deadline passed before the renewal was answered", ErrLost)

// wallCheck bounds the time between two checks of a lease's deadline by the
// watchdog, so that a lease that ran out during a suspend (see live) ends
// within it of the resume, however long its deadline is by the monotonic
// clock.
const wallCheck = time.Second

// untilCheck is when the watchdog looks at the deadline next.
func (l *Lease) untilCheck() time.Duration {
	return max(min(time.Until(l.endAt()), wallCheck), 0)
}

// lose ends the lease with err (matching ErrLost) unless it already ended.
func (l *Lease) lose(err error) { l.end(err) }

// Extend renews the lease now for ttl (0: the lease's TTL), whether or not
// the watchdog runs. It is bounded by the lease's end, as by ctx: an answer
// after it renews nothing that lasts. An error matching ErrLost means the
// lease is gone and has ended; other errors (ErrUnavailable) leave the lease
// with its old deadline.
func (l *Lease) Extend(ctx context.Context, ttl time.Duration) error {
	if err := l.Err(); err != nil {
		return err
	}
	if ttl <= 0 {
		ttl = l.ttl
	}
	ctx, cancel := context.WithDeadlineCause(ctx, l.endAt(), errLeaseEnded)
	defer cancel()
	err := l.extendWith(ctx, ttl, false)
	if err != nil && !errors.Is(err, ErrLost) {
		if why := l.ended(); errors.Is(why, ErrLost) {
			// The lease ended meanwhile (its watchdog, or the end of a
			// context derived from it, came first): that is the answer.
			return why
		}
	}
	return err
}

// watch renews the lease and ends it when it is lost or runs out.
func (l *Lease) watch() {
	defer close(l.watchdogRet)
	expiry := time.NewTimer(l.untilCheck())
	defer expiry.Stop()
	renew := time.NewTimer(l.untilRenewal())
	defer renew.Stop()
	renewC := renew.C
	why := "the deadline passed without a renewal"
	if l.opts.NoRenew {
		renewC, why = nil, "the deadline passed (renewal is off)"
	}
	var lastErr error // of the renewals that failed since the last success
	for {
		select {
		case <-l.stopped.Done():
			return
		case <-l.life.Done():
			return
		case <-expiry.C:
			if l.live() { // not yet, or Extend moved the deadline
				expiry.Reset(l.untilCheck())
				continue
			}
			l.lose(lostWhy(why, lastErr))
			return
		case <-renewC:
			if !l.live() { // a retry or a renewal due before a suspend: too late now
				l.lose(lostWhy(why, lastErr))
				return
			}
			if reason := l.capped(); reason != "" {
				l.c.opts.Logger.Debug("redfence lease: renewals stop", slog.String("name", l.name), slog.String("reason", reason))
				renewC = nil // the lease runs out at its deadline
				why = "the deadline passed after the last renewal allowed: " + reason
				continue
			}
			err := l.renew(true)
			switch {
			case err == nil:
				lastErr = nil
				expiry.Reset(l.untilCheck())
				renew.Reset(l.untilRenewal())
				if l.opts.OnRenew != nil {
					l.opts.OnRenew(l.Deadline())
				}
			case errors.Is(err, ErrLost):
				l.c.opts.Logger.Warn("redfence lease: lost", slog.String("name", l.name), slog.String("error", err.Error()))
				return
			case l.stopped.Err() != nil || l.life.Err() != nil:
				return
			default:
				// The server could not decide or was not reached: retry
				// soon (after its Retry-After, if it gave one), while time
				// is left; the expiry timer still runs.
				if lastErr == nil || !errors.Is(err, context.DeadlineExceeded) || time.Until(l.endAt()) > 0 {
					// (One cut short by the lease's end tells less than
					// the failure before it.)
					lastErr = err
				}
				l.c.opts.Logger.Warn("redfence lease: renewal failed, retrying", slog.String("name", l.name), slog.String("error", err.Error()))
				d := retryDelay(err, min(max(l.interval()/4, 50*time.Millisecond), time.Second))
				renew.Reset(min(d, max(time.Until(l.endAt())/2, 10*time.Millisecond)))
			}
		}
	}
}

// lostWhy is the error of a lease that ran out: why, and the failure of
// the last renewal tried, if one failed since the last success.
func lostWhy(why string, lastErr error) error {
	if lastErr != nil {
		why += fmt.Sprintf(" (the last renewal failed: %v)", lastErr)
	}
	return fmt.Errorf("%w: %s", ErrLost, why)
}

// untilRenewal is the time left until the next renewal is due: the
// deadline less the part of the TTL after the renewal point (a grant that
// took long, e.g. after a wait, is renewed correspondingly later).
func (l *Lease) untilRenewal() time.Duration {
	return time.Until(l.Deadline().Add(-(l.ttl - l.interval())))
}

// capped says why renewals must stop, or "".
func (l *Lease) capped() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.opts.MaxRenewals > 0 && l.renewals >= l.opts.MaxRenewals {
		return fmt.Sprintf("%d renewals reached (MaxRenewals)", l.renewals)
	}
	if l.opts.MaxHold > 0 && time.Since(l.acquired)+l.ttl > l.opts.MaxHold {
		return fmt.Sprintf("a renewal would hold past %v (MaxHold)", l.opts.MaxHold)
	}
	return ""
}

// renew sends one extend request for the lease's TTL, bounded by the current
// end of the lease, by Release, and by half the renewal interval (1s at
// least): a renewal stuck on a connection that went dead without a word is
// abandoned in time to retry on a new one. It ends the lease if it is lost.
func (l *Lease) renew(watchdog bool) error {
	ctx, cancel := context.WithDeadline(l.stopped, l.endAt())
	defer cancel()
	ctx, cancelTry := context.WithTimeoutCause(ctx, max(l.interval()/2, time.Second), errRequestTimeout)
	defer cancelTry()
	return l.extendWith(ctx, l.ttl, watchdog)
}

func (l *Lease) extendWith(ctx context.Context, ttl time.Duration, watchdog bool) error {
	g, err := l.c.extend(ctx, l.name, l.token, ttl)
	if err != nil {
		if errors.Is(err, ErrLost) {
			l.lose(err)
		}
		return err
	}
	if g.fencing != l.fencing {
		err := fmt.Errorf("%w: renewed with fencing token %d, want %d", ErrLost, g.fencing, l.fencing)
		l.lose(err)
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.ended(); err != nil {
		// It ended while the renewal was on its way (it ran out, or was
		// released): the server's new lease is nobody's; it runs out.
		return err
	}
	l.deadline = g.sent.Add(g.validity)
	if watchdog {
		l.renewals++
	}
	return nil
}

// Release stops the watchdog and ends the lease (Done closes, with
// ErrReleased as the cause unless it was lost before), then deletes the lock
// on every node: the lease ends before the delete is sent, since once the
// delete lands another client may be granted the name. It returns nil when
// the server deleted the lock; an error matching
// ErrLost when the lease had been lost already (nothing was held); other
// errors (ErrUnavailable) when the server could not be asked, in which case
// the lock runs out at its deadline unless a later Release, which asks
// again, succeeds. Once a call returned nil or ErrLost, later calls return
// the same without asking.
func (l *Lease) Release(ctx context.Context) error {
	l.relMu.Lock()
	defer l.relMu.Unlock()
	if l.relDone {
		return l.relErr
	}
	l.stop()
	<-l.watchdogRet
	l.end(ErrReleased)
	err := l.c.release(ctx, l.name, l.token)
	if err == nil || errors.Is(err, ErrLost) {
		l.relDone, l.relErr = true, err
	}
	return err
}

// ReleaseRetrying is Release, sent again after ErrUnavailable (a server
// that could not decide or be reached, or 429 rate-limited; honouring
// Retry-After) until it settles, ctx ends or the lease's deadline passes:
// after that the lock has run out by itself. It returns the last error,
// or nil when a release sent again found nothing held before the
// deadline: an earlier one whose answer was lost may have deleted it, and
// either way the lock is no longer this lease's.
func (l *Lease) ReleaseRetrying(ctx context.Context) error {
	end := l.Deadline()
	backoff := 50 * time.Millisecond
	for again := false; ; again = true {
		err := l.Release(ctx)
		if again && errors.Is(err, ErrLost) && time.Now().Before(end) {
			return nil
		}
		if err == nil || !errors.Is(err, ErrUnavailable) {
			return err
		}
		d := retryDelay(err, backoff)
		backoff = min(2*backoff, time.Second)
		if time.Until(end) <= d || !sleep(ctx, d) {
			return err
		}
	}
}

// later returns the later of a and b.
func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
