package client

import (
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/redfence/redfence/client/rest"
	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/apikey"
)

// Sentinel errors. Every error the client returns for an answer of the
// server matches at most one of them with errors.Is; errors of the caller's
// context match context.Canceled or context.DeadlineExceeded instead.
var (
	// ErrHeld: another client holds the lock (lock-held, or wait-timeout when
	// the wait ran out).
	ErrHeld = errors.New("client: lock held")
	// ErrLost: the lease is gone (lock-lost on extend, not-holder on release,
	// or its deadline passed without a renewal). Stop writing under it;
	// acquire again for a new fencing token.
	ErrLost = errors.New("client: lease lost")
	// ErrStale: a write carried a fencing token that is not the newest
	// issued (stale-token).
	ErrStale = errors.New("client: stale fencing token")
	// ErrPrecondition: a conditional write (PutResourceIf) found the
	// document at another version (precondition-failed): nothing was
	// written. Error.CurrentVersion says which (0: no document).
	ErrPrecondition = errors.New("client: precondition failed")
	// ErrUnavailable: the server could not decide (quorum-unavailable,
	// fencing-unavailable, lease-expired, store-unavailable, shutting-down,
	// request-timeout, any 5xx or 429)
	// or could not be reached. Retrying later may succeed.
	ErrUnavailable = errors.New("client: service unavailable")
	// ErrInvalid: the server refused the request itself (invalid-request,
	// request-too-large, unsupported-media-type, ...), or the client did
	// before sending it (a bad option, server URL or name). Retrying cannot
	// help.
	ErrInvalid = errors.New("client: invalid request")
	// ErrNotFound: no such resource (resource-not-found) or route.
	ErrNotFound = errors.New("client: not found")
	// ErrDenied: the API key is missing, unknown or lacks the scope (401, 403).
	ErrDenied = errors.New("client: access denied")
	// ErrReleased is the cause of a lease's context after Release.
	ErrReleased = errors.New("client: lease released")
)

// Error is an error answer of the server (an RFC 9457 problem document) or a
// failure to reach it. It matches its sentinel (ErrHeld, ErrLost, ...) with
// errors.Is, and the transport error, if any, with errors.Is/As.
type Error struct {
	// Op is acquire, extend, release, put or get.
	Op string
	// Name is the lock or resource name.
	Name string
	// Status is the HTTP status; 0 when the server was not reached.
	Status int
	// Type is the problem type URI (urn:redfence:problem:<slug>); empty when
	// the answer was not a problem document.
	Type string
	// Title and Detail are the problem's human-readable texts.
	Title, Detail string
	// RequestID is the X-Request-Id of the exchange; quote it in reports.
	RequestID string
	// RetryAfter is when trying again may succeed (lock-held, wait-timeout,
	// 503, 429); 0 when unknown.
	RetryAfter time.Duration
	// CurrentFencingToken is the newest token issued (stale-token).
	CurrentFencingToken fencing.Token
	// CurrentVersion is the document's version (precondition-failed); 0
	// when there is no document.
	CurrentVersion int64
	// Nodes is each Redis node's answer in the last round, in node order
	// (quorum-unavailable, lock-held, ...); nil when the problem lists none.
	Nodes []NodeOutcome

	sentinel error
	cause    error
}

// NodeOutcome is one Redis node's answer in a round, as a problem lists it.
type NodeOutcome struct {
	// Address is the node's host:port.
	Address string
	// Outcome is yes, no, error, timeout or quarantined (others may be
	// added: treat an unknown one as error).
	Outcome string
	// Error says what went wrong, for humans (error, timeout), or why the
	// node is quarantined when the round found it so; empty otherwise.
	Error string
}

// Slug returns the problem type without its urn:redfence:problem: prefix.
func (e *Error) Slug() string { return strings.TrimPrefix(e.Type, problemPrefix) }

// shownName is a lock or resource name as errors quote it: with the
// secret of an API key pasted into it by mistake redacted (apikey.Redact),
// as the server quotes it, since errors are logged.
func shownName(name string) string { return apikey.Redact(name) }

func (e *Error) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "client: %s %q: ", e.Op, shownName(e.Name))
	switch {
	case e.Status == 0 && e.cause != nil:
		fmt.Fprintf(&b, "%v: %v", e.sentinel, e.cause)
	case e.Type != "":
		fmt.Fprintf(&b, "%d %s", e.Status, e.Slug())
		if e.Detail != "" {
			b.WriteString(": " + e.Detail)
		}
	default:
		fmt.Fprintf(&b, "HTTP %d", e.Status)
		if e.Detail != "" {
			b.WriteString(": " + e.Detail)
		}
		if e.cause != nil {
			// An answer that could not be read (a 2xx this client cannot
			// decode): say why.
			fmt.Fprintf(&b, ": %v", e.cause)
		}
	}
	return b.String()
}

// Unwrap returns the sentinel and the transport error, if any.
func (e *Error) Unwrap() []error {
	errs := make([]error, 0, 2)
	if e.sentinel != nil {
		errs = append(errs, e.sentinel)
	}
	if e.cause != nil {
		errs = append(errs, e.cause)
	}
	return errs
}

const problemPrefix = "urn:redfence:problem:"

// sentinels maps the problem type slugs to the sentinel errors. Slugs not
// listed are classified by status (the spec: new types may appear).
var sentinels = map[string]error{
	"lock-held":              ErrHeld,
	"wait-timeout":           ErrHeld,
	"lock-lost":              ErrLost,
	"not-holder":             ErrLost,
	"stale-token":            ErrStale,
	"precondition-failed":    ErrPrecondition,
	"quorum-unavailable":     ErrUnavailable,
	"fencing-unavailable":    ErrUnavailable,
	"lease-expired":          ErrUnavailable,
	"store-unavailable":      ErrUnavailable,
	"shutting-down":          ErrUnavailable,
	"request-timeout":        ErrUnavailable, // the body came too slowly: try again
	"invalid-request":        ErrInvalid,
	"request-too-large":      ErrInvalid,
	"unsupported-media-type": ErrInvalid,
	"method-not-allowed":     ErrInvalid,
	"not-found":              ErrNotFound,
	"resource-not-found":     ErrNotFound,
}

func sentinelFor(slug string, status int) error {
	if s, ok := sentinels[slug]; ok {
		return s
	}
	switch {
	case status == http.StatusUnauthorized || status == http.StatusForbidden:
		return ErrDenied
	case status == http.StatusTooManyRequests || status >= 500:
		return ErrUnavailable
	case status == http.StatusNotFound:
		return ErrNotFound
	case status >= 400 && status != http.StatusConflict:
		return ErrInvalid
	}
	return nil
}

// problemError turns a non-success answer into an *Error.
func problemError(op, name string, resp *http.Response, body []byte) *Error {
	e := &Error{Op: op, Name: name, Status: resp.StatusCode, RequestID: resp.Header.Get("X-Request-Id")}
	if mt, _, err := mime.ParseMediaType(resp.Header.Get("Content-Type")); err == nil && (mt == "application/problem+json" || mt == "application/json") {
		var p rest.Problem
		if json.Unmarshal(body, &p) == nil && strings.HasPrefix(p.Type, problemPrefix) {
			e.Type, e.Title = p.Type, p.Title
			if p.Detail != nil {
				e.Detail = *p.Detail
			}
			if p.RequestId != nil && e.RequestID == "" {
				e.RequestID = *p.RequestId
			}
			if p.RetryAfterMs != nil {
				e.RetryAfter = time.Duration(*p.RetryAfterMs) * time.Millisecond
			}
			if p.CurrentFencingToken != nil {
				e.CurrentFencingToken = fencing.Token(*p.CurrentFencingToken)
			}
			if p.CurrentVersion != nil {
				e.CurrentVersion = *p.CurrentVersion
			}
			if p.Nodes != nil {
				e.Nodes = make([]NodeOutcome, len(*p.Nodes))
				for i, n := range *p.Nodes {
					e.Nodes[i] = NodeOutcome{Address: n.Address, Outcome: string(n.Outcome)}
					if n.Error != nil {
						e.Nodes[i].Error = *n.Error
					}
				}
			}
		}
	}
	if e.RetryAfter == 0 {
		if secs, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && secs > 0 {
			e.RetryAfter = time.Duration(secs) * time.Second
		}
	}
	if e.Type == "" && len(body) > 0 && len(body) <= 200 {
		e.Detail = strings.TrimSpace(string(body))
	}
	e.sentinel = sentinelFor(e.Slug(), e.Status)
	return e
}
