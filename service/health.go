package service

import (
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// Reachability: the log says when a node stops answering and when it
// answers again, and when a majority stops answering and answers again, once
// per change rather than once per failed request. A node flapping (timeouts
// under load) is logged at most once per reachLogEvery; its recovery is
// logged only if its failure was.

// reachLogEvery is the least time between two "not answering" lines of one
// node, or of the majority.
const reachLogEvery = 10 * time.Second

// reach tracks which nodes answer, from the outcomes of their requests.
type reach struct {
	// failing is read without mu (the common case: no change); changed
	// under it.
	failing []atomic.Bool
	mu      sync.Mutex
	logged  []bool      // the node's current failure was logged
	last    []time.Time // when the node's last failure was logged
	down    int         // nodes failing
	// quorumLogged: the majority's current loss was logged; quorumLast
	// when the last one was.
	quorumLogged bool
	quorumLast   time.Time
	// back, while fewer nodes than a majority answer, is closed when a
	// majority answers again (nil while one answers): acquires waiting
	// out the outage wake then (see majorityBack).
	back chan struct{}
	// countMu serialises noteCounting (before mu, and any member's mu);
	// countLogged, under it: a loss of the counting majority (nodes that
	// answer and whose votes count: not quarantined) was logged, and its
	// end is not.
	countMu     sync.Mutex
	countLogged bool
	// initing, under countMu: Init is recording the nodes one by one, so
	// a count now would mix nodes recorded with nodes not yet; Init counts
	// once when it is done.
	initing bool
}

// majorityBack returns, while fewer nodes than a majority answer (as far as
// this Locker has seen: see noteReach), a channel closed when a majority
// answers again; nil while a majority answers.
func (l *Locker) majorityBack() <-chan struct{} {
	r := l.reach
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.back
}

// allAnswering reports whether no node is failing, as far as this Locker
// has seen (see noteReach): every node answered its last round, and no
// background check since got no answer (see noteCheckReach).
func (l *Locker) allAnswering() bool {
	for i := range l.reach.failing {
		if l.reach.failing[i].Load() {
			return false
		}
	}
	return true
}

func newReach(n int) *reach {
	return &reach{failing: make([]atomic.Bool, n), logged: make([]bool, n), last: make([]time.Time, n)}
}

// noteReach records the outcome of a request to node i (err its error, if it
// failed or timed out) and logs a change of reachability.
func (l *Locker) noteReach(i int, o Outcome, err error) {
	r := l.reach
	failing := o == Failed || o == Timeout
	if r.failing[i].Load() == failing {
		return
	}
	r.mu.Lock()
	if r.failing[i].Load() == failing {
		r.mu.Unlock()
		return
	}
	now := l.opts.Now()
	r.failing[i].Store(failing)
	var logNode, logBack, logQuorum, logQuorumBack bool
	n := len(r.failing)
	if failing {
		r.down++
		if now.Sub(r.last[i]) >= reachLogEvery {
			logNode, r.logged[i], r.last[i] = true, true, now
		}
		if n-r.down == l.quorum-1 {
			r.back = make(chan struct{})
			if now.Sub(r.quorumLast) >= reachLogEvery {
				logQuorum, r.quorumLogged, r.quorumLast = true, true, now
			}
		}
	} else {
		r.down--
		logBack, r.logged[i] = r.logged[i], false
		if n-r.down == l.quorum {
			logQuorumBack, r.quorumLogged = r.quorumLogged, false
			close(r.back)
			r.back = nil
		}
	}
	answering := n - r.down
	r.mu.Unlock()
	if !failing {
		// A node back may restore a counting majority whose loss was
		// logged (its quarantine ended while it did not answer).
		defer l.noteCounting()
	}
	addr := l.nodes[i].Addr()
	switch {
	case logNode:
		why := o.String()
		if err != nil {
			why = err.Error()
		}
		l.opts.Logger.Warn("node not answering", slog.String("node", addr), slog.String("outcome", o.String()),
			slog.String("error", why), slog.Int("answering", answering), slog.Int("nodes", n))
	case logBack:
		l.opts.Logger.Info("node answering again", slog.String("node", addr), slog.Int("answering", answering), slog.Int("nodes", n))
	}
	switch {
	case logQuorum:
		l.opts.Logger.Error("fewer Redis nodes answer than a majority: acquires, extends and lock reads fail (503 quorum-unavailable) until a majority answers again",
			slog.Int("answering", answering), slog.Int("nodes", n), slog.Int("quorum", l.quorum))
	case logQuorumBack:
		l.opts.Logger.Info("a majority of Redis nodes answers again", slog.Int("answering", answering), slog.Int("nodes", n), slog.Int("quorum", l.quorum))
	}
}

// noteCounting logs when fewer nodes than a majority count (they answer,
// but quarantines keep their votes out) and when a majority counts again:
// an outage as real as nodes that do not answer, which that log alone
// would not show.
func (l *Locker) noteCounting() {
	r := l.reach
	// One count and decision at a time: a count taken before another
	// call's decision must not undo it.
	r.countMu.Lock()
	defer r.countMu.Unlock()
	if r.initing {
		return
	}
	now := l.opts.Now()
	counting, answering := 0, 0
	for i := range l.nodes {
		if r.failing[i].Load() {
			continue
		}
		answering++
		if l.counts(i, now) {
			counting++
		}
	}
	lost := counting < l.quorum && answering >= l.quorum && !r.countLogged // unanswering is logged by noteReach
	back := counting >= l.quorum && r.countLogged
	if lost || back {
		r.countLogged = lost
	}
	switch {
	case lost:
		l.opts.Logger.Error("fewer Redis nodes count than a majority (the others are quarantined, or counted out until Postgres has answered for a Redis process just seen): acquires, extends and lock reads fail (503 quorum-unavailable) until that ends",
			slog.Int("counting", counting), slog.Int("answering", answering), slog.Int("nodes", len(l.nodes)), slog.Int("quorum", l.quorum))
	case back:
		l.opts.Logger.Info("a majority of Redis nodes counts again", slog.Int("counting", counting), slog.Int("nodes", len(l.nodes)), slog.Int("quorum", l.quorum))
	}
}

// watchQuarantine logs when node i's quarantine, due to end at until, is
// over, once per quarantine, and checks the counting majority then (see
// noteCounting). A quarantine extended meanwhile is checked again at its
// new end.
func (l *Locker) watchQuarantine(i int, until time.Time) {
	l.noteCounting()
	if !l.admitBackground() {
		return
	}
	go func() {
		defer l.bg.Done()
		t := time.NewTimer(until.Sub(l.opts.Now())) // until is on the Locker's clock
		defer t.Stop()
		for {
			select {
			case <-l.life.Done():
				return // Close does not wait out a quarantine
			case <-t.C:
			}
			m := l.members[i]
			now := l.opts.Now()
			m.mu.Lock()
			end := m.end()
			running, logged := now.Before(end), m.endLogged.Equal(end)
			if !running && !logged {
				m.endLogged = end
			}
			m.mu.Unlock()
			switch {
			case running:
				t.Reset(end.Sub(now))
				continue
			case logged:
				return
			}
			if l.counts(i, now) {
				l.opts.Logger.Info("node's quarantine is over: its votes count again", slog.String("node", m.Addr()))
			}
			l.noteCounting()
			return
		}
	}()
}
