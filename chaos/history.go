// Package chaos is Redfence's fault-injection suite: a workload of HTTP
// clients that contend for a few names and, with every grant, do a fenced
// read-modify-write of the reference store (append one unique element to a
// JSON array); a recorder of every operation with its invocation and
// response times; and a checker that judges the history.
//
// The checker (Check) holds a history to the promises Redfence makes: with
// porcupine, that the history is linearizable against a model of per-name
// token issuance plus the fenced store (a grant's token is above every token
// granted before it; a write is applied only with the newest token; a read
// sees the last applied write); and directly, that tokens are unique and
// increasing per name, that no stale write (a token below one already
// granted or applied) was accepted, that every stale-token refusal names a
// newer token than the write's, that no acknowledged element is missing
// from the final documents and every element in them was appended by a write
// not refused, and that no two grants of one name overlap in time outside
// the fault windows of that name (or at all, when the faults keep Redlock's
// timing assumptions).
//
// Not covered: the checker sees only what clients saw. A token burned by a
// refused grant, or a grant whose response was lost, is invisible to it; the
// model allows for both (a granted token must only exceed earlier ones, and a
// refused write never changes state). Times come from the wall clock, which
// all processes on one host share; a clock step during a run can make the
// checker report overlaps or regressions that did not happen.
//
// The scenarios themselves are the package's tests (chaos_test.go); the
// client process that tests pause with SIGSTOP is chaos/client.
package chaos

import (
	"sync"
	"time"
)

// Kind is the kind of an operation.
type Kind string

// Operation kinds.
const (
	Acquire Kind = "acquire"
	Read    Kind = "read"
	Write   Kind = "write"
	Extend  Kind = "extend"
	Release Kind = "release"
)

// Op is one HTTP call a client made, as the client saw it.
type Op struct {
	Client string `json:"client"`
	Kind   Kind   `json:"kind"`
	Name   string `json:"name"`
	// Server is the base URL the request went to.
	Server string `json:"server,omitempty"`
	// Call and Return are wall-clock Unix nanoseconds taken just before the
	// request was sent and just after its response (or error) arrived.
	Call   int64 `json:"call"`
	Return int64 `json:"return"`
	// Status is the HTTP status; 0 means no response (outcome unknown).
	Status int `json:"status"`
	// Problem is the problem type slug of an error response (lock-held,
	// stale-token, ...).
	Problem string `json:"problem,omitempty"`
	// Err is the transport error when Status is 0.
	Err string `json:"err,omitempty"`
	// Token is the fencing token: granted (acquire, extend), carried (write,
	// release: the grant's), or of the document read (read).
	Token int64 `json:"token,omitempty"`
	// ValidityMS is the validity an acquire or extend returned.
	ValidityMS int64 `json:"validity_ms,omitempty"`
	// Elems is the document read (read) or written (write).
	Elems []string `json:"elems,omitempty"`
	// Elem is the element a write appends.
	Elem string `json:"elem,omitempty"`
	// Found reports that a read found the document.
	Found bool `json:"found,omitempty"`
	// Current is the current_fencing_token of a stale-token refusal: the
	// newest token issued for the name, as the store saw it (nil: absent).
	Current *int64 `json:"current,omitempty"`
	// Nodes is each node's outcome in a problem's nodes member
	// ("yes,no,timeout,..."), in node order.
	Nodes string `json:"nodes,omitempty"`
	// RetryAfter is the Retry-After header of the response.
	RetryAfter string `json:"retry_after,omitempty"`
	// Stall marks an acquire that asked the server to stall it between
	// quorum and issuance (a test hook of in-process servers).
	Stall bool `json:"stall,omitempty"`
	// Paused marks the write of a cycle whose client was paused (SIGSTOP)
	// or delayed between its read and this write.
	Paused bool `json:"paused,omitempty"`
}

// Granted reports whether op is an acquire that was granted.
func (op Op) Granted() bool { return op.Kind == Acquire && op.Status == 201 }

// Latency returns how long op took.
func (op Op) Latency() time.Duration { return time.Duration(op.Return - op.Call) }

// Now returns the wall clock in Unix nanoseconds: the time base of every Op,
// shared by all processes on a host.
func Now() int64 { return time.Now().UnixNano() }

// History collects operations from many goroutines.
type History struct {
	mu  sync.Mutex
	ops []Op
}

// Add appends op.
func (h *History) Add(op Op) {
	h.mu.Lock()
	h.ops = append(h.ops, op)
	h.mu.Unlock()
}

// Ops returns a copy of the operations recorded so far.
func (h *History) Ops() []Op {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]Op(nil), h.ops...)
}

// Window is a time span [From, To] in Unix nanoseconds during which a fault
// was active (or its effects could last).
type Window struct {
	Kind string
	// Name is the only name the fault hit; "" means every name.
	Name     string
	From, To int64
}

// Faults records injected faults: a count per kind and the windows they
// were active in. It is safe for concurrent use.
type Faults struct {
	mu      sync.Mutex
	counts  map[string]int
	windows []Window
}

// Begin records the start of a fault of kind; the returned func records its
// end, extended by linger (how long its effects may outlast it).
func (f *Faults) Begin(kind string, linger time.Duration) (end func()) {
	return f.BeginOn(kind, "", linger)
}

// BeginOn is Begin for a fault that hits only name.
func (f *Faults) BeginOn(kind, name string, linger time.Duration) (end func()) {
	from := Now()
	f.mu.Lock()
	if f.counts == nil {
		f.counts = make(map[string]int)
	}
	f.counts[kind]++
	f.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			f.mu.Lock()
			f.windows = append(f.windows, Window{Kind: kind, Name: name, From: from, To: Now() + int64(linger)})
			f.mu.Unlock()
		})
	}
}

// Counts returns the number of faults injected, by kind.
func (f *Faults) Counts() map[string]int {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make(map[string]int, len(f.counts))
	for k, v := range f.counts {
		out[k] = v
	}
	return out
}

// Windows returns the windows of the faults that have ended.
func (f *Faults) Windows() []Window {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]Window(nil), f.windows...)
}
