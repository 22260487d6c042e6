// Membership: Init, the nodes' epoch markers and processes on record, the
// heartbeat, and the recovery of nodes that restarted or lost their memory.

package service

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/redfence/redfence/internal/keyspace"
)

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
