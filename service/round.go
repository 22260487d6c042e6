// The quorum round: one command sent to every node, the votes counted as
// they arrive.

package service

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redfence/redfence/fencing"
)

// vote is one node's answer, tagged with its index.
type vote struct {
	i int
	NodeResult
}

func (l *Locker) classify(err error) Outcome {
	var ne net.Error
	if errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout() {
		return Timeout
	}
	return Failed
}

// last looks up the newest fencing record of key, bounded by IssueTimeout.
func (l *Locker) last(ctx context.Context, key string) (fencing.Record, error) {
	ctx, cancel := context.WithTimeout(ctx, l.opts.IssueTimeout)
	defer cancel()
	return l.issuer.Last(ctx, key)
}

// nodeOp is a round's request to one node. sync blocks for the answer; async,
// when set and the node answers asynchronously (see asyncNode), has the
// node's pipeline deliver it to done instead, so the round costs no
// goroutine per node.
type nodeOp struct {
	sync  func(ctx context.Context, i int, n Node) (bool, time.Duration, error)
	async func(ctx context.Context, i int, n asyncNode, done func(bool, time.Duration, error))
}

// round sends op to every node in parallel, each bounded by NodeTimeout, and
// returns the ballot the answers arrive on (buffered: senders never block)
// and a WaitGroup that is done once every node has answered and its after
// has run. after, if set, runs once node i's answer is sent; wrote is false
// when the node definitely changed nothing (it answered no, or that it lost
// its memory), and unsure is true when the node gave no answer (an error or
// a timeout: what it did, or will still do, is unknown). after must not
// block: it may run on a node's pipeline writer.
// An answer that comes after the node's deadline counts as a timeout.
//
// The caller waits on the ballot's ready channel, closed once the answers in
// satisfy enough (which counts the Yes and No outcomes and all answers), and
// then reads the votes: it is woken once per decision, not once per answer.
// A nil enough closes ready at once.
func (l *Locker) round(ctx context.Context, name string, op nodeOp, after func(i int, wrote, unsure bool), enough func(yes, no, got int) bool) (*ballot, *sync.WaitGroup) {
	// A status ("ttl") counts like an extend: a quarantined node's "held"
	// is not a vote, and its "not held" may be a lease it forgot.
	voting := name == "acquire" || name == "extend" || name == "ttl"
	ch := make(chan vote, len(l.nodes))
	b := &ballot{ch: ch, ready: make(chan struct{})}
	if enough == nil {
		close(b.ready)
	}
	var (
		countMu      sync.Mutex
		yes, no, got int
		fired        = enough == nil // ready is closed
	)
	// One deadline for the round: every node's request starts now. The
	// last node to answer cancels it. A node that has not answered by then
	// gets a timeout vote then, whatever its request does: a pipelined
	// batch runs until the latest deadline of the calls it carries, and a
	// blocking call may overrun its own. Its answer, if it comes, is
	// dropped (a timeout already counts as "may have written").
	nctx, cancel := l.nodeContext(ctx)
	var wg sync.WaitGroup
	wg.Add(len(l.nodes))
	l.ops.Add() // done once every node answered and its after ran
	answered := make([]atomic.Bool, len(l.nodes))
	var stopTimeouts atomic.Pointer[func() bool]
	finish := func(i int, t0 time.Time, ok bool, rem time.Duration, err error, async bool) {
		defer wg.Done()
		var last bool
		defer func() {
			if last {
				l.ops.Done()
			}
		}()
		n := l.nodes[i]
		if async && err == nil && nctx.Err() != nil {
			// Answered too late (the pipeline delivers what it read):
			// count a timeout, as a blocking call would have returned
			// one, and treat the node as changed.
			err = fmt.Errorf("%s: %w", name, nctx.Err())
		}
		v := vote{i: i, NodeResult: NodeResult{Addr: n.Addr(), Latency: time.Since(t0), Remaining: rem}}
		switch {
		case errors.Is(err, ErrMemoryLost):
			v.Outcome = Quarantined
			v.Err = &NodeError{Addr: n.Addr(), Err: err}
		case err != nil:
			v.Outcome = l.classify(err)
			v.Err = &NodeError{Addr: n.Addr(), Err: err}
		case ok && voting && !l.counts(i, l.opts.Now()):
			v.Outcome = Quarantined
		case !ok && (name == "extend" || name == "ttl") && !l.counts(i, l.opts.Now()):
			// A node that lost its memory answers "not held" for every
			// lease it had: that No counts no more than a Yes would. (An
			// acquire's No is someone's key written since: it stays a No.)
			v.Outcome = Quarantined
		case ok:
			v.Outcome = Yes
		default:
			v.Outcome = No
		}
		if ctx.Err() == nil { // a caller that left is no news of the node
			l.opts.Observer.NodeOp(v.Addr, name, v.Outcome, v.Latency)
			l.noteReach(i, v.Outcome, err)
		}
		countMu.Lock()
		got++
		switch v.Outcome {
		case Yes:
			yes++
		case No:
			no++
		}
		fire := !fired && enough(yes, no, got)
		fired = fired || fire
		last = got == len(l.nodes)
		countMu.Unlock()
		if last {
			if stop := stopTimeouts.Load(); stop != nil {
				(*stop)() // spares the timeouts' goroutine
			}
			cancel() // the last answer is in
		}
		ch <- v
		if fire {
			close(b.ready) // after this vote is sent: the caller finds it
		}
		if after != nil {
			unsure := err != nil && !errors.Is(err, ErrMemoryLost)
			after(i, ok || unsure, unsure)
		}
	}
	once := func(i int, t0 time.Time, ok bool, rem time.Duration, err error, async bool) {
		if !answered[i].Swap(true) {
			finish(i, t0, ok, rem, err, async)
		}
	}
	start := time.Now()
	stop := context.AfterFunc(nctx, func() {
		for i := range l.nodes {
			once(i, start, false, 0, fmt.Errorf("%s: %w", name, nctx.Err()), false)
		}
	})
	stopTimeouts.Store(&stop)
	for i, n := range l.nodes {
		if an, ok := n.(asyncNode); ok && op.async != nil && an.async() {
			t0 := time.Now()
			op.async(nctx, i, an, func(ok bool, rem time.Duration, err error) { once(i, t0, ok, rem, err, true) })
			continue
		}
		go func() {
			t0 := time.Now()
			ok, rem, err := op.sync(nctx, i, n)
			once(i, t0, ok, rem, err, false)
		}()
	}
	return b, &wg
}

// ballot is where a round's answers arrive (see round).
type ballot struct {
	// ch gets every node's answer once, in arrival order (buffered: a
	// node never blocks on it).
	ch chan vote
	// ready is closed once the answers sent satisfy the round's enough.
	ready chan struct{}
}

// decided is the enough of a voting round: a majority said yes, or too few
// nodes are left to make one.
func (l *Locker) decided(yes, _, got int) bool {
	return yes >= l.quorum || yes+(len(l.nodes)-got) < l.quorum
}

func (l *Locker) nodeContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, l.opts.NodeTimeout)
}

// tally collects votes until yes reaches the quorum or can no longer reach it.
type tally struct {
	results      []NodeResult
	yes, no, got int
}

func (l *Locker) collect(b *ballot) *tally {
	<-b.ready
	t := &tally{results: make([]NodeResult, len(l.nodes))}
	for !l.decided(t.yes, t.no, t.got) {
		l.add(t, <-b.ch)
	}
	return t
}

func (l *Locker) add(t *tally, v vote) {
	t.results[v.i] = v.NodeResult
	t.got++
	switch v.Outcome {
	case Yes:
		t.yes++
	case No:
		t.no++
	}
}

// drainReady adds the votes of a round that arrived already.
func (l *Locker) drainReady(t *tally, b *ballot) {
	for t.got < len(l.nodes) {
		select {
		case v := <-b.ch:
			l.add(t, v)
		default:
			return
		}
	}
}

// drain waits for the remaining votes of a round.
func (l *Locker) drain(t *tally, b *ballot) {
	for t.got < len(l.nodes) {
		l.add(t, <-b.ch)
	}
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// refreshed reports, after a try refused for want of a majority, whether a
// node it found quarantined counts now, once the recoveries running on such
// nodes ended (within IssueTimeout). A server that learns late of a node's
// restart (its first connection since, or the node answering with a newer
// epoch marker than it knew) stops counting the node until it has read the
// record; when another server handled that restart and its quarantine is
// over, the node counts again, and the acquire is worth another try at once.
func (l *Locker) refreshed(ctx context.Context, aerr *Error, req Request, deadline time.Time) bool {
	if !errors.Is(aerr, ErrQuorum) {
		return false
	}
	var quarantined []int
	for i, r := range aerr.Nodes {
		if r.Outcome == Quarantined {
			quarantined = append(quarantined, i)
		}
	}
	if len(quarantined) == 0 {
		return false
	}
	// Within the wait left, if any: a try alone waits at most as long as
	// an issuance may take.
	limit := l.opts.IssueTimeout
	if req.Wait > 0 {
		limit = min(limit, deadline.Sub(l.opts.Now()))
	}
	wctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	for _, i := range quarantined {
		m := l.members[i]
		m.mu.Lock()
		done := m.recovery
		m.mu.Unlock()
		if done == nil {
			continue
		}
		select {
		case <-done:
		case <-wctx.Done():
			return false
		case <-req.Stop:
			return false
		}
	}
	now := l.opts.Now()
	return slices.ContainsFunc(quarantined, func(i int) bool { return l.counts(i, now) })
}

// refused reports whether the No answers alone rule out a majority.
func (l *Locker) refused(t *tally) bool { return len(l.nodes)-t.no < l.quorum }

func nodeErrors(rs []NodeResult) error {
	var errs []error
	for _, r := range rs {
		if r.Err != nil {
			errs = append(errs, r.Err)
		}
	}
	return errors.Join(errs...)
}

// cleanupContext returns a context for clean-up that outlives ctx's
// cancellation but not the per-node timeout.
func (l *Locker) cleanupContext(ctx context.Context) (context.Context, context.CancelFunc) {
	l.ops.Add()
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.opts.NodeTimeout)
	var once sync.Once
	return cctx, func() {
		cancel()
		once.Do(l.ops.Done)
	}
}
