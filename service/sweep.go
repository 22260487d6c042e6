package service

// Sweeping: the compare-and-deletes whose outcome is unknown are sent again
// until it is known.
//
// A node that stalls past NodeTimeout (paused, swapping, a long fork) keeps
// a try's SET in its socket. go-redis drops the timed-out connection and the
// try's clean-up goes out on another one, or is dropped unsent when its own
// deadline passes first. When the node resumes it may apply the SET after
// the delete meant to follow it: two connections are not ordered. Without
// more, that key outlives the failed try by its whole TTL, and on a majority
// it refuses the name to everyone for that long, with nobody holding it.
//
// So a delete of a key this Locker may have set is remembered, per node,
// when its outcome is unknown: a failed try's delete on a node that gave no
// answer to the SET (unless the delete removed the key) or none to the
// delete; a release a node did not answer; and a release that found no key
// on a node while others deleted it (a grant's SET that timed out there may
// still come). The sweeper sends it again every sweep interval. An entry is
// done when a delete removed the key, or when two deletes, in separate
// passes and the second at least sweepSettle after the entry was made,
// found the key not holding the token: the first may have been read in the
// same event-loop turn as a SET still waiting in an older connection, but
// the second was sent after the first was answered, so by then the node has
// read what was sent before. A SET still on the network cannot come later
// than that either: a connection go-redis gives up on is reset, which stops
// its retransmissions (see dialer), and sweepSettle covers what was already
// in flight. An entry that only gets error replies (WRONGTYPE, READONLY
// after a failover) is dropped after maxSweepErrors of them.
//
// The guarantee lasts as long as this process: entries are not persisted.
//
// Tokens are never reused (one per try), so a late delete can only remove
// the key of the try or grant it was meant for, one that failed or was
// released.

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

const (
	// maxSwept bounds the entries kept per node; beyond it new ones are
	// dropped (their keys expire with their TTL, as without sweeping).
	maxSwept = 1 << 16
	// sweepSettle is how long after an entry is made a delete that finds no
	// key can end it: longer than a packet stays in flight.
	sweepSettle = time.Second
	// maxSweepErrors is how many error replies end an entry.
	maxSweepErrors = 5
)

// sweepKey is one delete to redeliver: the key and the token it must hold.
type sweepKey struct{ rkey, token string }

// sweepEntry is what the passes learnt of one sweepKey.
type sweepEntry struct {
	added  time.Time
	absent int // definite answers that the key does not hold the token
	errors int // error replies
}

// sweeper redelivers deletes (see above). Its goroutine runs only while
// something is pending.
type sweeper struct {
	l     *Locker
	every time.Duration

	mu sync.Mutex
	// pending holds, per node, the deletes to redeliver.
	pending []map[sweepKey]*sweepEntry
	running bool
	closed  bool
	dropped []bool // per node: maxSwept was reached since the last warning
	stop    chan struct{}
	wg      sync.WaitGroup
	// passed, if set, is called after each pass (a test hook).
	passed func()
}

func newSweeper(l *Locker) *sweeper {
	s := &sweeper{l: l, every: max(250*time.Millisecond, 4*l.opts.NodeTimeout), stop: make(chan struct{}),
		pending: make([]map[sweepKey]*sweepEntry, len(l.nodes)), dropped: make([]bool, len(l.nodes))}
	for i := range s.pending {
		s.pending[i] = make(map[sweepKey]*sweepEntry)
	}
	return s
}

// add remembers that the delete of rkey holding token on node i must be
// sent again.
func (s *sweeper) add(i int, rkey, token string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	k := sweepKey{rkey, token}
	if _, ok := s.pending[i][k]; !ok && len(s.pending[i]) >= maxSwept {
		if !s.dropped[i] {
			s.dropped[i] = true
			s.l.opts.Logger.Warn("too many unanswered lock deletes to retry; new ones are left to expire with their TTL",
				"node", s.l.nodes[i].Addr(), "pending", len(s.pending[i]))
		}
		return
	}
	s.pending[i][k] = &sweepEntry{added: s.l.opts.Now()} // a new unknown outcome: start again
	if !s.running {
		s.running = true
		s.wg.Add(1)
		go s.run()
	}
}

// count returns how many deletes are waiting to be redelivered.
func (s *sweeper) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sizeLocked()
}

// sizeLocked counts the pending deletes of every node. s.mu is held.
func (s *sweeper) sizeLocked() int {
	n := 0
	for _, p := range s.pending {
		n += len(p)
	}
	return n
}

// close stops the sweeper, sends every pending delete once more (within
// a few node timeouts: the nodes may be closed next, and a delete still in
// doubt would otherwise leave its key to hold the name until its TTL), and
// forgets them.
func (s *sweeper) close() {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.closed = true
	close(s.stop)
	s.mu.Unlock()
	s.wg.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), 4*s.l.opts.NodeTimeout)
	s.passWith(ctx)
	cancel()
	s.mu.Lock()
	for _, p := range s.pending {
		clear(p)
	}
	s.mu.Unlock()
}

// run makes a pass every interval until nothing is pending or the sweeper
// is closed.
func (s *sweeper) run() {
	defer s.wg.Done()
	t := time.NewTimer(s.every)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
		s.pass()
		s.mu.Lock()
		if s.passed != nil {
			s.passed()
		}
		if s.sizeLocked() == 0 || s.closed {
			s.running = false
			s.mu.Unlock()
			return
		}
		s.mu.Unlock()
		t.Reset(s.every)
	}
}

// pass sends every pending delete once, node by node in parallel; a node's
// pass ends at its first error other than an error reply (it is still
// unreachable).
func (s *sweeper) pass() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-s.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	s.passWith(ctx)
}

// passWith is pass, cut short when ctx ends.
func (s *sweeper) passWith(ctx context.Context) {
	var wg sync.WaitGroup
	for i := range s.pending {
		s.mu.Lock()
		keys := make([]sweepKey, 0, len(s.pending[i]))
		for k := range s.pending[i] {
			keys = append(keys, k)
		}
		s.mu.Unlock()
		if len(keys) == 0 {
			continue
		}
		wg.Go(func() { s.passNode(ctx, i, keys) })
	}
	wg.Wait()
}

func (s *sweeper) passNode(ctx context.Context, i int, keys []sweepKey) {
	n := s.l.nodes[i]
	for _, k := range keys {
		nctx, cancel := context.WithTimeout(ctx, s.l.opts.NodeTimeout)
		t0 := time.Now()
		ok, err := withdraw(nctx, n, k.rkey, k.token) // the release, if any, was announced
		cancel()
		outcome := No
		switch {
		case err != nil:
			outcome = s.l.classify(err)
		case ok:
			outcome = Yes
		}
		s.l.opts.Observer.NodeOp(n.Addr(), "sweep", outcome, time.Since(t0))
		var reply redis.Error
		replied := errors.As(err, &reply) // the node answered, with an error
		s.mu.Lock()
		e := s.pending[i][k]
		switch {
		case errors.Is(err, errNodeClosed):
			clear(s.pending[i]) // the node is gone for good
		case e == nil: // ended meanwhile (Close)
		case replied:
			if e.errors++; e.errors >= maxSweepErrors {
				delete(s.pending[i], k)
			}
		case err != nil:
		case ok:
			delete(s.pending[i], k)
		default:
			if e.absent++; e.absent >= 2 && s.l.opts.Now().Sub(e.added) >= sweepSettle {
				delete(s.pending[i], k)
			}
		}
		if len(s.pending[i]) < maxSwept/2 {
			s.dropped[i] = false
		}
		s.mu.Unlock()
		if err != nil && !replied {
			return
		}
	}
}
