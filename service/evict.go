package service

// Eviction: a Redis node with a maxmemory limit and an evicting
// maxmemory-policy (allkeys-*, volatile-*) drops keys to stay under it, lock
// keys included (they carry a TTL, which volatile-* policies pick from). A
// node that evicted a live lease would vote yes for a second holder, so a
// node that may evict is counted out: its votes do not count while it may,
// nor for a quarantine after it stopped (a lease it evicted meanwhile ends
// within MaxTTL). Each Locker checks every node's policy at Init and then
// every evictionCheckEvery, through INFO memory, which managed servers that
// refuse CONFIG still answer. The same check reads the node's count of
// evicted keys (INFO stats): a node that evicted keys since the last check
// is counted out the same way even if it does not evict any more, so a
// spell shorter than the check (a limit set and undone at once) is not
// missed. The first finding is also recorded as a quarantine for every
// server (as for a restart).

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// evictionCheckEvery is how often a Locker reads every node's eviction
// policy and count of evicted keys (and the durability of the nodes it
// holds durable): a node configured to evict at run time (CONFIG SET), or
// that evicted keys, is counted out within it. Each check is a pipeline of
// two INFO sections per node (and a CONFIG GET per durable node): a few
// commands a second per node, against the thousands a lock takes.
const evictionCheckEvery = 250 * time.Millisecond

// evictionReader is a Node that reports whether it may evict keys, and
// whether it did (RedisNode does).
type evictionReader interface {
	// Eviction returns the node's maxmemory-policy when the node may evict
	// keys ("" when it never does), and how many keys it evicted since its
	// process started or its statistics were reset (-1 if it does not say,
	// evictedFailed if it did not answer).
	Eviction(ctx context.Context) (policy string, evicted int64, err error)
}

// Eviction implements evictionReader: the policy is the node's
// maxmemory-policy when it has a maxmemory limit and a policy that evicts
// keys to stay under it, "" when it never evicts (maxmemory 0, or policy
// noeviction); evicted is INFO stats' evicted_keys. Both are read in one
// pipeline, so they come from one process.
func (n *RedisNode) Eviction(ctx context.Context) (string, int64, error) {
	if err := n.conn.ready(ctx); err != nil {
		return "", -1, fmt.Errorf("info memory: %w", refusal(err))
	}
	var mem, stats *redis.StringCmd
	_, perr := n.client.Pipelined(ctx, func(p redis.Pipeliner) error {
		mem, stats = p.Info(ctx, "memory"), p.Info(ctx, "stats")
		return nil
	})
	n.conn.failed(errors.Join(mem.Err(), perr))
	// A connection that could not be opened (refused credentials, say)
	// fails the pipeline, not its commands.
	err := mem.Err()
	if err == nil && mem.Val() == "" && perr != nil {
		err = perr
	}
	if err != nil {
		return "", -1, fmt.Errorf("info memory: %w", refusal(err))
	}
	policy, err := evictionPolicy(mem.Val())
	evicted := int64(evictedFailed)
	if stats.Err() == nil {
		evicted = evictedKeys(stats.Val())
	}
	return policy, evicted, err
}

// evictedFailed is Eviction's count of evicted keys when INFO stats failed
// (a timeout): no reading, and nothing said about the node (-1 means it
// answered without evicted_keys).
const evictedFailed = -2

// evictedKeys reads evicted_keys from an INFO stats answer; -1 if it has
// none.
func evictedKeys(info string) int64 {
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "evicted_keys:"); ok {
			if n, err := strconv.ParseInt(v, 10, 64); err == nil && n >= 0 {
				return n
			}
			return -1
		}
	}
	return -1
}

// newEvictions records evicted, the node's evicted_keys now, and returns how
// many keys it evicted since the last reading: 0 at the first (a baseline:
// when those were evicted is unknown, and a quarantine recorded for them by
// a server that saw them is read from the Registry). A count lower than the
// last one started again from 0 (a restart, CONFIG RESETSTAT): all of it is
// new. A node that did not say (-1: no answer) keeps its last reading, to
// compare the next one with. m.mu is held.
func (m *member) newEvictions(evicted int64) int64 {
	last := m.evictedKeys
	if evicted < 0 {
		return 0
	}
	m.evictedKeys = evicted
	switch {
	case last < 0:
		return 0
	case evicted >= last:
		return evicted - last
	default:
		return evicted
	}
}

// evictedSpell is noted as the eviction policy of a node that does not
// evict now but evicted keys since the last check (see checkEviction).
const evictedSpell = "noeviction now, but keys were evicted since the last check"

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
// noteCheckReach tells noteReach when a background check of node i got no
// answer (err a timeout or a connection failure), so that tries stop
// speculating before a round meets the node. An answer is not news: a node
// that answers INFO may still refuse a lock's writes (memory full, writes
// paused), which only a round finds, and only a round that it answers says
// it is back. Nothing is noted once ctx ended (the Locker is closing).
func (l *Locker) noteCheckReach(ctx context.Context, i int, err error) {
	var re redis.Error
	var ne net.Error
	switch {
	case err == nil, ctx.Err() != nil && errors.Is(err, context.Canceled),
		errors.Is(err, ErrCommandRefused), errors.Is(err, errNoPolicy), errors.As(err, &re):
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		l.noteReach(i, Timeout, err)
	default:
		l.noteReach(i, Failed, err)
	}
}

func (l *Locker) checkEviction(ctx context.Context) {
	l.evictionMu.Lock()
	defer l.evictionMu.Unlock()
	defer l.eachNode(ctx, l.checkDurability)
	l.eachNode(ctx, func(ctx context.Context, i int, n Node) {
		if er, ok := n.(evictionReader); ok {
			policy, evicted, err := er.Eviction(ctx)
			l.noteCheckReach(ctx, i, err)
			m := l.members[i]
			m.mu.Lock()
			fresh := m.newEvictions(evicted)
			warn := err == nil && evicted == -1 && !m.evictedUnreported
			m.evictedUnreported = m.evictedUnreported || warn
			m.mu.Unlock()
			if warn {
				l.opts.Logger.Warn("node's INFO stats has no evicted_keys: an eviction spell shorter than the check (a limit set and undone within a second) cannot be seen on it; connect Redfence to the Redis server itself, not a proxy",
					slog.String("node", m.Addr()))
			}
			switch {
			case err == nil:
				if fresh > 0 && policy == "" {
					// A spell that began and ended between two checks.
					policy = evictedSpell
				}
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
	if policy != "" || was != "" && was != evictedSpell {
		// No answer of the Registry about other news ends it. (A spell
		// seen by its evicted keys had ended when they were counted: its
		// quarantine ran from then.)
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
	case policy == evictedSpell && was == "":
		l.opts.Observer.Quarantine(m.Addr(), until)
		l.opts.Logger.Warn("node evicted keys since the last check, though it does not evict now (a maxmemory limit with an evicting policy came and went between two checks): its votes do not count until every lease it may have evicted has expired; set maxmemory-policy noeviction for good",
			slog.String("node", m.Addr()))
	case policy != "" && was == "":
		l.opts.Observer.Quarantine(m.Addr(), until)
		l.opts.Logger.Warn("node may evict lock keys (a maxmemory limit with an evicting maxmemory-policy): its votes do not count while it may, nor until every lease it may have evicted has expired; set maxmemory-policy noeviction",
			slog.String("node", m.Addr()), slog.String("maxmemory_policy", policy))
	case policy != "":
		l.opts.Observer.Quarantine(m.Addr(), until)
	case was == evictedSpell:
		l.opts.Observer.Quarantine(m.Addr(), until) // no news: it had stopped when it was seen
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
