// Package service is Redfence's lock manager: the Redlock algorithm over N
// independent Redis masters, with a fencing token issued for every grant.
//
// Guarantees: a grant is returned only when a majority of nodes accepted the
// lock within its validity (ttl - elapsed - drift) and a fencing token larger
// than every earlier one for that key was durably issued; validity is checked
// again after issuance, so token order equals grant order. Every failed attempt
// deletes whatever it set on every node before Acquire returns.
//
// Not guaranteed: mutual exclusion under process pauses, clock jumps or nodes
// that forget keys — Redlock is a lease, and leases expire while their holder
// is paused. That is what the fencing token is for: a storage layer that checks
// it refuses the stale holder's writes.
package service

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log/slog"
	mathrand "math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/inflight"
)

// Issuer issues fencing tokens and tells which grant a token belongs to.
type Issuer interface {
	fencing.Issuer
	// Last returns the record of the newest token issued for key; its Token
	// is 0 when none was ever issued.
	Last(ctx context.Context, key string) (fencing.Record, error)
}

// Registry records, for every server sharing the nodes, each node's epoch (the
// marker that proves it kept its memory) and how long it is quarantined after
// losing it. A quarantine's end is kept on the registry's clock and reported
// as the time left, so servers whose clocks are set differently still agree
// on it (each counts the time left on its own monotonic clock).
type Registry interface {
	// RegisterNode records addr with epoch unless addr is known, and returns
	// addr's epoch and the time left of its quarantine (0 if none); created
	// reports that addr was unknown. An address first seen while some
	// server may hold a lease starts quarantined as QuarantineNode would
	// (it may be a known node under another address, just restarted).
	// Before it records an unknown addr, it calls check (unless nil): an
	// error leaves no record and is returned. Until check has returned, no
	// server learns of the record: a concurrent RegisterNode of addr waits
	// for it, then finds addr known, or unknown if check failed (and then
	// checks it itself), so no server adopts an epoch that check refuses.
	RegisterNode(ctx context.Context, addr, epoch string, check func(ctx context.Context) error) (cur string, left time.Duration, created bool, err error)
	// QuarantineNode records that addr no longer holds the marker expected,
	// or, with a runID, that its Redis process restarted as runID (durable:
	// it fsyncs every write): if addr's epoch is still expected, or runID is
	// not the process on record (no server handled this restart yet), it
	// sets next as the epoch, records runID and durable, and quarantines
	// addr for d from now (never shortening a running quarantine). It
	// returns addr's epoch and the time left of its quarantine after that
	// (0 if none).
	QuarantineNode(ctx context.Context, addr, expected, next, runID string, durable bool, d time.Duration) (cur string, left time.Duration, err error)
	// NodeProcess records that addr's Redis process is runID, durable (it
	// fsyncs every write) or not, as found by a server that was not
	// watching the node before, or that saw it restart with every write
	// kept. If the record names another process, the node restarted (perhaps
	// from a snapshot without the locks written since): unless both that
	// process and runID are durable, or no server may still hold a lease,
	// it sets next as the epoch and quarantines addr for as long as the
	// servers that may hold leases need. It returns addr's epoch and the
	// time left of its quarantine (0 if none).
	NodeProcess(ctx context.Context, addr, runID, next string, durable bool) (cur string, left time.Duration, err error)
	// Heartbeat records that the server id runs and that its leases need a
	// quarantine of at least quarantine. QuarantineNode then quarantines
	// for at least the longest quarantine of the servers that may still
	// hold a lease: those whose last heartbeat is younger than their
	// quarantine plus grace. So servers configured with different MaxTTLs
	// agree on a safe one. It records nodes too, the addresses of the
	// server's nodes, sorted; the first heartbeat (and one after the server
	// stopped counting) fails, recording nothing, when a server that may
	// still hold a lease lists other nodes, as majorities of the two lists
	// need not overlap. Init fails then.
	Heartbeat(ctx context.Context, id string, quarantine, grace time.Duration, nodes []string) error
}

const (
	// heartbeatEvery is how often a Locker with a Registry renews its
	// Heartbeat.
	heartbeatEvery = time.Second
	// heartbeatGrace is how long the registry counts a server past its
	// last heartbeat, beyond its quarantine. A Locker grants and extends
	// only while its last successful heartbeat began less than half of it
	// ago, so every lease it grants ends while the registry still counts
	// it.
	heartbeatGrace = 20 * time.Second
)

// quarantineEnd is the end, on the Locker's clock, of a quarantine with left
// to run as reported by the Registry now (zero if none). Counted from after
// the answer arrived, it ends no earlier than on the registry's clock.
func (l *Locker) quarantineEnd(left time.Duration) time.Time {
	if left <= 0 {
		return time.Time{}
	}
	return l.opts.Now().Add(left)
}

// Observer receives measurements from a Locker (for metrics). Its methods
// must be cheap and safe for concurrent use.
type Observer interface {
	// NodeOp reports one request to one node: op is acquire, extend, release,
	// ttl, ping or sweep (a delete sent again, see sweeper). A request cut
	// short because its caller left is not reported.
	NodeOp(addr, op string, outcome Outcome, d time.Duration)
	// Waiting reports a blocking acquire starting (+1) or ending (-1) a wait.
	Waiting(delta int)
	// Quarantine reports that a node's votes are not counted until until
	// (a zero time: counted again).
	Quarantine(addr string, until time.Time)
}

type nopObserver struct{}

func (nopObserver) NodeOp(string, string, Outcome, time.Duration) {}
func (nopObserver) Waiting(int)                                   {}
func (nopObserver) Quarantine(string, time.Time)                  {}

// Options tunes a Locker. Zero fields take the documented defaults.
type Options struct {
	// NodeTimeout bounds each request to one node. The default is 50ms.
	NodeTimeout time.Duration
	// DriftFactor scales the clock-drift allowance: drift = ttl*DriftFactor + 2ms.
	// The default is 0.01.
	DriftFactor float64
	// MinTTL is the shortest TTL accepted. The default is 100ms.
	MinTTL time.Duration
	// MaxTTL bounds every TTL and extension: at most 24h. The default is
	// 60s.
	MaxTTL time.Duration
	// MaxWait bounds how long Acquire may wait for a held lock. The default is 60s.
	MaxWait time.Duration
	// RetryDelayMin and RetryDelayMax bound the random delay between attempts
	// of a blocking acquire. The defaults are 10ms and 100ms.
	RetryDelayMin, RetryDelayMax time.Duration
	// IssueTimeout bounds fencing-token issuance. The default is 2s; issuance
	// that outlives the lease fails the grant anyway.
	IssueTimeout time.Duration
	// Now returns the current time, with a monotonic reading. The default is time.Now.
	Now func() time.Time
	// Rand supplies jitter. The default is a ChaCha8 source seeded from crypto/rand.
	Rand mathrand.Source
	// TokenSource supplies lock-token bytes. The default is crypto/rand.Reader.
	TokenSource io.Reader
	// Observer receives measurements. The default discards them.
	Observer Observer
	// Registry makes the Locker detect nodes that restarted without their
	// data and not count their votes until MaxTTL (+ drift) has passed, so
	// no lease they forgot can still be live. Nil disables that protection:
	// only fault tests that show what it prevents may leave it nil.
	Registry Registry
	// Logger receives node quarantine events. The default discards them.
	Logger *slog.Logger
	// AfterQuorum, if set, runs after a quorum is won and before the fencing
	// token is issued (or a speculative one confirmed). It is a test hook for
	// stalling a grant at that point.
	AfterQuorum func(ctx context.Context, key string)
	// NoSpeculation turns speculative issuance off: every token is then
	// issued after its quorum. Speculation (used when the issuer is a
	// fencing.Speculator) lets a try that runs alone issue its token while
	// its round runs, when the key's newest token belongs to a grant this
	// Locker saw released, or the key never had one; it is confirmed after
	// the quorum, so token order stays grant order.
	NoSpeculation bool
}

func (o *Options) setDefaults() {
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&o.NodeTimeout, 50*time.Millisecond)
	def(&o.MinTTL, 100*time.Millisecond)
	def(&o.MaxTTL, 60*time.Second)
	def(&o.MaxWait, 60*time.Second)
	def(&o.RetryDelayMin, 10*time.Millisecond)
	def(&o.RetryDelayMax, 100*time.Millisecond)
	def(&o.IssueTimeout, 2*time.Second)
	if o.RetryDelayMax < o.RetryDelayMin {
		o.RetryDelayMax = o.RetryDelayMin
	}
	if o.DriftFactor <= 0 {
		o.DriftFactor = 0.01
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Rand == nil {
		var seed [32]byte
		_, _ = rand.Read(seed[:])
		o.Rand = mathrand.NewChaCha8(seed)
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Observer == nil {
		o.Observer = nopObserver{}
	}
	if o.TokenSource == nil {
		o.TokenSource = rand.Reader
	}
}

// member is a node with what this server knows of its memory.
type member struct {
	Node
	mu    sync.Mutex
	epoch string    // the marker the node must hold; "" checks nothing
	until time.Time // votes do not count before this, as last recorded
	// unrecorded says news of the node (a restart, a process not checked
	// against the record yet) is not recorded yet, or failed to be: its
	// votes do not count until a recording that covers its current process
	// succeeds (see recover, which retries).
	unrecorded bool
	// evictEnd is the end of the quarantine after an eviction spell, which
	// no answer of the Registry shortens.
	evictEnd time.Time
	// recordErr is why the last recording failed, while unrecorded; nil
	// otherwise.
	recordErr error
	// recovery is closed when the node's recoveries (see recover) have all
	// run (nil: none runs); queued are those behind the one under way, run
	// one at a time in order. Guarded by mu.
	recovery chan struct{}
	queued   []recoveryReq
	// runID is the run_id of the Redis process last seen behind the node
	// ("" before the first), and durable whether it fsyncs every write; a
	// new run_id means the node restarted. Guarded by mu.
	runID   string
	durable bool
	// evicting is the node's maxmemory-policy while it may evict keys: its
	// votes do not count then (see evict.go); evictRecorded says the spell
	// was recorded in the Registry. Guarded by mu.
	evicting      string
	evictRecorded bool
	// evictedKeys is the node's count of evicted keys (INFO stats
	// evicted_keys) at the last check, -1 before the first or when the
	// node does not report it. Guarded by mu.
	evictedKeys int64
	// evictedUnreported is set once a node that answered INFO stats
	// without evicted_keys was warned of. Guarded by mu.
	evictedUnreported bool
	// endLogged is the end of the last quarantine logged as over (see
	// watchQuarantine). Guarded by mu.
	endLogged time.Time
}

// state returns the node's epoch and the end of its quarantine as far as it
// is known (see end; an unrecorded node does not count either).
func (m *member) state() (epoch string, until time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.epoch, m.end()
}

// end is the end of the node's quarantine as far as it is known: the later
// of until and evictEnd. m.mu is held.
func (m *member) end() time.Time { return later(m.until, m.evictEnd) }

// adopt sets the epoch on record and extends the quarantine to until.
func (m *member) adopt(epoch string, until time.Time) {
	m.mu.Lock()
	m.epoch = epoch
	if until.After(m.until) {
		m.until = until
	}
	m.mu.Unlock()
}

// Locker grants, extends and releases locks. It is safe for concurrent use.
type Locker struct {
	nodes   []Node
	members []*member
	issuer  Issuer
	opts    Options
	quorum  int

	randMu sync.Mutex
	rand   *mathrand.Rand

	// waiters queues, per key, the acquires in this process that wait for
	// it, first come first served: only the first one tries, and a release
	// here wakes it (no thundering herd). It also retries after a jittered
	// delay, which is how releases elsewhere and expiries reach it.
	waitMu  sync.Mutex
	waiters map[string]*waitQueue
	// watchers are the nodes that announce releases (see ReleaseWatcher).
	watchers []ReleaseWatcher

	// late holds, per lock token, the granting round of a grant whose slower
	// nodes had not answered when it was returned (see lateRound).
	lateMu sync.Mutex
	late   map[string]*lateRound
	// releasing holds, per key and lock token, a release whose slower
	// nodes are still answering; a repeated release waits for it, so it
	// sees the outcome of the first (409 not-holder) rather than racing it.
	releasing map[keyToken]chan struct{}

	// reach tracks which nodes answer, for the log (see noteReach).
	reach *reach

	// speculator is the issuer if it can speculate and speculation is on.
	speculator fencing.Speculator
	// tries counts the tries running: one that runs alone may speculate.
	tries atomic.Int32
	// specMu guards recent and pending.
	specMu sync.Mutex
	// recent remembers, per key, the last grant of this Locker and whether
	// it was released since (see speculable); at most maxRecent keys.
	recent map[string]recentGrant
	// pending holds the speculations running, per key.
	pending map[string]*pending

	// sweep redelivers the deletes whose outcome is unknown.
	sweep *sweeper
	// ops counts the rounds whose nodes have not all answered and the
	// clean-ups under way: Close waits for them (see Close).
	ops inflight.Counter

	// life ends when Close is called; background work (recoveries, the
	// heartbeat) runs under it, and Close waits for it (bg). None starts
	// once life has ended: it is ended, and bg added to, under bgMu.
	life   context.Context
	cancel context.CancelFunc
	bgMu   sync.Mutex
	// beating is set once the heartbeat started (under bgMu); lastBeat is
	// when its last success began (under beatMu).
	beating  bool
	beatMu   sync.Mutex
	lastBeat time.Time
	bg       sync.WaitGroup
	// evictionChecks is set once they started (under bgMu; see evict.go).
	evictionChecks bool
	// evictionMu runs one checkEviction at a time, so that an older count
	// of evicted keys is never noted after a newer one (it would read as
	// a reset: every key evicted since would count as new).
	evictionMu sync.Mutex
}

// lateRound is the clean-up state of one acquire round, shared by its nodes'
// answers and the decision. Until the round is decided, the nodes that
// answer are only noted; the decision deletes what they may have set if the
// try failed. A node that answers after the decision deletes what it set
// itself if the try failed, or if the grant was already released (its SET
// may have come after the release's DEL). A granted round with nodes still
// to answer is kept in Locker.late so that Release can mark it released.
type lateRound struct {
	// rkey is the round's key: only a release of this key marks it.
	rkey    string
	mu      sync.Mutex
	decided bool
	failed  bool
	// wrote lists the nodes that answered before the decision and may have
	// set the key.
	wrote    []wroteNode
	released bool
	// left counts the nodes still to answer; tracked says the round is in
	// Locker.late, and the last node to answer removes it.
	left    int
	tracked bool
}

// wroteNode is a node that may have set a round's key: it said yes, or it
// gave no answer (unsure).
type wroteNode struct {
	i      int
	unsure bool
}

// New returns a Locker over nodes that issues tokens from issuer.
func New(nodes []Node, issuer Issuer, opts Options) (*Locker, error) {
	if len(nodes) == 0 {
		return nil, errors.New("service: no nodes")
	}
	if issuer == nil {
		return nil, errors.New("service: no fencing-token issuer")
	}
	opts.setDefaults()
	seen := make(map[string]bool, len(nodes))
	for _, n := range nodes {
		a := strings.ToLower(n.Addr())
		if seen[a] {
			return nil, fmt.Errorf("service: node %s is listed twice: %w", n.Addr(), ErrSameServer)
		}
		seen[a] = true
	}
	if opts.MinTTL > opts.MaxTTL {
		return nil, fmt.Errorf("service: min TTL %v above max TTL %v", opts.MinTTL, opts.MaxTTL)
	}
	if opts.MaxTTL > maxMaxTTL {
		return nil, fmt.Errorf("service: max TTL %v above %v", opts.MaxTTL, maxMaxTTL)
	}
	members := make([]*member, len(nodes))
	for i, n := range nodes {
		members[i] = &member{Node: n, evictedKeys: -1}
	}
	l := &Locker{
		nodes:     nodes,
		members:   members,
		issuer:    issuer,
		opts:      opts,
		quorum:    len(nodes)/2 + 1,
		rand:      mathrand.New(opts.Rand),
		waiters:   make(map[string]*waitQueue),
		late:      make(map[string]*lateRound),
		releasing: make(map[keyToken]chan struct{}),
		recent:    make(map[string]recentGrant),
		pending:   make(map[string]*pending),
	}
	l.life, l.cancel = context.WithCancel(context.Background())
	l.sweep = newSweeper(l)
	l.reach = newReach(len(nodes))
	if s, ok := issuer.(fencing.Speculator); ok && !opts.NoSpeculation {
		l.speculator = s
	}
	for _, n := range nodes {
		if w, ok := n.(ReleaseWatcher); ok {
			w.OnRelease(l.announced)
			l.watchers = append(l.watchers, w)
		}
	}
	return l, nil
}

// Close stops the Locker's background work and waits for it: the
// redelivery of deletes whose outcome is unknown (see sweeper) and the
// recording of node restarts (see recover). First it lets the node calls
// under way end (each within NodeTimeout: the rounds still waiting for a
// node, and the deletes of failed tries), then sends the deletes still in
// doubt once more, so that the nodes closed after it are not left holding
// keys of tries that failed (they would refuse the names to everyone until
// their TTL). It closes neither the nodes nor the issuer; the Locker still
// serves calls, but such deletes are no longer retried, and a node found
// restarted is counted out without a recorded quarantine.
func (l *Locker) Close() {
	// A round ends within NodeTimeout, and the deletes it starts on late
	// answers within another.
	ctx, cancel := context.WithTimeout(context.Background(), 2*l.opts.NodeTimeout+100*time.Millisecond)
	l.ops.Wait(ctx)
	cancel()
	l.bgMu.Lock()
	l.cancel()
	l.bgMu.Unlock()
	l.sweep.close()
	l.bg.Wait()
}

// Quorum returns the number of nodes that must agree: N/2+1.
func (l *Locker) Quorum() int { return l.quorum }

// Options returns the effective options (defaults filled in).
func (l *Locker) Options() Options { return l.opts }
