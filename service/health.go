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
		if n-r.down == l.quorum-1 && now.Sub(r.quorumLast) >= reachLogEvery {
			logQuorum, r.quorumLogged, r.quorumLast = true, true, now
		}
	} else {
		r.down--
		logBack, r.logged[i] = r.logged[i], false
		if n-r.down == l.quorum {
			logQuorumBack, r.quorumLogged = r.quorumLogged, false
		}
	}
	answering := n - r.down
	r.mu.Unlock()
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
