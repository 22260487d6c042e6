package service

// Eviction: a Redis node with a maxmemory limit and an evicting
// maxmemory-policy (allkeys-*, volatile-*) drops keys to stay under it, lock
// keys included (they carry a TTL, which volatile-* policies pick from). A
// node that evicted a live lease would vote yes for a second holder, so a
// node that may evict is counted out: its votes do not count while it may,
// nor for a quarantine after it stopped (a lease it evicted meanwhile ends
// within MaxTTL). Each Locker checks every node's policy at Init and then
// every evictionCheckEvery, through INFO memory, which managed servers that
// refuse CONFIG still answer. The first finding is also recorded as a
// quarantine for every server (as for a restart).

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"
)

// evictionCheckEvery is how often a Locker reads every node's eviction
// policy: a node configured to evict at run time (CONFIG SET) is counted out
// within it.
const evictionCheckEvery = time.Second

// evictionReader is a Node that reports whether it may evict keys
// (RedisNode does).
type evictionReader interface {
	// EvictionPolicy returns the node's maxmemory-policy when the node may
	// evict keys, "" when it never does.
	EvictionPolicy(ctx context.Context) (string, error)
}

// EvictionPolicy implements evictionReader: it returns the node's
// maxmemory-policy when it has a maxmemory limit and a policy that evicts
// keys to stay under it; "" when it never evicts (maxmemory 0, or policy
// noeviction).
func (n *RedisNode) EvictionPolicy(ctx context.Context) (string, error) {
	info, err := n.client.Info(ctx, "memory").Result()
	if err != nil {
		return "", fmt.Errorf("info memory: %w", refusal(err))
	}
	return evictionPolicy(info)
}

// evictionPolicy reads an INFO memory answer (see RedisNode.EvictionPolicy).
func evictionPolicy(info string) (string, error) {
	var limit, policy string
	for line := range strings.Lines(info) {
		line = strings.TrimSpace(line)
		if v, ok := strings.CutPrefix(line, "maxmemory:"); ok {
			limit = v
		} else if v, ok := strings.CutPrefix(line, "maxmemory_policy:"); ok {
			policy = v
		}
	}
	if limit == "" || policy == "" {
		return "", errNoPolicy
	}
	if limit == "0" || policy == "noeviction" {
		return "", nil
	}
	return policy, nil
}

// policyRefused is noted as the eviction policy of a node that refuses
// INFO, and policyUnreported of one whose INFO memory does not say (a proxy
// in front of it, say): it may evict, for all Redfence can tell.
const (
	policyRefused    = "unknown (INFO refused: allow the Redis user +info)"
	policyUnreported = "unknown (INFO memory has no maxmemory or maxmemory_policy)"
)

// errNoPolicy is evictionPolicy's error for an INFO memory answer without
// maxmemory or maxmemory_policy.
var errNoPolicy = errors.New("info memory: no maxmemory or maxmemory_policy")

// checkEviction reads every node's eviction policy in parallel, each within
// NodeTimeout, and notes it; then, each within NodeTimeout again, whether a
// node held durable still is (see checkDurability). A node that does not
// answer keeps its state.
func (l *Locker) checkEviction(ctx context.Context) {
	defer l.eachNode(ctx, l.checkDurability)
	l.eachNode(ctx, func(ctx context.Context, i int, n Node) {
		if er, ok := n.(evictionReader); ok {
			policy, err := er.EvictionPolicy(ctx)
			switch {
			case err == nil:
				l.noteEviction(i, policy)
			case errors.Is(err, ErrCommandRefused):
				// Unknown, so counted out as if it evicted.
				l.noteEviction(i, policyRefused)
			case errors.Is(err, errNoPolicy):
				l.noteEviction(i, policyUnreported)
			}
		}
	})
}

// noteEviction records node i's eviction policy ("" when it cannot evict).
// While it may evict, the node is counted out; once it stops, a quarantine
// covers the leases it may have evicted.
func (l *Locker) noteEviction(i int, policy string) {
	m := l.members[i]
	now := l.opts.Now()
	m.mu.Lock()
	was := m.evicting
	m.evicting = policy
	if policy != "" || was != "" {
		// No answer of the Registry about other news ends it.
		m.evictEnd = later(m.evictEnd, now.Add(l.quarantineFor()))
	}
	until, epoch := m.end(), m.epoch
	// Recorded once per evicting spell, as soon as the node's epoch is known
	// (Init registered it).
	record := policy != "" && !m.evictRecorded && epoch != ""
	m.evictRecorded = policy != "" && (m.evictRecorded || record)
	req := recoveryReq{runID: m.runID, durable: m.durable, evict: true}
	m.mu.Unlock()
	if record {
		l.recover(i, req, false) // a quarantine for the other servers too
	}
	switch {
	case policy == policyRefused && was == "":
		l.opts.Observer.Quarantine(m.Addr(), until)
		l.opts.Logger.Warn("node refuses INFO: whether it may evict lock keys (or restarted) cannot be told, so its votes do not count until it answers INFO again and every lease it may have lost has expired; allow the Redis user +info",
			slog.String("node", m.Addr()))
	case policy == policyUnreported && was == "":
		l.opts.Observer.Quarantine(m.Addr(), until)
		l.opts.Logger.Warn("node's INFO memory has no maxmemory or maxmemory_policy: whether it may evict lock keys cannot be told, so its votes do not count until it says and every lease it may have lost has expired; connect Redfence to the Redis server itself, not a proxy",
			slog.String("node", m.Addr()))
	case policy != "" && was == "":
		l.opts.Observer.Quarantine(m.Addr(), until)
		l.opts.Logger.Warn("node may evict lock keys (a maxmemory limit with an evicting maxmemory-policy): its votes do not count while it may, nor until every lease it may have evicted has expired; set maxmemory-policy noeviction",
			slog.String("node", m.Addr()), slog.String("maxmemory_policy", policy))
	case policy != "":
		l.opts.Observer.Quarantine(m.Addr(), until)
	case was != "":
		l.opts.Observer.Quarantine(m.Addr(), until)
		l.opts.Logger.Warn("node no longer evicts keys: its votes count again once every lease it may have evicted has expired",
			slog.String("node", m.Addr()), slog.Time("quarantined_until", until))
	}
	if (policy == "") != (was == "") {
		// A spell began or ended (not every check while it lasts): its
		// end is logged, and the counting majority checked.
		l.watchQuarantine(i, until)
	}
}

// startEvictionChecks checks every node's eviction policy now, then every
// evictionCheckEvery until Close (once: a second Init starts no other).
func (l *Locker) startEvictionChecks(ctx context.Context) {
	l.checkEviction(ctx)
	l.every(&l.evictionChecks, evictionCheckEvery, func() { l.checkEviction(l.life) })
}
