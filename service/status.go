// Status of a lock, and of the nodes.

package service

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/keyspace"
)

// Status describes a lock without revealing its token.
type Status struct {
	Key string
	// Held reports whether a majority of nodes hold the key.
	Held bool
	// Remaining is how long a majority will still hold it.
	Remaining time.Duration
	// Last is the newest fencing record for key (Token 0 if none).
	Last fencing.Record
}

// majorityLease is the longest lease a majority of the Yes answers of t
// reported: the quorum-th longest (t has at least quorum of them).
func (l *Locker) majorityLease(t *tally) time.Duration {
	var rem []time.Duration
	for _, r := range t.results {
		if r.Outcome == Yes {
			rem = append(rem, r.Remaining)
		}
	}
	slices.SortFunc(rem, func(a, b time.Duration) int { return int(b - a) })
	return rem[l.quorum-1]
}

// Status reports whether key is held, by asking every node for its TTL.
func (l *Locker) Status(ctx context.Context, key string) (*Status, error) {
	rkey := keyspace.RedisKey(key)
	votes, _ := l.round(ctx, "ttl", nodeOp{sync: func(ctx context.Context, _ int, n Node) (bool, time.Duration, error) {
		d, err := n.TTL(ctx, rkey)
		return d > 0, d, err
	}}, nil, nil)
	t := &tally{results: make([]NodeResult, len(l.nodes))}
	l.drain(t, votes)
	// A caller that left cut the reads short: that is no news of the nodes
	// or of Postgres.
	if t.yes < l.quorum && len(l.nodes)-t.no >= l.quorum {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("status %q: %w", key, err)
		}
		return nil, &Error{Op: "status", Key: key, Err: ErrQuorum, Nodes: t.results, Cause: nodeErrors(t.results)}
	}
	rec, err := l.last(ctx, key)
	if err != nil {
		if cerr := ctx.Err(); cerr != nil {
			return nil, fmt.Errorf("status %q: %w", key, cerr)
		}
		return nil, &Error{Op: "status", Key: key, Err: ErrFencing, Nodes: t.results, Cause: err}
	}
	st := &Status{Key: key, Last: rec}
	if t.yes >= l.quorum {
		st.Held = true
		st.Remaining = l.majorityLease(t)
	}
	return st, nil
}

// NodeStatus is one node's health.
type NodeStatus struct {
	Addr    string
	Up      bool
	Latency time.Duration
	Err     error
	// QuarantinedUntil is when the node's votes count again after it lost
	// its memory; zero when they count now.
	QuarantinedUntil time.Time
	// QuarantineReason says why, while QuarantinedUntil is set: one of the
	// Quarantine* constants.
	QuarantineReason string
}

// errRecordPending is the NodeStatus error of a node whose restart or loss
// of memory could not be recorded in the Registry yet.
var errRecordPending = errors.New("news of the node (a restart, a loss of memory or an eviction spell) could not be recorded in Postgres yet (retried every second; its votes do not count meanwhile)")

// Why a node's votes do not count (NodeStatus.QuarantineReason).
const (
	// QuarantineLostMemory: the node restarted without its data (its epoch
	// marker was gone, or a new process that does not fsync every write),
	// or another server recorded that it may have lost leases; a lease it
	// forgot may still be live until the quarantine ends.
	QuarantineLostMemory = "lost_memory"
	// QuarantineEvicting: the node has a maxmemory limit with an evicting
	// maxmemory-policy, so it may drop lock keys; the quarantine moves on
	// until it stops.
	QuarantineEvicting = "evicting"
	// QuarantinePolicyUnknown: the node's eviction policy cannot be read
	// (it refuses INFO, or its INFO memory has no maxmemory_policy), so
	// whether it may evict keys cannot be told; counted as if it evicted.
	QuarantinePolicyUnknown = "policy_unknown"
	// QuarantineEvicted: the node stopped evicting (or evicted keys in a
	// spell shorter than the check: its evicted_keys rose); a lease it
	// evicted may still be live until the quarantine ends.
	QuarantineEvicted = "evicted"
)

// legacyAdopter is a Node that may hold its marker under the key used before
// markers were kept per address (RedisNode). A known node, not quarantined,
// gets it carried over at Init, so that upgrading the servers does not make
// every node look restarted.
type legacyAdopter interface {
	AdoptLegacyMarker(ctx context.Context, epoch string) (bool, error)
}

// probeWrites runs n's write probe if it has one (see writeProber).
func probeWrites(ctx context.Context, n Node, epoch string) error {
	if p, ok := n.(writeProber); ok {
		return p.ProbeWrites(ctx, epoch)
	}
	return nil
}

// epochReader is a Node that reports its epoch marker without changing it
// (RedisNode does), so that Nodes finds a node that restarted without its
// data before an acquire does.
type epochReader interface {
	// Epoch returns the node's marker, or "" if it has none.
	Epoch(ctx context.Context) (string, error)
}

// writeProber is a Node that can check it takes a lock's writes (RedisNode
// does), so that Nodes finds a node that answers reads but refuses every
// acquire.
type writeProber interface {
	// ProbeWrites makes a write as an acquire does, checking the node's
	// marker against epoch if it is not "", and returns why it failed.
	ProbeWrites(ctx context.Context, epoch string) error
}

// Nodes asks every node in parallel and reports each one's health: it
// answers, and takes a lock's writes (see writeProber). A node that answers
// without the epoch marker this Locker expects lost its memory: its
// quarantine starts then (as when an acquire finds it) and is reported.
func (l *Locker) Nodes(ctx context.Context) []NodeStatus {
	var recovering sync.Map // node index -> chan struct{}: its recovery
	var found sync.Map      // node index -> the marker it held, when not the one expected
	votes, _ := l.round(ctx, "ping", nodeOp{sync: func(ctx context.Context, i int, n Node) (bool, time.Duration, error) {
		er, ok := n.(epochReader)
		epoch, _ := l.members[i].state()
		if !ok || epoch == "" || l.opts.Registry == nil {
			if err := n.Ping(ctx); err != nil {
				return true, 0, err
			}
			return true, 0, probeWrites(ctx, n, "")
		}
		got, err := er.Epoch(ctx)
		if err == nil && got != epoch {
			found.Store(i, got)
			if done := l.recover(i, l.members[i].lossReq(epoch), false); done != nil {
				recovering.Store(i, done)
			}
			return true, 0, nil // reported as quarantined, or as not recorded
		}
		if err != nil {
			return true, 0, err
		}
		return true, 0, probeWrites(ctx, n, epoch)
	}}, nil, nil)
	t := &tally{results: make([]NodeResult, len(l.nodes))}
	l.drain(t, votes)
	// Recoveries already under way count too: a node counted out only
	// until the Registry answers for a process it has just seen (a first
	// sight after Init, often at start) would otherwise be reported as
	// quarantined for a quarantine's length, which it may never be. Not
	// one whose recording failed already: it is retried every second, and
	// waiting for it would hold up every /readyz and /v1/nodes meanwhile.
	for i, m := range l.members {
		m.mu.Lock()
		if done := m.recovery; done != nil && m.recordErr == nil {
			recovering.LoadOrStore(i, done)
		}
		m.mu.Unlock()
	}
	// A recovery that cannot be recorded is retried in the background:
	// wait for it no longer than one recording may take.
	wait := time.NewTimer(l.opts.IssueTimeout)
	defer wait.Stop()
	recovering.Range(func(_, v any) bool {
		select {
		case <-v.(chan struct{}):
			return true
		case <-ctx.Done():
		case <-wait.C:
		}
		return false
	})
	out := make([]NodeStatus, len(l.nodes))
	for i, r := range t.results {
		out[i] = NodeStatus{Addr: r.Addr, Up: r.Outcome == Yes, Latency: r.Latency, Err: r.Err}
		m := l.members[i]
		now := l.opts.Now()
		m.mu.Lock()
		epoch, until, recErr := m.epoch, m.end(), m.recordErr
		if m.evicting != "" || m.unrecorded { // counted out for as long as it may evict, and then some
			until = later(until, now.Add(l.quarantineFor()))
		}
		reason := QuarantineLostMemory
		switch {
		case m.evicting == policyRefused || m.evicting == policyUnreported:
			reason = QuarantinePolicyUnknown
		case m.evicting == evictedSpell:
			reason = QuarantineEvicted
		case m.evicting != "":
			reason = QuarantineEvicting
		case !m.unrecorded && m.evictEnd.After(now) && !m.evictEnd.Before(m.until):
			reason = QuarantineEvicted
		}
		m.mu.Unlock()
		if recErr != nil {
			// Counted out until what it was found with is recorded (and
			// quarantined then). Why the Registry failed is logged: it is
			// not the node's error (a Postgres "connection refused" must
			// not read as the node's).
			out[i].Up = false
			out[i].Err = errRecordPending
			out[i].QuarantinedUntil, out[i].QuarantineReason = until, reason
			continue
		}
		if until.After(now) {
			out[i].QuarantinedUntil, out[i].QuarantineReason = until, reason
			continue
		}
		if got, ok := found.Load(i); ok && got.(string) != epoch {
			// Not quarantined, yet not the marker of the epoch on record
			// (which a server merely behind has just adopted): recording
			// the loss failed, and every acquire on it is refused.
			out[i].Up = false
			out[i].Err = errors.New("the node lost its memory (no epoch marker of the recorded epoch) and its quarantine could not be recorded")
		}
	}
	return out
}
