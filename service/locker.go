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
	"crypto/sha1" //nolint:gosec // matches Redis' sha1hex; not a security use
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	mathrand "math/rand/v2"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/inflight"
	"github.com/redfence/redfence/internal/keyspace"
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

// Init registers the nodes with the Registry (a no-op without one): a node
// never seen before is marked with a fresh epoch (and starts quarantined if
// servers may hold leases, see Registry); a known node keeps the epoch on
// record, so if it restarted without its data while no server ran, the first
// acquire that reaches it finds the marker missing. A node whose Redis
// process is not the one on record restarted while no server watched it,
// perhaps from a snapshot that still holds the marker: it is quarantined as
// Registry.NodeProcess says. Then Init starts this server's heartbeat (see
// startHeartbeat) and the checks of the nodes' eviction policies (see
// evict.go), with or without a Registry.
func (l *Locker) Init(ctx context.Context) (err error) {
	procs, err := l.checkDistinct(ctx)
	if err != nil {
		return err
	}
	if l.opts.Registry == nil {
		l.startEvictionChecks(ctx)
		return nil
	}
	// The counting majority is logged once every node is recorded, not as
	// each one is.
	l.setIniting(true)
	defer func() {
		l.setIniting(false)
		if err == nil {
			l.noteCounting()
		}
	}()
	for i, m := range l.members {
		if rw, ok := m.Node.(restartWatcher); ok {
			m.mu.Lock()
			if m.runID == "" { // a second Init must not go back to an older process
				m.runID, m.durable = procs[i].id, procs[i].durable
			}
			m.mu.Unlock()
			if err := rw.WatchRestarts(l, func(_ context.Context, id string, durable bool) error {
				l.seen(i, id, durable)
				return nil
			}); err != nil {
				return fmt.Errorf("service: node %s: %w", m.Addr(), err)
			}
		}
	}
	for i, m := range l.members {
		epoch, err := newEpoch()
		if err != nil {
			return err
		}
		cur, left, created, err := l.opts.Registry.RegisterNode(ctx, m.Addr(), epoch, func(ctx context.Context) error {
			return l.checkForeign(ctx, m, epoch)
		})
		if errors.Is(err, ErrForeignNode) {
			return err
		}
		if err != nil {
			return fmt.Errorf("service: register node %s: %w", m.Addr(), err)
		}
		until := l.quarantineEnd(left)
		m.adopt(cur, until)
		if until.After(l.opts.Now()) {
			l.opts.Observer.Quarantine(m.Addr(), until)
		}
		if created {
			// Best effort: a node that is down now gets its marker when it
			// is first found without one (and is then quarantined once).
			mctx, cancel := context.WithTimeout(ctx, l.opts.NodeTimeout)
			_, _ = m.Mark(mctx, cur, false)
			cancel()
		} else if la, ok := m.Node.(legacyAdopter); ok {
			// Best effort too: if it fails, the node is quarantined once.
			// (The legacy key holding the epoch on record proves the node
			// kept its memory since it was marked, quarantine or not.)
			mctx, cancel := context.WithTimeout(ctx, l.opts.NodeTimeout)
			_, _ = la.AdoptLegacyMarker(mctx, cur)
			cancel()
		}
		m.mu.Lock()
		id, durable := m.runID, m.durable
		m.mu.Unlock()
		if id == "" {
			continue // down now: checked when first reached (see seen)
		}
		// Counted out until the Registry has answered: if it cannot, the
		// node stays out for the quarantine a restart would need.
		// A check that cannot be made in time is retried in the
		// background; the node is counted out until it is.
		if done := l.recover(i, recoveryReq{runID: id, durable: durable, unseen: true}, true); done != nil {
			wait := time.NewTimer(l.opts.IssueTimeout + l.opts.NodeTimeout)
			select {
			case <-done:
			case <-wait.C:
			case <-ctx.Done():
				wait.Stop()
				return fmt.Errorf("service: record the process of node %s: %w", m.Addr(), ctx.Err())
			}
			wait.Stop()
		}
	}
	if err := l.startHeartbeat(ctx); err != nil {
		return err
	}
	l.startEvictionChecks(ctx)
	return nil
}

// checkForeign returns an error matching ErrForeignNode if m, about to be
// registered with epoch cur (the Registry does not know it), already holds
// a marker: one that servers of another Registry wrote. It runs as
// RegisterNode's check, so the registration is not made then, and the next
// start checks again. A node that does not answer is not checked.
func (l *Locker) checkForeign(ctx context.Context, m *member, cur string) error {
	er, ok := m.Node.(epochReader)
	if !ok {
		return nil
	}
	mctx, cancel := context.WithTimeout(ctx, l.opts.NodeTimeout)
	got, err := er.Epoch(mctx)
	cancel()
	if err != nil || got == "" || got == cur {
		return nil
	}
	return fmt.Errorf("service: node %s: %w: its epoch marker (key %s) was not written by servers of this database. "+
		"Two deployments must not share Redis nodes, and the servers of one must share its database. "+
		"If the node's former deployment is gone for good, delete that key on the node; keep its database, whose fencing tokens a new one would issue again from 1",
		m.Addr(), ErrForeignNode, keyspace.NodeEpochKey(m.Addr()))
}

// setIniting sets whether Init is recording the nodes (see reach.initing).
func (l *Locker) setIniting(on bool) {
	l.reach.countMu.Lock()
	l.reach.initing = on
	l.reach.countMu.Unlock()
}

// serverIdentifier is a Node that can name the server process behind it
// (RedisNode: the run_id of INFO server) and tell whether that process
// fsyncs every write (appendonly yes, appendfsync always).
type serverIdentifier interface {
	ServerID(ctx context.Context) (id string, durable bool, err error)
}

// process is the server process found behind a node: its run_id ("" if
// unknown) and whether it fsyncs every write.
type process struct {
	id      string
	durable bool
}

// restartWatcher is a Node that reports the server process behind each new
// connection before the connection is used (RedisNode.WatchRestarts).
type restartWatcher interface {
	WatchRestarts(owner any, f func(ctx context.Context, runID string, durable bool) error) error
}

// seen notes that node i's server process is id, durable or not (see
// RedisNode.WatchRestarts; watched only with a Registry). A process other than the one seen before means
// the node restarted, and unless both it and the process before it fsync
// every write, it may have come back from an RDB snapshot or an AOF that
// missed the last writes: without locks written since, its epoch marker
// still there. (A process that fsyncs every write may have been started on
// the data of one that did not, or on a restored copy.) Its votes then stop
// counting at once, before the new connection carries a command, and the
// node is recovered as one that lost its memory (a quarantine recorded for
// every server, a new epoch). A first process seen after Init (the node was
// down then), and a restart that kept every write, are checked against the
// process on record (Registry.NodeProcess): the node's votes count again
// once the Registry has answered that no quarantine is needed.
func (l *Locker) seen(i int, id string, durable bool) {
	m := l.members[i]
	m.mu.Lock()
	prev, prevDurable := m.runID, m.durable
	epoch := m.epoch
	if prev == id {
		// The same process, on a new connection. Once found not fsyncing
		// every write, it stays so until it restarts (its writes since may
		// be lost then), and the finding is recorded (see durable.go).
		m.durable = prevDurable && durable
		if prevDurable && !durable && epoch != "" {
			l.durabilityLostLocked(i)
			return
		}
		m.mu.Unlock()
		return
	}
	m.runID, m.durable = id, durable
	if prev == "" && epoch == "" {
		// Before Init has registered the node (epoch ""), Init checks the
		// process itself.
		m.mu.Unlock()
		return
	}
	kept := prev != "" && durable && prevDurable
	// The node is counted out at once, until the Registry has answered
	// (recover's provisional quarantine, set under the same lock as the
	// new run_id: a connection whose hook finds that run_id already seen
	// carries commands at once).
	if prev == "" || kept {
		l.recoverLocked(i, recoveryReq{runID: id, durable: durable, unseen: true}, true)
		if kept {
			l.opts.Logger.Info("node restarted with appendfsync always, as it ran before: it kept its leases if its data survived (a request that finds its epoch marker gone quarantines it)", slog.String("node", m.Addr()))
		}
		return
	}
	// The recovery reports the quarantine if one runs: another server may
	// have handled this restart already (its quarantine over), and then the
	// node counts again as soon as the record is read. (nil: the Locker is
	// closed, and the provisional quarantine stands.)
	if l.recoverLocked(i, recoveryReq{seen: epoch, runID: id, durable: durable}, true) == nil {
		_, until := m.state()
		until = later(until, l.opts.Now().Add(l.quarantineFor()))
		l.opts.Observer.Quarantine(m.Addr(), until)
		l.opts.Logger.Warn("node restarted (new run_id): its votes do not count until every lease it may have forgotten has expired",
			slog.String("node", m.Addr()), slog.Time("quarantined_until", until))
	}
}

// checkDistinct returns an error matching ErrSameServer when two nodes
// answer as one server (an address spelt two ways, or a proxy in front of
// one server): that server would vote twice, and one matching
// ErrCommandRefused when a node refuses INFO (an ACL without +info):
// neither this check, nor the run_id that finds a restart from a snapshot,
// nor the eviction check could see it; and one matching ErrAuth when a node
// refuses the credentials. Nodes that do not answer within
// NodeTimeout are not checked. It returns the process found behind each
// node (a zero one for those).
func (l *Locker) checkDistinct(ctx context.Context) ([]process, error) {
	procs := make([]process, len(l.nodes))
	refused := make([]error, len(l.nodes))
	l.eachNode(ctx, func(ctx context.Context, i int, n Node) {
		si, ok := n.(serverIdentifier)
		if !ok {
			return
		}
		id, durable, err := si.ServerID(ctx)
		switch {
		case err == nil:
			procs[i] = process{id: id, durable: durable}
		case errors.Is(err, ErrAuth):
			// Not a node that is down: one this server may never reach.
			refused[i] = fmt.Errorf("service: node %s: %w; check the Redis user and password", n.Addr(), err)
		case errors.Is(err, ErrCommandRefused):
			refused[i] = fmt.Errorf("service: node %s: %w; allow the Redis user +info (see service.RedisACL)", n.Addr(), err)
		}
	})
	if err := errors.Join(refused...); err != nil {
		return nil, err
	}
	first := make(map[string]int, len(procs))
	for i, p := range procs {
		if p.id == "" {
			continue
		}
		if j, ok := first[p.id]; ok {
			return nil, fmt.Errorf("service: nodes %s and %s answer as one Redis server (run_id %s); list each server once: %w",
				l.nodes[j].Addr(), l.nodes[i].Addr(), p.id, ErrSameServer)
		}
		first[p.id] = i
	}
	return procs, nil
}

// eachNode calls f for every node in parallel, each with a context bounded
// by NodeTimeout, and returns when every call has.
func (l *Locker) eachNode(ctx context.Context, f func(ctx context.Context, i int, n Node)) {
	var wg sync.WaitGroup
	for i, n := range l.nodes {
		wg.Go(func() {
			nctx, cancel := context.WithTimeout(ctx, l.opts.NodeTimeout)
			defer cancel()
			f(nctx, i, n)
		})
	}
	wg.Wait()
}

// startHeartbeat makes the Locker's first Heartbeat, then renews it every
// heartbeatEvery until Close (once: a second Init does not start another).
// A failed renewal is retried at the next beat; meanwhile grants go on until
// the last success is heartbeatGrace/2 old (see heartbeatStale).
func (l *Locker) startHeartbeat(ctx context.Context) error {
	l.bgMu.Lock()
	started := l.beating
	l.bgMu.Unlock()
	if started {
		return nil
	}
	id, err := newEpoch()
	if err != nil {
		return err
	}
	q := l.quarantineFor()
	addrs := make([]string, len(l.members))
	for i, m := range l.members {
		addrs[i] = m.Addr()
	}
	slices.Sort(addrs)
	beat := func(ctx context.Context) error {
		sent := time.Now() // real time: the registry counts on Postgres' clock
		if err := l.opts.Registry.Heartbeat(ctx, id, q, heartbeatGrace, addrs); err != nil {
			return err
		}
		l.beatMu.Lock()
		if sent.After(l.lastBeat) {
			l.lastBeat = sent
		}
		l.beatMu.Unlock()
		return nil
	}
	if err := beat(ctx); err != nil {
		return fmt.Errorf("service: heartbeat: %w", err) // Init may be retried
	}
	var failing, stale bool // only the heartbeat goroutine uses them
	l.every(&l.beating, heartbeatEvery, func() {
		hctx, cancel := context.WithTimeout(l.life, l.opts.IssueTimeout)
		defer cancel()
		err := beat(hctx)
		switch {
		case l.life.Err() != nil:
		case err != nil:
			failing = true
			l.opts.Logger.Warn("could not renew this server's heartbeat", slog.String("error", err.Error()))
			if serr := l.heartbeatStale(); serr != nil && !stale {
				stale = true
				l.opts.Logger.Error("this server grants and extends no lock until Postgres records its heartbeat again (503 fencing-unavailable)", slog.String("error", serr.Error()))
			}
		case stale:
			failing, stale = false, false
			l.opts.Logger.Info("this server's heartbeat is recorded again: it grants and extends locks")
		case failing:
			failing = false
			l.opts.Logger.Info("this server's heartbeat is recorded again")
		}
	})
	return nil
}

// admitBackground counts one piece of background work in l.bg, which Close
// waits for, unless Close began (false: the work must not start).
func (l *Locker) admitBackground() bool {
	l.bgMu.Lock()
	defer l.bgMu.Unlock()
	if l.life.Err() != nil {
		return false
	}
	l.bg.Add(1)
	return true
}

// every runs f every d in the background until Close, unless *started says
// it runs already (a concurrent or repeated Init) or the Locker is closed.
func (l *Locker) every(started *bool, d time.Duration, f func()) {
	l.bgMu.Lock()
	defer l.bgMu.Unlock()
	if *started {
		return
	}
	*started = l.tick(d, func() bool { f(); return true })
}

// tick runs f every d in the background while it returns true, until Close;
// false if the Locker is closed (nothing runs). l.bgMu is held.
func (l *Locker) tick(d time.Duration, f func() bool) bool {
	if l.life.Err() != nil {
		return false
	}
	l.bg.Go(func() {
		t := time.NewTicker(d)
		defer t.Stop()
		for {
			select {
			case <-l.life.Done():
				return
			case <-t.C:
			}
			if !f() {
				return
			}
		}
	})
	return true
}

// heartbeatStale returns an error if this Locker has a Registry and has
// made no heartbeat (Init has not succeeded: no restart of a node would be
// found), or its last successful one began heartbeatGrace/2 ago or more: a
// lease granted now could outlast the registry's count of this server, and
// a quarantine started elsewhere could end before it.
// Granting returns an error if the Locker grants nothing for now: it has a
// Registry, and its heartbeat there is missing or stale (Postgres does not
// record it: down, read-only, or its table locked). Readiness checks use it.
func (l *Locker) Granting() error { return l.heartbeatStale() }

func (l *Locker) heartbeatStale() error {
	if l.opts.Registry == nil {
		return nil
	}
	l.beatMu.Lock()
	last := l.lastBeat
	l.beatMu.Unlock()
	if last.IsZero() {
		return errors.New("this Locker has a Registry but Init has not succeeded: it grants nothing until Init has registered the nodes and made its first heartbeat")
	}
	if time.Since(last) < heartbeatGrace/2 {
		return nil
	}
	return fmt.Errorf("this server's heartbeat in the registry is %v old: it grants nothing until Postgres records one", time.Since(last).Round(time.Millisecond))
}

func newEpoch() (string, error) {
	var b [12]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("service: epoch: %w", err)
	}
	return base64.RawURLEncoding.EncodeToString(b[:]), nil
}

// maxMaxTTL bounds MaxTTL: the extend script packs two leases into one
// integer (see extendScript).
const maxMaxTTL = 24 * time.Hour

// quarantineFor is how long a node that lost its memory is not counted: every
// lease it may have held ends within MaxTTL (TTLs and extensions are bounded
// by it), plus the drift allowance and one node timeout.
func (l *Locker) quarantineFor() time.Duration {
	return l.opts.MaxTTL + l.drift(l.opts.MaxTTL) + l.opts.NodeTimeout
}

// recoveryReq is what a recovery of a node brings up to date with the
// Registry: the node lacks the epoch marker seen (runID ""); its process
// restarted as runID (seen: the epoch this server had for it); or, unseen,
// a server that was not watching the node found process runID behind it.
// durable says that process fsyncs every write.
type recoveryReq struct {
	seen    string
	runID   string
	durable bool
	unseen  bool
	// evict: an eviction spell, quarantined from whatever epoch is the
	// node's when it is recorded (seen is ignored): news that does not go
	// stale when a mark under way moves the epoch on.
	evict bool
}

// lossReq is the recovery of the node found without the marker of epoch,
// or counted out for another loss (eviction): it names the process behind
// the node now, if known, so that the record covers it (a restart of it
// that this server saw but could not record is recorded then, or found
// handled).
func (m *member) lossReq(epoch string) recoveryReq {
	m.mu.Lock()
	defer m.mu.Unlock()
	return recoveryReq{seen: epoch, runID: m.runID, durable: m.durable}
}

// recover records what req says of node i in the Registry (a quarantine
// starts unless another server started it already or one is running, see
// Registry), adopts the recorded epoch and quarantine, and marks the node
// if this call started the quarantine. It runs in the background; a node's
// recoveries run one at a time, in the order asked. Meanwhile the node's answers count
// as its quarantine says: a recovery with others queued behind it only
// extends the quarantine, as they may carry news it has not recorded. A
// request the same as one queued is not queued again. With provisional, the node is also counted out
// from now until the Registry has answered req or a later request (set as
// req is queued, so no earlier recovery ends it), however long that takes. It
// returns a channel closed when the node's recoveries have all run, or nil
// without a Registry or once the Locker is closed.
func (l *Locker) recover(i int, req recoveryReq, provisional bool) chan struct{} {
	l.members[i].mu.Lock()
	return l.recoverLocked(i, req, provisional)
}

// recoverLocked is recover with node i's mu held; it unlocks it.
func (l *Locker) recoverLocked(i int, req recoveryReq, provisional bool) chan struct{} {
	m := l.members[i]
	if l.opts.Registry == nil {
		m.mu.Unlock()
		return nil
	}
	if provisional {
		m.unrecorded = true // until req's answer (or a later one) covers it
	}
	if done := m.recovery; done != nil {
		// Not compared with the one under way, which may have answered
		// already: its answer predates what provisional just set.
		if !slices.Contains(m.queued, req) {
			m.queued = append(m.queued, req)
		}
		m.mu.Unlock()
		return done
	}
	if !l.admitBackground() {
		m.mu.Unlock()
		return nil
	}
	done := make(chan struct{})
	m.recovery = done
	m.mu.Unlock()
	go func() {
		defer l.bg.Done()
		for {
			if !l.recoverOnce(i, req) {
				// Retried until it is recorded (or the Locker closes):
				// meanwhile the node does not count (unrecorded).
				retry := time.NewTimer(recoveryRetry)
				select {
				case <-retry.C:
					continue
				case <-l.life.Done():
					retry.Stop()
					m.mu.Lock()
					m.recovery, m.queued = nil, nil
					m.mu.Unlock()
					close(done)
					return
				}
			}
			m.mu.Lock()
			if len(m.queued) == 0 {
				m.recovery = nil
				m.mu.Unlock()
				close(done)
				return
			}
			req = m.queued[0]
			m.queued = m.queued[1:]
			m.mu.Unlock()
		}
	}()
	return done
}

// recoveryRetry is how long a recovery that failed to be recorded waits
// before it tries again.
const recoveryRetry = time.Second

// recoverOnce runs one recovery of node i (see recover); false if the
// Registry could not record it.
func (l *Locker) recoverOnce(i int, req recoveryReq) bool {
	m := l.members[i]
	ctx, cancel := context.WithTimeout(l.life, l.opts.IssueTimeout)
	defer cancel()
	next, err := newEpoch()
	if err != nil {
		return false
	}
	if req.evict {
		m.mu.Lock()
		req.seen = m.epoch
		m.mu.Unlock()
	}
	var cur string
	var left time.Duration
	if req.unseen {
		cur, left, err = l.opts.Registry.NodeProcess(ctx, m.Addr(), req.runID, next, req.durable)
	} else {
		cur, left, err = l.opts.Registry.QuarantineNode(ctx, m.Addr(), req.seen, next, req.runID, req.durable, l.quarantineFor())
	}
	if err != nil {
		// The node does not count until this is recorded (it is retried).
		m.mu.Lock()
		if req.runID != m.runID {
			// News of a process the node no longer runs: dropped, as the
			// news of the current one (queued since) is what counts.
			m.mu.Unlock()
			return true
		}
		first := m.recordErr == nil
		m.unrecorded, m.recordErr = true, err
		until := later(m.end(), l.opts.Now().Add(l.quarantineFor()))
		m.mu.Unlock()
		if first {
			l.opts.Observer.Quarantine(m.Addr(), until)
			l.noteCounting()
			msg := "node lost its memory or restarted, and this could not be recorded: its votes do not count until it is (retried every second)"
			if req.unseen {
				msg = "could not check the node's Redis process against the record: its votes do not count until it is checked (retried every second)"
			}
			l.opts.Logger.Warn(msg, slog.String("node", m.Addr()), slog.String("error", err.Error()))
		}
		return false
	}
	until := l.quarantineEnd(left)
	now := l.opts.Now()
	m.mu.Lock()
	prev := m.epoch
	// While a quarantine runs the node is marked with cur, and keeps the
	// epoch it had here until the mark has answered (see below). A stale
	// report of a loss (the record had moved on, to the epoch this server
	// has already) needs no mark: this server marked the node when it
	// adopted that epoch, and if the marker is missing all the same, the
	// next acquire finds that out.
	mark := until.After(now) && (req.unseen || cur != prev)
	if !mark {
		m.epoch = cur
	}
	if len(m.queued) == 0 || until.After(m.until) {
		m.until = until
	}
	if req.runID == m.runID {
		// The record covers the process behind the node now, whatever
		// news of it failed to be recorded before.
		m.unrecorded, m.recordErr = false, nil
	}
	m.mu.Unlock()
	if !until.After(now) {
		l.noteCounting() // the node may count again (recorded at last)
		// No quarantine runs: another server moved the node to cur and
		// marked it earlier, and this one was behind (or, unseen, the
		// process is the one on record, or no lease can be held). Marking
		// now could hide a restart since then; if the node lacks cur's
		// marker, the next acquire finds that out and a new quarantine
		// starts.
		return true
	}
	l.opts.Observer.Quarantine(m.Addr(), until)
	if cur != prev {
		// This server knows the cause when it found it; one that learns of
		// the quarantine from the record (the node's epoch moved on) does
		// not: /v1/nodes' quarantine_reason says.
		msg := "node lost its memory, or another server recorded a loss of it (a restart without its data, an eviction spell; see quarantine_reason in /v1/nodes): its votes do not count until every lease it may have held has expired"
		switch {
		case req.evict:
			msg = "node counted out for eviction, and recorded for the other servers: its votes do not count until every lease it may have held has expired"
		case req.unseen && cur == next:
			msg = "node restarted while no server watched it (its Redis process is not the one on record) and may have lost locks: its votes do not count until every lease it may have held has expired"
		}
		l.opts.Logger.Warn(msg, slog.String("node", m.Addr()), slog.Time("quarantined_until", until))
	}
	l.watchQuarantine(i, until)
	// Mark within the quarantine, which covers any loss of the node's
	// data until it ends. The server that started the quarantine (cur is
	// its next) replaces whatever marker the node holds: a marker from an
	// older epoch (a mark that landed after a restart) would otherwise make
	// every acquire find the node "restarted" for good. The others only
	// add a missing one.
	//
	// The node's epoch here becomes cur only once the mark has answered:
	// an acquire sent with cur before the mark lands would find no marker
	// and report a new loss of the epoch on record, which would start a
	// new quarantine and a new mark, and so on for as long as acquires
	// come. Sent with the epoch before, such a report is found stale by
	// the Registry (it moved on) and only adopts cur. If the mark fails,
	// the next acquire sent with cur finds the marker missing and a new
	// quarantine starts.
	if !mark {
		return true
	}
	mctx, mcancel := context.WithTimeout(ctx, min(l.opts.NodeTimeout, until.Sub(now)))
	defer mcancel()
	_, err = m.Mark(mctx, cur, cur == next)
	m.mu.Lock()
	m.epoch = cur
	m.mu.Unlock()
	if err != nil {
		l.opts.Logger.Warn("could not mark node; trying again while its quarantine lasts", slog.String("node", m.Addr()), slog.String("error", err.Error()))
		l.remark(i, cur, cur == next, until)
	}
	return true
}

// remark marks node i with epoch again, every evictionCheckEvery, after a
// mark failed (a node out of memory refuses writes during an eviction spell,
// a timeout), until one answers, the node's epoch moves on, its quarantine
// (until) ends or the Locker closes. Left unmarked, the node would look
// restarted to the first acquire after the cause passed, and be quarantined
// anew. Marking at any time within the quarantine is what the first mark
// does: the quarantine covers every loss of the node's data until it ends.
func (l *Locker) remark(i int, epoch string, replace bool, until time.Time) {
	l.bgMu.Lock()
	defer l.bgMu.Unlock()
	m := l.members[i]
	l.tick(evictionCheckEvery, func() bool {
		now := l.opts.Now()
		m.mu.Lock()
		moved := m.epoch != epoch
		m.mu.Unlock()
		if moved || !now.Before(until) {
			return false
		}
		ctx, cancel := context.WithTimeout(l.life, min(l.opts.NodeTimeout, until.Sub(now)))
		defer cancel()
		if _, err := m.Mark(ctx, epoch, replace); err != nil {
			return true
		}
		l.opts.Logger.Info("node marked", slog.String("node", m.Addr()))
		return false
	})
}

// noteLoss starts recovering node i when an acquire sent with epoch found
// that the node lost its memory (err matches ErrMemoryLost).
func (l *Locker) noteLoss(i int, epoch string, err error) {
	if errors.Is(err, ErrMemoryLost) {
		l.recover(i, l.members[i].lossReq(epoch), false)
	}
}

// counts reports whether node i's votes count at now.
func (l *Locker) counts(i int, now time.Time) bool {
	m := l.members[i]
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.evicting == "" && !m.unrecorded && !now.Before(m.end())
}

// Quorum returns the number of nodes that must agree: N/2+1.
func (l *Locker) Quorum() int { return l.quorum }

// Options returns the effective options (defaults filled in).
func (l *Locker) Options() Options { return l.opts }

// Request asks for a lock.
type Request struct {
	// TTL is the lease length, within [MinTTL, MaxTTL].
	TTL time.Duration
	// Wait is how long to keep trying while the lock is held or no quorum is
	// reachable; 0 tries once.
	Wait time.Duration
	// Owner is a free-form label recorded with the grant (not a secret).
	Owner string
	// Continue, if set, is called before every try after the first: a
	// non-nil error ends the acquire with that error (wrapped), nothing
	// granted. The API checks there that the caller's key is still valid,
	// so a key revoked during a long wait gets nothing afterwards.
	Continue func(ctx context.Context) error
	// Stop, if set, ends the wait of a blocking acquire when it is closed
	// (a server closes it as it shuts down): a try under way finishes, and
	// instead of waiting for the next one Acquire returns an error matching
	// ErrWaitStopped and the last try's reason (usually ErrHeld).
	Stop <-chan struct{}
}

// Grant is a held lock.
type Grant struct {
	// Key is the lock's storage key.
	Key string
	// Token is the lock token: the holder's secret, needed to extend and release.
	Token string
	// Fencing is the grant's fencing token.
	Fencing fencing.Token
	// TTL is the lease length requested.
	TTL time.Duration
	// Start is when the winning round began (monotonic).
	Start time.Time
	// Expires is when the lease ends at the latest, allowing for drift:
	// Start + TTL - drift.
	Expires time.Time
	// Owner is the label given at acquire.
	Owner string
	// DriftFactor is the clock-drift allowance Expires makes over the TTL
	// (Options.DriftFactor).
	DriftFactor float64
}

// Validity returns how much of the lease is left at now.
func (g *Grant) Validity(now time.Time) time.Duration { return g.Expires.Sub(now) }

// ValidityFrom returns how much of the lease a client may count from t, an
// instant before the winning round began (when its request arrived, say):
// the time from t to Expires, less the drift allowance on the part before
// Start. Expires allows for drift over the TTL only; with this, a client
// whose clock runs slow by up to DriftFactor still stops in time when it
// counts from any instant before t, however long it waited.
func (g *Grant) ValidityFrom(t time.Time) time.Duration {
	d := g.Expires.Sub(t)
	if w := g.Start.Sub(t); w > 0 {
		d -= time.Duration(math.Ceil(float64(w) * g.DriftFactor))
	}
	return d
}

// HolderID returns the non-secret digest of a lock token that is recorded
// with its fencing token.
func HolderID(token string) string {
	sum := sha256.Sum256([]byte(token))
	return hex.EncodeToString(sum[:16])
}

func (l *Locker) drift(ttl time.Duration) time.Duration {
	return time.Duration(float64(ttl)*l.opts.DriftFactor) + 2*time.Millisecond
}

// CheckTTL returns an error matching ErrInvalid when ttl is out of bounds.
func (l *Locker) CheckTTL(ttl time.Duration) error {
	if ttl < l.opts.MinTTL || ttl > l.opts.MaxTTL {
		return &InvalidError{Field: "ttl", Reason: fmt.Sprintf("%v is outside [%v, %v]", ttl, l.opts.MinTTL, l.opts.MaxTTL)}
	}
	return nil
}

func (l *Locker) newToken() (string, error) {
	var b [20]byte
	if _, err := io.ReadFull(l.opts.TokenSource, b[:]); err != nil {
		return "", fmt.Errorf("service: lock token: %w", err)
	}
	return base64.RawURLEncoding.EncodeToString(b[:]), nil
}

// Acquire takes the lock on key (see keyspace.Key). It tries once, and keeps
// trying after a jittered delay while the lock is held or no quorum answers,
// until req.Wait has passed. Waiters for one key in this process get it in
// arrival order: only the first of them tries, and a release here wakes it at
// once. A cancelled ctx ends the wait at once with an error matching
// ctx.Err().
func (l *Locker) Acquire(ctx context.Context, key string, req Request) (*Grant, error) {
	if err := l.CheckTTL(req.TTL); err != nil {
		return nil, err
	}
	if req.Wait < 0 || req.Wait > l.opts.MaxWait {
		return nil, &InvalidError{Field: "wait", Reason: fmt.Sprintf("%v is outside [0, %v]", req.Wait, l.opts.MaxWait)}
	}
	deadline := l.opts.Now().Add(req.Wait)
	var w *waiter
	granted, refreshed := false, false
	defer func() {
		if w != nil {
			l.leave(key, w, granted)
		}
	}()
	for first := true; ; first = false {
		if w == nil && req.Wait > 0 {
			// Queued before the first try, so a release during it wakes us.
			w = l.enqueue(key)
		}
		if !first && req.Continue != nil {
			if err := req.Continue(ctx); err != nil {
				return nil, fmt.Errorf("acquire %q: %w", key, err)
			}
		}
		var aerr *Error
		if w != nil && !l.first(key, w) {
			// Behind another waiter: it tries, and the lock is ours after
			// it. A try of ours could take it first. Until then we report
			// what its last try found.
			aerr = l.lastRefusal(key)
		} else {
			// A caller gone already (before the first try, or during the
			// wait) gets no round: its SETs would hold the name, for
			// nobody, until the clean-up after the quorum.
			if err := ctx.Err(); err != nil {
				return nil, fmt.Errorf("acquire %q: %w", key, err)
			}
			// A fresh lock token per try: a node that refuses a try holds
			// somebody else's token, never one of ours, so the clean-up
			// after a failed try can skip the nodes that said no.
			token, err := l.newToken()
			if err != nil {
				return nil, err
			}
			var g *Grant
			g, aerr = l.try(ctx, key, token, req)
			if aerr != nil && !refreshed && ctx.Err() == nil && l.refreshed(ctx, aerr, req, deadline) {
				// Nodes this server had not known restarted count again:
				// once, the refusal was this server's news, not the nodes'.
				refreshed = true
				if token, err = l.newToken(); err != nil {
					return nil, err
				}
				g, aerr = l.try(ctx, key, token, req)
			}
			if aerr == nil {
				granted = true
				if w != nil {
					// Those behind now wait for this grant.
					l.noteRefusal(key, &Error{Op: "acquire", Key: key, Err: ErrHeld, RetryAfter: g.TTL})
				}
				return g, nil
			}
			if err := ctx.Err(); err != nil {
				return nil, fmt.Errorf("acquire %q: %w", key, err)
			}
			if errors.Is(aerr, ErrInvalid) {
				return nil, aerr
			}
			if w != nil {
				l.noteRefusal(key, aerr)
			}
		}
		left := deadline.Sub(l.opts.Now())
		if left <= 0 {
			if req.Wait == 0 {
				return nil, aerr
			}
			return nil, &Error{Op: "acquire", Key: key, Err: ErrWaitTimeout, Nodes: aerr.Nodes, RetryAfter: aerr.RetryAfter, Cause: aerr}
		}
		delay := min(l.jitter(aerr), left)
		var wake <-chan struct{}
		if w != nil {
			wake = w.wake
		}
		stopped, err := l.pause(ctx, delay, wake, req.Stop)
		if err != nil {
			return nil, fmt.Errorf("acquire %q: %w", key, err)
		}
		if stopped {
			return nil, &Error{Op: "acquire", Key: key, Err: ErrWaitStopped, Nodes: aerr.Nodes, RetryAfter: aerr.RetryAfter, Cause: aerr}
		}
	}
}

// pause waits for d, a wake-up, stop or the end of ctx, counted as waiting.
// It reports whether stop ended it.
func (l *Locker) pause(ctx context.Context, d time.Duration, wake, stop <-chan struct{}) (bool, error) {
	select {
	case <-stop: // closed before the wait: no timer, no waiting counted
		return true, nil
	default:
	}
	l.opts.Observer.Waiting(1)
	defer l.opts.Observer.Waiting(-1)
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return false, ctx.Err()
	case <-stop:
		return true, nil
	case <-wake:
	case <-timer.C:
	}
	return false, nil
}

// jitter returns a random delay in [RetryDelayMin, RetryDelayMax), shortened
// to just past the holder's remaining TTL when that comes sooner.
func (l *Locker) jitter(aerr *Error) time.Duration {
	lo, hi := l.opts.RetryDelayMin, l.opts.RetryDelayMax
	l.randMu.Lock()
	d := lo
	if hi > lo {
		d += time.Duration(l.rand.Int64N(int64(hi - lo)))
	}
	small := time.Duration(l.rand.Int64N(int64(lo) + 1))
	l.randMu.Unlock()
	if aerr.RetryAfter > 0 && aerr.RetryAfter+small < d {
		d = aerr.RetryAfter + small
	}
	if errors.Is(aerr, ErrHeld) && len(l.watchers) == len(l.nodes) && aerr.RetryAfter > d {
		// Held, and every node announces releases: a release wakes the
		// waiter (here at once, from another server by Pub/Sub), so it
		// need not poll the nodes while the holder's lease runs. It tries
		// again just after that lease ends, or after heldRetryMax at most,
		// which bounds the cost of a lost announcement.
		d = min(aerr.RetryAfter+small, max(heldRetryMax, l.opts.RetryDelayMax))
	}
	return d
}

// heldRetryMax is the longest a waiter for a held lock waits between
// tries when releases are announced (see jitter).
const heldRetryMax = time.Second

// waiter is one blocked acquire in a key's queue.
type waiter struct {
	// wake holds at most one pending wake-up.
	wake chan struct{}
}

// waitQueue is a key's waiters in arrival order.
type waitQueue struct {
	q []*waiter
	// last is why the last try of one of them failed (that the lock is
	// held, once one of them got it), and lastAt when: what the waiters
	// behind the first report when their wait ends.
	last   *Error
	lastAt time.Time
	// released is the digest of the last release that woke the queue, and
	// releasedBy how many nodes made it, as far as this process knows (see
	// wake).
	released   string
	releasedBy int
}

// enqueue adds a waiter for key at the back of its queue. The first waiter
// for a key starts watching its releases on the nodes that announce them.
func (l *Locker) enqueue(key string) *waiter {
	w := &waiter{wake: make(chan struct{}, 1)}
	l.waitMu.Lock()
	wq := l.waiters[key]
	if wq == nil {
		wq = &waitQueue{}
		l.waiters[key] = wq
		l.watch(key, true)
	}
	wq.q = append(wq.q, w)
	l.waitMu.Unlock()
	return w
}

func (l *Locker) watch(key string, on bool) {
	if len(l.watchers) == 0 {
		return
	}
	rkey := keyspace.RedisKey(key)
	for _, w := range l.watchers {
		w.WatchReleases(rkey, on)
	}
}

// leave removes w from key's queue. When the first waiter leaves without the
// lock, the next one is woken to try at once: the lock may be free.
func (l *Locker) leave(key string, w *waiter, granted bool) {
	l.waitMu.Lock()
	defer l.waitMu.Unlock()
	wq := l.waiters[key]
	if wq == nil {
		return
	}
	i := slices.Index(wq.q, w)
	if i < 0 {
		return
	}
	wq.q = slices.Delete(wq.q, i, i+1)
	if len(wq.q) == 0 {
		delete(l.waiters, key)
		l.watch(key, false)
		return
	}
	if i == 0 && !granted {
		signal(wq.q[0])
	}
}

// first reports whether w is the first of key's waiters: the one that tries.
func (l *Locker) first(key string, w *waiter) bool {
	l.waitMu.Lock()
	defer l.waitMu.Unlock()
	wq := l.waiters[key]
	return wq != nil && len(wq.q) > 0 && wq.q[0] == w
}

// noteRefusal records why a waiter's try for key failed.
func (l *Locker) noteRefusal(key string, aerr *Error) {
	now := l.opts.Now()
	l.waitMu.Lock()
	defer l.waitMu.Unlock()
	if wq := l.waiters[key]; wq != nil {
		wq.last, wq.lastAt = aerr, now
	}
}

// lastRefusal returns why the last try of key's waiters failed (its
// RetryAfter counted down since) or, before any did, that the lock is held
// (by the waiter ahead, as far as we know).
func (l *Locker) lastRefusal(key string) *Error {
	now := l.opts.Now()
	l.waitMu.Lock()
	defer l.waitMu.Unlock()
	wq := l.waiters[key]
	if wq == nil || wq.last == nil {
		return &Error{Op: "acquire", Key: key, Err: ErrHeld}
	}
	e := *wq.last
	if e.RetryAfter > 0 {
		e.RetryAfter = max(e.RetryAfter-now.Sub(wq.lastAt), time.Millisecond)
	}
	return &e
}

// wake wakes the first waiter for key in this process, if any, for the
// release of the lock token whose digest is digest, which nodes more nodes
// have made (a release of this process: a majority at once; an
// announcement: one). A release wakes it twice at most: at its first news,
// and again once a majority made it, in case the try the first news began
// found the other nodes not released yet (an announcement can overtake the
// deletes of other nodes). Further news of it wakes nobody.
func (l *Locker) wake(key, digest string, nodes int) {
	l.waitMu.Lock()
	defer l.waitMu.Unlock()
	wq := l.waiters[key]
	if wq == nil || len(wq.q) == 0 {
		return
	}
	if wq.released != digest {
		wq.released, wq.releasedBy = digest, nodes
		signal(wq.q[0])
		return
	}
	before := wq.releasedBy
	wq.releasedBy += nodes
	if before < l.quorum && wq.releasedBy >= l.quorum {
		signal(wq.q[0])
	}
}

// announced is called by the nodes that announce releases.
func (l *Locker) announced(rkey, digest string) {
	l.wake(strings.TrimPrefix(rkey, keyspace.RedisPrefix), digest, 1)
}

// releaseDigest is the digest a node announces a release of token with.
func releaseDigest(token string) string {
	sum := sha1.Sum([]byte(token))
	return hex.EncodeToString(sum[:])
}

func signal(w *waiter) {
	select {
	case w.wake <- struct{}{}:
	default: // one is pending already
	}
}

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

// try runs one Redlock round plus issuance.
func (l *Locker) try(ctx context.Context, key, token string, req Request) (*Grant, *Error) {
	l.tries.Add(1)
	defer l.tries.Add(-1)
	if err := l.heartbeatStale(); err != nil {
		return nil, &Error{Op: "acquire", Key: key, Err: ErrFencing, Cause: err}
	}
	rkey := keyspace.RedisKey(key)
	start := l.opts.Now()
	expires := start.Add(req.TTL - l.drift(req.TTL))
	claim := fencing.Claim{Key: key, Owner: req.Owner, Holder: HolderID(token)}
	// Sent first: the commit takes longer than the round.
	spec := l.speculate(ctx, claim, req.Wait > 0)

	// Every node's answer is noted until the decision; on failure the
	// decision deletes what the nodes that answered may have set, and nodes
	// answering later delete theirs (see lateRound). The round runs on a
	// context the client cannot cancel (each call is still bounded by
	// NodeTimeout): a straggler's SET completes even after the grant was
	// returned, so the lock lives on as many nodes as possible.
	lr := &lateRound{rkey: rkey, left: len(l.nodes)}
	args := acquireArgs(rkey, token, req.TTL)
	var wg *sync.WaitGroup
	votes, wg := l.round(context.WithoutCancel(ctx), "acquire", nodeOp{
		sync: func(ctx context.Context, i int, n Node) (bool, time.Duration, error) {
			epoch, _ := l.members[i].state()
			ok, rem, err := n.Acquire(ctx, rkey, token, req.TTL, epoch)
			l.noteLoss(i, epoch, err)
			return ok, rem, err
		},
		async: func(ctx context.Context, i int, n asyncNode, done func(bool, time.Duration, error)) {
			epoch, _ := l.members[i].state()
			n.acquireAsync(ctx, args, epoch, func(ok bool, rem time.Duration, err error) {
				l.noteLoss(i, epoch, err)
				done(ok, rem, err)
			})
		},
	}, func(i int, wrote, unsure bool) {
		lr.mu.Lock()
		lr.left--
		if !lr.decided {
			if wrote {
				lr.wrote = append(lr.wrote, wroteNode{i, unsure})
			}
			lr.mu.Unlock()
			return
		}
		// A node that refused holds another try's token (tokens are per
		// try), so deleting ours there would change nothing.
		undo := wrote && (lr.failed || lr.released)
		last := lr.left == 0 && lr.tracked
		lr.mu.Unlock()
		if undo {
			l.undo(ctx, wg, i, rkey, token, unsure)
		}
		if last {
			l.lateMu.Lock()
			delete(l.late, token)
			l.lateMu.Unlock()
		}
	}, l.decided)
	t := l.collect(votes)

	// decide ends the round's waiting: on failure it deletes what the nodes
	// that answered may have set (counted in undos); on success it leaves
	// the stragglers tracked for Release.
	var undos sync.WaitGroup
	decide := func(failed bool) {
		lr.mu.Lock()
		lr.decided, lr.failed = true, failed
		wrote := lr.wrote
		lr.wrote = nil
		if !failed && lr.left > 0 {
			lr.tracked = true
			l.lateMu.Lock()
			l.late[token] = lr
			l.lateMu.Unlock()
		}
		lr.mu.Unlock()
		if failed {
			for _, w := range wrote {
				l.undo(ctx, &undos, w.i, rkey, token, w.unsure)
			}
		}
	}

	fail := func(sentinel error, cause error) *Error {
		decide(true)
		if spec != nil {
			spec.abandon(ctx)
		}
		if sentinel == nil && l.refused(t) {
			// Held: the answers in decide it, and slow nodes are not
			// waited for (each deletes what it set when it answers, see
			// lateRound); those that said yes have deleted it. The nodes
			// still to answer are reported pending. (A waiting acquire's
			// next try may find this try's key on such a node until its
			// delete lands there, and get a no from it: liveness only.)
			undos.Wait()
			l.drainReady(t, votes)
			for i := range t.results {
				if t.results[i].Addr == "" {
					t.results[i].Addr = l.nodes[i].Addr()
				}
			}
			return &Error{Op: "acquire", Key: key, Err: ErrHeld, Nodes: t.results, RetryAfter: l.retryAfter(t)}
		}
		undos.Wait()
		wg.Wait() // every node answered and deleted what it set
		l.drain(t, votes)
		var retry time.Duration
		if sentinel == nil { // no quorum: decide why on every node's answer
			if l.refused(t) {
				sentinel, retry = ErrHeld, l.retryAfter(t)
			} else {
				sentinel, cause, retry = ErrQuorum, nodeErrors(t.results), l.quarantineRetryAfter(t)
			}
		}
		return &Error{Op: "acquire", Key: key, Err: sentinel, Nodes: t.results, Cause: cause, RetryAfter: retry}
	}

	if t.yes < l.quorum {
		return nil, fail(nil, nil)
	}
	if err := ctx.Err(); err != nil {
		return nil, fail(ErrQuorum, err)
	}
	if !l.opts.Now().Before(expires) {
		return nil, fail(ErrExpired, nil)
	}
	if l.opts.AfterQuorum != nil {
		l.opts.AfterQuorum(ctx, key)
	}
	if err := ctx.Err(); err != nil {
		// The caller left before issuance: nothing is issued, and a
		// speculative token stays unused (fail), as on every other path
		// that refuses before the token is confirmed.
		return nil, fail(ErrQuorum, err)
	}
	if !l.opts.Now().Before(expires) {
		// Stalled past the lease (a pause, a slow speculation): a token
		// issued now would be newer than a grant made meanwhile, and fence
		// that live holder out for nothing.
		return nil, fail(ErrExpired, nil)
	}
	// Bounded by the lease too: a claim still queued when the lease ends is
	// dropped unissued, and the store issues nothing for one whose row it
	// reaches after that deadline. Committed later, its token would be
	// newer than that of a grant made after the lease, and fence that live
	// holder out.
	ictx, cancel := context.WithTimeout(ctx, min(l.opts.IssueTimeout, expires.Sub(l.opts.Now())))
	ft, err := l.issue(ictx, claim, spec, expires)
	spec = nil // confirmed or not, it is over
	cancel()
	if errors.Is(err, errLeaseOver) || err != nil && ctx.Err() == nil && !l.opts.Now().Before(expires) {
		return nil, fail(ErrExpired, nil)
	}
	if err != nil {
		if ctx.Err() != nil {
			err = errors.Join(err, ctx.Err())
		}
		return nil, fail(ErrFencing, err)
	}
	if err := ctx.Err(); err != nil {
		// The caller left during issuance (an inline batch does not
		// stop for it): nobody would learn the lock token, and the name
		// would stay held for the whole TTL. The token is spent.
		return nil, fail(ErrQuorum, err)
	}
	if !l.opts.Now().Before(expires) {
		return nil, fail(ErrExpired, nil)
	}
	decide(false)
	l.remember(key, recentGrant{lock: token, fencing: ft})
	return &Grant{Key: key, Token: token, Fencing: ft, TTL: req.TTL, Start: start, Expires: expires, Owner: req.Owner, DriftFactor: l.opts.DriftFactor}, nil
}

// undo deletes token's key on node i in the background, counted in wg,
// within the per-node timeout. It does not block. unsure says node i gave
// no answer to the SET: unless this delete removes the key, the SET may
// still land after it, so the sweeper deletes again until that is ruled
// out; so it does when this delete gets no answer. The delete on a node
// that gave no answer is not counted in wg: the node may be frozen, and the
// refusal waiting for it would take another node timeout for a delete the
// sweeper makes sure of anyway.
func (l *Locker) undo(ctx context.Context, wg *sync.WaitGroup, i int, rkey, token string, unsure bool) {
	cctx, cancel := l.cleanupContext(ctx)
	if unsure {
		wg = nil
	} else {
		wg.Add(1)
	}
	done := func(ok bool, err error) {
		cancel()
		if !ok && (unsure || err != nil) {
			l.sweep.add(i, rkey, token)
		}
		if wg != nil {
			wg.Done()
		}
	}
	if an, ok := l.nodes[i].(asyncNode); ok && an.async() {
		an.releaseAsync(cctx, withdrawArgs(rkey, token), done)
		return
	}
	go func() { done(withdraw(cctx, l.nodes[i], rkey, token)) }()
}

// withdrawer is a Node that can delete what a failed try set without
// announcing a release (RedisNode; see withdrawArgs).
type withdrawer interface {
	Withdraw(ctx context.Context, key, token string) (bool, error)
}

// withdraw deletes key on n if it holds token, unannounced when n can.
func withdraw(ctx context.Context, n Node, key, token string) (bool, error) {
	if w, ok := n.(withdrawer); ok {
		return w.Withdraw(ctx, key, token)
	}
	return n.Release(ctx, key, token)
}

// retryAfter is when enough holders' keys expire for a majority to be free:
// the (N-quorum+1)-th longest remaining TTL among the No answers.
func (l *Locker) retryAfter(t *tally) time.Duration {
	var rem []time.Duration
	for _, r := range t.results {
		if r.Outcome == No {
			rem = append(rem, r.Remaining)
		}
	}
	k := len(l.nodes) - l.quorum // index of the (N-quorum+1)-th largest
	if k >= len(rem) {
		return 0
	}
	slices.SortFunc(rem, func(a, b time.Duration) int { return int(b - a) })
	return rem[k]
}

// quarantineRetryAfter is, for a round that missed the quorum only because
// quarantined nodes do not count (every other node said yes), when enough
// of their quarantines end for a majority to count; 0 otherwise: a node
// that failed may answer again at any moment, one that may evict keys is
// counted out for as long as it may, and one whose loss is being recorded
// gets a quarantine of its own, not known yet.
func (l *Locker) quarantineRetryAfter(t *tally) time.Duration {
	now := l.opts.Now()
	var ends []time.Time
	for i, r := range t.results {
		switch r.Outcome {
		case Yes:
		case Quarantined:
			if r.Err != nil {
				return 0 // found without its data: a new quarantine, not yet recorded
			}
			m := l.members[i]
			m.mu.Lock()
			end, known := m.end(), m.evicting == "" && !m.unrecorded && m.recovery == nil
			m.mu.Unlock()
			if !known {
				return 0
			}
			ends = append(ends, end)
		default:
			return 0
		}
	}
	need := l.quorum - t.yes
	if need <= 0 || need > len(ends) {
		return 0
	}
	slices.SortFunc(ends, time.Time.Compare)
	return max(ends[need-1].Sub(now), 0)
}

// Extend renews the lease of the grant holding key with token to at least
// ttl from now (a renewal never shortens a lease). It succeeds only if the
// grant's token was the newest issued for key when Extend began, and a
// majority renewed within the new validity (which no newer grant can follow
// on: see below); the fencing token stays the same. A node that lost its
// memory (its marker) does not count. On ErrLost the client must acquire
// anew: after a round that a majority refused, the nodes that renewed get
// their earlier lease back (see undoRenewals); when a newer token exists
// (the grant is fenced out), nothing is touched. Either way the lease runs
// on those nodes until its old deadline or its release, so no other client
// wins the name there while this one may still be at work. On any other
// error the lease runs at least until its old deadline.
func (l *Locker) Extend(ctx context.Context, key, token string, ttl time.Duration) (*Grant, error) {
	if err := l.CheckTTL(ttl); err != nil {
		return nil, err
	}
	rkey := keyspace.RedisKey(key)
	// The grant's record is read before any node is touched, so Postgres
	// being unavailable fails the extend with every lease as it was.
	rec, err := l.last(ctx, key)
	if err != nil {
		if cerr := ctx.Err(); cerr != nil { // the caller left: no news of Postgres
			return nil, fmt.Errorf("extend %q: %w", key, cerr)
		}
		return nil, &Error{Op: "extend", Key: key, Err: ErrFencing, Cause: err}
	}
	if rec.Holder != HolderID(token) {
		// Fenced out, but not deleted: if the token holds the name (a newer
		// token was issued for a try that was never granted), its lease
		// runs to the deadline its client was given, or until the client
		// releases it. Deleting it now would let another client win the
		// name before this one has heard that it lost it.
		return nil, &Error{Op: "extend", Key: key, Err: ErrLost, Cause: errors.New("the lock token is not that of the newest grant (a newer token was issued, or this token never held the name): its lease cannot be renewed, and runs until its deadline or its release")}
	}
	// A majority renewed by compare-and-pexpire after the read proves no
	// newer grant since: one would have needed the key gone from a
	// majority, and a renewal never recreates a key. (A token burned
	// meanwhile by a try that stalled before issuance is not a grant; the
	// reference store then refuses this grant's token, and the next extend
	// answers ErrLost.) A renewal also never
	// shortens a lease (see extendScript), so a failed or partial round
	// leaves every node's lease at least as long as the client believes.
	// Checked after the read, which may take IssueTimeout: the lease runs
	// from here.
	if err := l.heartbeatStale(); err != nil {
		return nil, &Error{Op: "extend", Key: key, Err: ErrFencing, Cause: err}
	}
	start := l.opts.Now()
	// prev[i]: the lease node i had before it renewed (when it did).
	prev := make([]time.Duration, len(l.nodes))
	votes, _ := l.round(context.WithoutCancel(ctx), "extend", nodeOp{sync: func(ctx context.Context, i int, n Node) (bool, time.Duration, error) {
		epoch, _ := l.members[i].state()
		lease, before, err := n.Extend(ctx, rkey, token, ttl, epoch)
		l.noteLoss(i, epoch, err)
		prev[i] = before
		return lease > 0, lease, err
	}}, nil, l.decided)
	t := l.collect(votes)
	if t.yes < l.quorum {
		l.drain(t, votes) // decide on every node's answer, each within NodeTimeout
		if l.refused(t) {
			l.undoRenewals(ctx, rkey, token, t, prev)
			return nil, &Error{Op: "extend", Key: key, Err: ErrLost, Nodes: t.results}
		}
		return nil, &Error{Op: "extend", Key: key, Err: ErrQuorum, Nodes: t.results, Cause: nodeErrors(t.results)}
	}
	// The lease a majority keeps: at least ttl, more where a node kept a
	// longer one. Each node measured its lease after start, so it lasts
	// at least that long from start.
	lease := l.majorityLease(t)
	expires := start.Add(lease - l.drift(lease))
	if !l.opts.Now().Before(expires) {
		// The renewed keys run out about now (within the drift allowance):
		// they are left as they are. Shortening them back could cut short
		// the lease of a renewal of the same token that succeeded meanwhile
		// (through another server, while this one stalled).
		l.drain(t, votes)
		return nil, &Error{Op: "extend", Key: key, Err: ErrLost, Nodes: t.results, Cause: errors.New("renewal took longer than the lease")}
	}
	return &Grant{Key: key, Token: token, Fencing: rec.Token, TTL: ttl, Start: start, Expires: expires, Owner: rec.Owner, DriftFactor: l.opts.DriftFactor}, nil
}

// undoRenewals puts back, on every node that renewed key for token in an
// extend a majority refused (t, every answer in), the lease it had before
// (prev). That cuts short no lease a client may still rely on: a renewal
// of the same token that succeeded had a majority, which shares a node with
// the majority that refused this one; that node no longer had the key, so
// the successful renewal's deadline had passed (short of a fault, an
// eviction or a clock jump, that breaks the lease anyway).
// Deleting the key instead would free the name on those nodes before the
// deadline the lease's client was given, and the majority that refused may
// be wrong (a node that evicted the key, or lost it and is not known to
// have yet). A node whose answer did not come keeps what it may have
// renewed, which only keeps the name from others longer. It waits for
// every answer, each within NodeTimeout.
func (l *Locker) undoRenewals(ctx context.Context, rkey, token string, t *tally, prev []time.Duration) {
	var wg sync.WaitGroup
	for i, r := range t.results {
		if r.Err != nil || r.Remaining <= prev[i] {
			continue // no answer, or not lengthened (a quarantined node's yes is restored too)
		}
		wg.Go(func() {
			cctx, cancel := l.cleanupContext(ctx)
			defer cancel()
			if _, err := l.nodes[i].Restore(cctx, rkey, token, prev[i]); err != nil {
				l.opts.Logger.Warn("restoring a lease after a failed extend", slog.String("node", l.nodes[i].Addr()), slog.String("error", err.Error()))
			}
		})
	}
	wg.Wait()
}

// keyToken is a Redis key and a lock token.
type keyToken struct{ rkey, token string }

// markReleased tells the granting round of token on rkey, if nodes of it are
// still to answer, to delete what they set when they do. A release naming
// another key (the token's holder mixed up its names) is refused by every
// node and changes nothing, so it marks nothing.
func (l *Locker) markReleased(rkey, token string) {
	l.lateMu.Lock()
	lr := l.late[token]
	l.lateMu.Unlock()
	if lr != nil && lr.rkey == rkey {
		lr.mu.Lock()
		lr.released = true
		lr.mu.Unlock()
	}
}

// releaseAll compare-and-deletes key on every node. It waits for every
// answer (each within NodeTimeout) when all is true; otherwise it returns as
// soon as a majority deleted the key, and the slower nodes finish in the
// background.
func (l *Locker) releaseAll(ctx context.Context, rkey, token string, all bool) *tally {
	l.markReleased(rkey, token)
	// Releases of one token on one key run one after the other: done is
	// closed once every node answered this one, and the next one waits for
	// it (so it sees this one's outcome rather than racing it).
	done := make(chan struct{})
	l.lateMu.Lock()
	kt := keyToken{rkey, token}
	prev := l.releasing[kt]
	l.releasing[kt] = done
	l.lateMu.Unlock()
	if prev != nil {
		<-prev // each of its nodes answers within NodeTimeout
	}
	var mu sync.Mutex
	left := len(l.nodes)
	// Nodes that answered that the key does not hold the token: if others
	// deleted it, the token was a grant's, and a straggling SET of that
	// grant may still land on them (see sweeper).
	var found bool
	var absent []int
	args := releaseArgs(rkey, token)
	votes, _ := l.round(context.WithoutCancel(ctx), "release", nodeOp{
		sync: func(ctx context.Context, _ int, n Node) (bool, time.Duration, error) {
			ok, err := n.Release(ctx, rkey, token)
			return ok, 0, err
		},
		async: func(ctx context.Context, _ int, n asyncNode, done func(bool, time.Duration, error)) {
			n.releaseAsync(ctx, args, func(ok bool, err error) { done(ok, 0, err) })
		},
	}, func(i int, wrote, unsure bool) {
		if unsure {
			// The delete may not have been applied: the sweeper retries.
			l.sweep.add(i, rkey, token)
		}
		mu.Lock()
		left--
		if wrote && !unsure {
			found = true
		} else if !unsure {
			absent = append(absent, i)
		}
		var sweep []int
		if left == 0 && found {
			sweep = absent
		}
		last := left == 0
		mu.Unlock()
		for _, i := range sweep {
			l.sweep.add(i, rkey, token)
		}
		if last {
			l.lateMu.Lock()
			if l.releasing[kt] == done { // no release of the token queued behind
				delete(l.releasing, kt)
			}
			l.lateMu.Unlock()
			close(done)
		}
	}, func(yes, _, got int) bool { return got == len(l.nodes) || !all && yes >= l.quorum })
	<-votes.ready
	t := &tally{results: make([]NodeResult, len(l.nodes))}
	for t.got < len(l.nodes) && (all || t.yes < l.quorum) {
		l.add(t, <-votes.ch)
	}
	return t
}

// Release deletes the lock on key wherever token holds it, even if the caller
// goes away. It returns once a majority deleted it (the rest complete in the
// background, each within its timeout) or every node answered. It returns an
// error matching ErrNotHolder when the token held it nowhere that answered,
// and ErrQuorum when too few nodes answered to tell.
func (l *Locker) Release(ctx context.Context, key, token string) error {
	t := l.releaseAll(ctx, keyspace.RedisKey(key), token, false)
	if t.yes > 0 {
		l.released(key, token)
		l.wake(key, releaseDigest(token), max(t.yes, l.quorum))
		return nil
	}
	if l.refused(t) {
		return &Error{Op: "release", Key: key, Err: ErrNotHolder, Nodes: t.results}
	}
	return &Error{Op: "release", Key: key, Err: ErrQuorum, Nodes: t.results, Cause: nodeErrors(t.results)}
}

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
