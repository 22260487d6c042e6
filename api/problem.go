package api

import (
	"context"
	"errors"
	"log/slog"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/service"
	"github.com/redfence/redfence/store"
)

// ProblemTypePrefix prefixes every problem type URI; the suffix is the stable
// slug (lock-held, quorum-unavailable, ...).
const ProblemTypePrefix = "urn:redfence:problem:"

// Problem is an RFC 9457 problem details object, with Redfence's extension
// members.
type Problem struct {
	Type     string `json:"type"`
	Title    string `json:"title"`
	Status   int    `json:"status"`
	Detail   string `json:"detail,omitempty"`
	Instance string `json:"instance,omitempty"`
	// RequestID echoes the X-Request-Id of the request.
	RequestID string `json:"request_id,omitempty"`
	// RetryAfterMS is when trying again may succeed (lock-held, wait-timeout).
	RetryAfterMS *int64 `json:"retry_after_ms,omitempty"`
	// Nodes is each node's answer in the last round (quorum-unavailable, ...).
	Nodes []NodeOutcome `json:"nodes,omitempty"`
	// CurrentFencingToken is the newest token issued (stale-token).
	CurrentFencingToken *int64 `json:"current_fencing_token,omitempty"`
	// InvalidParams lists what was wrong with the request (invalid-request).
	InvalidParams []InvalidParam `json:"invalid_params,omitempty"`
}

// NodeOutcome is one node's answer in a round.
type NodeOutcome struct {
	Address string `json:"address"`
	// Outcome is yes, no, error or timeout.
	Outcome string `json:"outcome"`
	Error   string `json:"error,omitempty"`
}

// InvalidParam names one bad part of a request.
type InvalidParam struct {
	Name   string `json:"name"`
	Reason string `json:"reason"`
}

// kind is one row of the error table: a stable slug, its status and title.
type kind struct {
	slug   string
	status int
	title  string
}

// The problem types. Slugs are stable and append-only.
var (
	kInvalid     = kind{"invalid-request", http.StatusBadRequest, "The request is invalid"}
	kTooLarge    = kind{"request-too-large", http.StatusRequestEntityTooLarge, "The request body is too large"}
	kMediaType   = kind{"unsupported-media-type", http.StatusUnsupportedMediaType, "The request body must be application/json"}
	kNotFound    = kind{"not-found", http.StatusNotFound, "No such route"}
	kMethod      = kind{"method-not-allowed", http.StatusMethodNotAllowed, "Method not allowed on this route"}
	kNoResource  = kind{"resource-not-found", http.StatusNotFound, "No such resource"}
	kHeld        = kind{"lock-held", http.StatusConflict, "The lock is held by another client"}
	kWaitTimeout = kind{"wait-timeout", http.StatusConflict, "The lock stayed held for the whole wait"}
	kLost        = kind{"lock-lost", http.StatusConflict, "The lock is no longer held by this token"}
	kNotHolder   = kind{"not-holder", http.StatusConflict, "The lock is not held by this token"}
	kStale       = kind{"stale-token", http.StatusConflict, "The fencing token is not the newest issued for this name"}
	kQuorum      = kind{"quorum-unavailable", http.StatusServiceUnavailable, "Too few Redis nodes answered to decide"}
	kFencing     = kind{"fencing-unavailable", http.StatusServiceUnavailable, "No fencing token could be issued"}
	kExpired     = kind{"lease-expired", http.StatusServiceUnavailable, "The lease ran out before it could be granted"}
	kStore       = kind{"store-unavailable", http.StatusServiceUnavailable, "The reference store (Postgres) is unavailable"}
	kCancelled   = kind{"cancelled", 499, "The client closed the request"}
	kInternal    = kind{"internal-error", http.StatusInternalServerError, "Internal server error"}
	// Access control (auth.go).
	kUnauthorized    = kind{"unauthorized", http.StatusUnauthorized, "A valid API key is required"}
	kForbidden       = kind{"forbidden", http.StatusForbidden, "The API key lacks the scope this call needs"}
	kRateLimited     = kind{"rate-limited", http.StatusTooManyRequests, "Too many requests with this API key"}
	kAuthUnavailable = kind{"auth-unavailable", http.StatusServiceUnavailable, "The API key could not be checked"}
	// Hardening.
	kHeadersTooLarge = kind{"headers-too-large", http.StatusRequestHeaderFieldsTooLarge, "The request headers are too large"}
)

// ProblemTypes lists every problem type slug the API can return.
func ProblemTypes() []string {
	var out []string
	for _, k := range []kind{kInvalid, kTooLarge, kMediaType, kNotFound, kMethod, kNoResource, kHeld, kWaitTimeout,
		kLost, kNotHolder, kStale, kQuorum, kFencing, kExpired, kStore, kCancelled, kInternal,
		kUnauthorized, kForbidden, kRateLimited, kAuthUnavailable, kHeadersTooLarge} {
		out = append(out, k.slug)
	}
	return out
}

// requestError is a client error found by the API layer itself.
type requestError struct {
	kind   kind
	detail string
	params []InvalidParam
}

func (e *requestError) Error() string { return e.detail }

func invalid(detail string, params ...InvalidParam) error {
	return &requestError{kind: kInvalid, detail: detail, params: params}
}

// classify maps an error to its row of the table. The order matters: a wait
// timeout also matches the reason of its last attempt.
func classify(err error) kind {
	var re *requestError
	var ae *authError
	switch {
	case errors.As(err, &re):
		return re.kind
	case errors.As(err, &ae):
		return ae.kind
	case errors.Is(err, service.ErrInvalid):
		return kInvalid
	case errors.Is(err, service.ErrWaitTimeout) && errors.Is(err, service.ErrHeld):
		return kWaitTimeout
	case errors.Is(err, service.ErrHeld):
		return kHeld
	case errors.Is(err, service.ErrQuorum):
		return kQuorum
	case errors.Is(err, service.ErrFencing):
		return kFencing
	case errors.Is(err, service.ErrExpired):
		return kExpired
	case errors.Is(err, service.ErrLost):
		return kLost
	case errors.Is(err, service.ErrNotHolder):
		return kNotHolder
	case errors.Is(err, fencing.ErrStale):
		return kStale
	case errors.Is(err, store.ErrNotFound):
		return kNoResource
	case errors.Is(err, store.ErrInvalidData):
		return kInvalid
	case errors.Is(err, store.ErrUnavailable):
		return kStore
	case errors.Is(err, context.Canceled):
		return kCancelled
	}
	return kInternal
}

func retryAfterHeader(w http.ResponseWriter, d time.Duration) {
	secs := int64(math.Ceil(d.Seconds()))
	w.Header().Set("Retry-After", strconv.FormatInt(max(secs, 1), 10))
}

// writeError writes err as problem+json and logs what the client must not see.
func (h *Handler) writeError(w http.ResponseWriter, r *http.Request, err error) {
	k := classify(err)
	p := &Problem{Type: ProblemTypePrefix + k.slug, Title: k.title, Status: k.status, Instance: r.URL.Path, RequestID: requestID(r.Context())}
	var re *requestError
	var se *service.Error
	var stale *store.StaleError
	var ae *authError
	switch {
	case errors.As(err, &re):
		p.Detail, p.InvalidParams = re.detail, re.params
	case errors.As(err, &ae):
		ae.describe(w, p)
	case errors.As(err, &stale):
		cur := int64(stale.Current)
		p.CurrentFencingToken = &cur
		// Name the name, not the storage key: a tenant's key is
		// "tenant/name", and the answer must read the same in every namespace.
		shown := *stale
		if _, name, ok := strings.Cut(shown.Key, "/"); ok {
			shown.Key = name
		}
		p.Detail = shown.Error()[len("store: "):]
	case k == kNoResource:
		p.Detail = "no document has been written under this name"
	case errors.Is(err, store.ErrInvalidData):
		p.Detail = "Postgres cannot store this data (for example a string holding \\u0000)"
		p.InvalidParams = []InvalidParam{{Name: "data", Reason: "not storable as jsonb"}}
	case k == kStore:
		p.Detail = "Postgres did not answer; nothing was written"
	case errors.Is(err, service.ErrInvalid):
		p.Detail = err.Error()
	}
	if errors.As(err, &se) {
		for _, n := range se.Nodes {
			o := NodeOutcome{Address: n.Addr, Outcome: n.Outcome.String()}
			if n.Err != nil {
				var ne *service.NodeError
				if errors.As(n.Err, &ne) {
					o.Error = ne.Err.Error()
				} else {
					o.Error = n.Err.Error()
				}
			}
			p.Nodes = append(p.Nodes, o)
		}
		switch k {
		case kHeld, kWaitTimeout:
			ms := se.RetryAfter.Milliseconds()
			p.RetryAfterMS = &ms
			retryAfterHeader(w, se.RetryAfter)
			p.Detail = "the lock is held on a majority of nodes; retry after retry_after_ms or pass wait_ms"
		case kQuorum:
			p.Detail = "fewer Redis nodes than a majority answered; see nodes"
		case kFencing:
			p.Detail = "Postgres did not issue a fencing token, so nothing was granted"
		case kExpired:
			p.Detail = "a majority was won but the lease ran out before the fencing token was issued; nothing was granted"
		case kLost:
			p.Detail = "the lease expired or was superseded; acquire again to get a new fencing token"
		case kNotHolder:
			p.Detail = "no node holds this lock with this token (already released or expired)"
		}
	}
	if k.status == http.StatusServiceUnavailable {
		retryAfterHeader(w, time.Second)
	}
	level := slog.LevelInfo
	if k.status >= 500 && k.status != kCancelled.status {
		level = slog.LevelWarn
	}
	if k == kInternal {
		level = slog.LevelError
	}
	// err never carries a lock token: service errors name keys and nodes only.
	h.log.LogAttrs(r.Context(), level, "request failed", slog.String("request_id", p.RequestID),
		slog.String("problem", k.slug), slog.String("error", err.Error()))
	writeProblem(w, p)
}

func writeProblem(w http.ResponseWriter, p *Problem) {
	w.Header().Set("Content-Type", "application/problem+json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(p.Status)
	_ = encodeJSON(w, p)
}
