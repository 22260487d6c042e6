package service

import (
	"errors"
	"fmt"
	"strings"
	"time"
)

// Sentinel errors. An error returned by Locker's Acquire, Extend or Release
// matches one of ErrInvalid, ErrHeld, ErrQuorum, ErrFencing, ErrExpired,
// ErrLost, ErrNotHolder, or a context error (context.Canceled,
// context.DeadlineExceeded) with errors.Is; ErrWaitTimeout and
// ErrWaitStopped additionally wrap the last attempt's error. The exceptions
// are an error of Request.Continue, returned wrapped as it is, and a failure
// to read the random source for a lock token.
var (
	// ErrInvalid reports a request outside the configured bounds (TTL, wait).
	ErrInvalid = errors.New("service: invalid request")
	// ErrHeld reports that another holder owns the lock on a majority of nodes.
	ErrHeld = errors.New("service: lock held")
	// ErrQuorum reports that too few nodes answered to decide.
	ErrQuorum = errors.New("service: quorum not reached")
	// ErrFencing reports that no fencing token could be issued, so nothing was granted.
	ErrFencing = errors.New("service: fencing token unavailable")
	// ErrExpired reports that a quorum was won but the lease ran out (slow
	// nodes, a stall before issuance) before the grant could be returned.
	ErrExpired = errors.New("service: lease expired before it could be granted")
	// ErrLost reports that an extend found the lock no longer held by the token.
	ErrLost = errors.New("service: lock lost")
	// ErrNotHolder reports a release by a token that holds the lock nowhere.
	ErrNotHolder = errors.New("service: not the lock holder")
	// ErrMemoryLost reports that a node no longer holds the epoch marker it
	// was given: it restarted without its data (or was replaced) and may have
	// forgotten locks that are still live.
	ErrMemoryLost = errors.New("service: node lost its memory")
	// ErrWaitTimeout reports that a blocking acquire's wait ran out; the error
	// also matches the reason of its last attempt (usually ErrHeld).
	ErrWaitTimeout = errors.New("service: wait timed out")
	// ErrWaitStopped reports that a blocking acquire's wait was ended by
	// Request.Stop (its server is shutting down); the error also matches the
	// reason of its last attempt.
	ErrWaitStopped = errors.New("service: wait stopped")
	// ErrSameServer reports two configured nodes that reach one Redis
	// server: it would vote twice, and a majority of votes would no longer
	// be a majority of servers.
	ErrSameServer = errors.New("service: two nodes are one Redis server")
	// ErrForeignNode reports a node that Init found marked by servers that
	// keep their records in another Registry (database): another
	// deployment uses it, or this database is not the one the node was
	// used with. Servers of two Registries on one node would each take
	// the other's marker for a lost memory, and quarantine it in turn.
	ErrForeignNode = errors.New("service: the node is marked by servers of another database")
	// ErrNodeShared reports a Node value that already serves another
	// Locker: each Locker needs nodes of its own (NewRedisNode for each), as
	// a node reports the restarts it sees to one Locker only.
	ErrNodeShared = errors.New("service: the node serves another Locker")
	// ErrCommandRefused reports a node that answered a command with an
	// error reply, such as an ACL that does not allow it (NOPERM).
	ErrCommandRefused = errors.New("service: the node refused the command")
	// ErrAuth reports a node that refused the credentials (WRONGPASS,
	// NOAUTH): it runs no command, so it tells nothing of its state and is
	// only a node that fails, and Init refuses it.
	ErrAuth = errors.New("service: the node refused the credentials")
)

// Outcome is what one node answered in one round.
type Outcome int

// Node outcomes.
const (
	// Yes: the node did what was asked (set, extended, deleted).
	Yes Outcome = iota + 1
	// No: the node answered but refused (held by another token, or not held).
	No
	// Failed: the node answered with an error or the connection failed.
	Failed
	// Timeout: the node did not answer within the per-node timeout.
	Timeout
	// Quarantined: the node lost its memory recently; its answer is not
	// counted until every lease it may have forgotten has expired.
	Quarantined
)

// String returns the outcome as shown in API errors: yes, no, error, timeout,
// quarantined, or pending for the zero Outcome (a node still to answer when
// the others decided the outcome).
func (o Outcome) String() string {
	switch o {
	case Yes:
		return "yes"
	case No:
		return "no"
	case Failed:
		return "error"
	case Timeout:
		return "timeout"
	case Quarantined:
		return "quarantined"
	}
	return "pending"
}

// NodeResult is one node's answer in one round.
type NodeResult struct {
	Addr    string
	Outcome Outcome
	// Remaining is the lease left on the node: the holder's, from a node
	// that said No to an acquire; the renewed one, from a node that said
	// Yes to an extend.
	Remaining time.Duration
	Latency   time.Duration
	// Err is set for Failed and Timeout.
	Err error
}

// Error is the error type returned by Locker operations. It matches its
// sentinel (Err) and its Cause with errors.Is/As.
type Error struct {
	// Op is "acquire", "extend", "release" or "status".
	Op string
	// Key is the lock's storage key.
	Key string
	// Err is the sentinel (ErrHeld, ErrQuorum, ...).
	Err error
	// Nodes holds each node's answer in the last round, in node order.
	Nodes []NodeResult
	// RetryAfter is when trying again may succeed: set for ErrHeld, and
	// for an ErrQuorum of an acquire that only quarantined nodes kept
	// from a majority (when enough of their quarantines end).
	RetryAfter time.Duration
	// Cause is the underlying error, if any (node errors, issuer error).
	Cause error
}

func (e *Error) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %q: %v", e.Op, e.Key, e.Err)
	if len(e.Nodes) > 0 {
		b.WriteString(" (")
		for i, n := range e.Nodes {
			if i > 0 {
				b.WriteString(", ")
			}
			fmt.Fprintf(&b, "%s: %s", n.Addr, n.Outcome)
		}
		b.WriteString(")")
	}
	if e.Cause != nil {
		fmt.Fprintf(&b, ": %v", e.Cause)
	}
	return b.String()
}

// Unwrap returns the sentinel and the cause.
func (e *Error) Unwrap() []error {
	if e.Cause == nil {
		return []error{e.Err}
	}
	return []error{e.Err, e.Cause}
}

// InvalidError reports a request field outside the configured bounds. It
// matches ErrInvalid.
type InvalidError struct {
	// Field is "ttl" or "wait".
	Field string
	// Reason says what is allowed.
	Reason string
}

func (e *InvalidError) Error() string { return fmt.Sprintf("%v: %s %s", ErrInvalid, e.Field, e.Reason) }

// Unwrap returns ErrInvalid.
func (e *InvalidError) Unwrap() error { return ErrInvalid }

// NodeError is one node's failure, with the node's address.
type NodeError struct {
	Addr string
	Err  error
}

func (e *NodeError) Error() string { return fmt.Sprintf("node %s: %v", e.Addr, e.Err) }

// Unwrap returns the node's error.
func (e *NodeError) Unwrap() error { return e.Err }
