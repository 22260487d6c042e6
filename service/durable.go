package service

// Durability at run time: a node whose Redis fsyncs every write (appendonly
// yes, appendfsync always) keeps its leases across a restart, so its
// restart is not a loss (see seen). If its AOF is switched off, or made
// lazier, at run time (CONFIG SET), what it is written from then on can be
// lost in a crash: a restart with the old AOF brings back the epoch marker
// without the leases granted since. So each Locker reads, with the eviction
// check (every evictionCheckEvery), the durability of every node it holds
// durable, and records a node that no longer is: its next restart is then
// quarantined, by every server, whatever its settings when it comes back.

import (
	"context"
	"log/slog"
)

// durabilityReader is a Node that reports whether it fsyncs every write
// (RedisNode does).
type durabilityReader interface {
	// FsyncsAll reports whether the node's server fsyncs every write before
	// answering; false if it refuses to say.
	FsyncsAll(ctx context.Context) (bool, error)
}

// FsyncsAll implements durabilityReader (see fsyncsAll). A node that refuses
// CONFIG is not known to be durable: false.
func (n *RedisNode) FsyncsAll(ctx context.Context) (bool, error) {
	return fsyncsAll(ctx, n.client)
}

// checkDurability reads whether node i, held durable, still is, and records
// it as not durable if not (see above). A node that does not answer keeps
// its state.
func (l *Locker) checkDurability(ctx context.Context, i int, n Node) {
	dr, ok := n.(durabilityReader)
	if !ok {
		return
	}
	m := l.members[i]
	m.mu.Lock()
	runID, durable := m.runID, m.durable
	m.mu.Unlock()
	if !durable || runID == "" {
		return
	}
	still, err := dr.FsyncsAll(ctx)
	if err != nil || still {
		return
	}
	m.mu.Lock()
	if m.runID != runID || !m.durable {
		m.mu.Unlock() // a restart seen meanwhile (its own check), or recorded already
		return
	}
	m.durable = false
	l.durabilityLostLocked(i)
}

// durabilityLostLocked records that the process behind node i, held durable
// until now, no longer fsyncs every write: as the process behind the node,
// not durable (no quarantine: it has lost nothing yet), retried until it is
// recorded (meanwhile the node does not count if recording fails). m.mu is
// held, and unlocked.
func (l *Locker) durabilityLostLocked(i int) {
	m := l.members[i]
	l.recoverLocked(i, recoveryReq{runID: m.runID, durable: false, unseen: true}, false)
	l.opts.Logger.Warn("node no longer fsyncs every write (appendonly or appendfsync changed at run time, or CONFIG refused): its next restart is treated as a loss of its leases, whatever its settings then",
		slog.String("node", m.Addr()))
}
