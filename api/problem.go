package api

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/apikey"
	"github.com/redfence/redfence/internal/refstore"
	"github.com/redfence/redfence/service"
)

// ProblemTypePrefix prefixes every problem type URI; the suffix is the stable
// slug (lock-held, quorum-unavailable, ...).
const ProblemTypePrefix = "urn:redfence:problem:"

// memoryLost is the error of a node this round found without its data.
const memoryLost = "the node does not hold the epoch marker this server expected (it restarted without its data, or another server found it restarted and marked it anew), so it is quarantined"

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
	// CurrentVersion is the document's version (precondition-failed; absent
	// when there is no document).
	CurrentVersion *int64 `json:"current_version,omitempty"`
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
	typ    string // ProblemTypePrefix + slug
}

func newKind(slug string, status int, title string) kind {
	return kind{slug: slug, status: status, title: title, typ: ProblemTypePrefix + slug}
}

// The problem types. Slugs are stable and append-only.
var (
	kInvalid     = newKind("invalid-request", http.StatusBadRequest, "The request is invalid")
	kTooLarge    = newKind("request-too-large", http.StatusRequestEntityTooLarge, "The request body is too large")
	kMediaType   = newKind("unsupported-media-type", http.StatusUnsupportedMediaType, "The request body must be application/json")
	kNotFound    = newKind("not-found", http.StatusNotFound, "No such route")
	kMethod      = newKind("method-not-allowed", http.StatusMethodNotAllowed, "Method not allowed on this route")
	kNoResource  = newKind("resource-not-found", http.StatusNotFound, "No such resource")
	kHeld        = newKind("lock-held", http.StatusConflict, "The lock is held by another client")
	kWaitTimeout = newKind("wait-timeout", http.StatusConflict, "The lock stayed held for the whole wait")
	kLost        = newKind("lock-lost", http.StatusConflict, "The lock is no longer held by this token")
	kNotHolder   = newKind("not-holder", http.StatusConflict, "The lock is not held by this token")
	kStale       = newKind("stale-token", http.StatusConflict, "The fencing token is not the newest issued for this name")
	kPrecond     = newKind("precondition-failed", http.StatusPreconditionFailed, "The document is not in the state the request's If-Match or If-None-Match asks")
	kQuorum      = newKind("quorum-unavailable", http.StatusServiceUnavailable, "Too few Redis nodes answered to decide")
	kFencing     = newKind("fencing-unavailable", http.StatusServiceUnavailable, "No fencing token could be issued")
	kExpired     = newKind("lease-expired", http.StatusServiceUnavailable, "The lease ran out before it could be granted")
	kStore       = newKind("store-unavailable", http.StatusServiceUnavailable, "The reference store (Postgres) is unavailable")
	kShutdown    = newKind("shutting-down", http.StatusServiceUnavailable, "The server is shutting down")
	kCancelled   = newKind("cancelled", 499, "The client closed the request")
	kInternal    = newKind("internal-error", http.StatusInternalServerError, "Internal server error")
	// Access control (auth.go).
	kUnauthorized    = newKind("unauthorized", http.StatusUnauthorized, "A valid API key is required")
	kForbidden       = newKind("forbidden", http.StatusForbidden, "The API key lacks the scope this call needs")
	kRateLimited     = newKind("rate-limited", http.StatusTooManyRequests, "Too many requests with this API key")
	kAuthUnavailable = newKind("auth-unavailable", http.StatusServiceUnavailable, "The API key could not be checked")
	// Hardening.
	kHeadersTooLarge = newKind("headers-too-large", http.StatusRequestHeaderFieldsTooLarge, "The request headers are too large")
	kTimeout         = newKind("request-timeout", http.StatusRequestTimeout, "The request body did not arrive in time")
	kVersion         = newKind("http-version-not-supported", http.StatusHTTPVersionNotSupported, "The HTTP version is not supported")
)

// ProblemTypes lists every problem type slug the API can return.
func ProblemTypes() []string {
	var out []string
	for _, k := range []kind{kInvalid, kTooLarge, kMediaType, kNotFound, kMethod, kNoResource, kHeld, kWaitTimeout,
		kLost, kNotHolder, kStale, kQuorum, kFencing, kExpired, kStore, kShutdown, kCancelled, kInternal,
		kUnauthorized, kForbidden, kRateLimited, kAuthUnavailable, kHeadersTooLarge, kTimeout, kVersion, kPrecond} {
		out = append(out, k.slug)
	}
	return out
}

// requestError is a client error found by the API layer itself.
type requestError struct {
	kind   kind
	detail string
	// params and parts name each problem of an invalid-request: parts[i]
	// is the sentence of params[i] (detail is them all).
	params []InvalidParam
	parts  []string
	// more counts problems found past maxProblems (see badRequest).
	more int
	// unreadable: the body could not be read as a JSON object, so its
	// fields were not judged.
	unreadable bool
	// identityOnly: the body had a content coding; the answer says only
	// identity is accepted (Accept-Encoding).
	identityOnly bool
	// cause is logged, never shown: it may hold addresses or Go's wording.
	cause error
}

func (e *requestError) Error() string {
	if e.cause == nil {
		return e.detail
	}
	return e.detail + ": " + e.cause.Error()
}

// invalid is an invalid-request with one problem: detail says it in a
// sentence, p names it.
func invalid(detail string, p InvalidParam) error {
	return &requestError{kind: kInvalid, detail: detail, params: []InvalidParam{p}, parts: []string{detail}}
}

// unreadableBody is invalid for a body whose fields cannot be judged (not
// read, not JSON, not an object).
func unreadableBody(detail, reason string, cause error) error {
	return &requestError{kind: kInvalid, detail: detail, params: []InvalidParam{{Name: "body", Reason: reason}},
		parts: []string{detail}, unreadable: true, cause: cause}
}

// badRequest gathers the problems of a request, so that one
// invalid-request answer names them all. Its zero value is empty and costs
// nothing until a problem is added.
type badRequest struct {
	params []InvalidParam
	parts  []string
	// more counts the problems past maxProblems, named only by number.
	more int
	// unreadable: the body's fields could not be read (see requestError).
	unreadable bool
	cause      error
}

// maxProblems bounds the problems one answer names: a body of a million
// unknown members must not get an answer (and a log line) a dozen times its
// size.
const maxProblems = 16

// add records a problem: detail is its sentence, p names it. The same
// problem twice (a member repeated) is recorded once; past maxProblems,
// problems are only counted.
func (b *badRequest) add(detail string, p InvalidParam) {
	if slices.Contains(b.params, p) {
		return
	}
	if len(b.params) >= maxProblems {
		b.more++
		return
	}
	b.params = append(b.params, p)
	b.parts = append(b.parts, detail)
}

// merge records the problems of err, an error of validation (nil for
// none). It returns err unrecorded when err is not an invalid-request: a
// problem of the request as a whole (413, 415, 408), which answers alone.
func (b *badRequest) merge(err error) error {
	if err == nil {
		return nil
	}
	re, ok := err.(*requestError)
	if !ok || re.kind != kInvalid {
		return err
	}
	for i := range re.params {
		b.add(re.parts[i], re.params[i])
	}
	b.more += re.more
	b.unreadable = b.unreadable || re.unreadable
	if b.cause == nil {
		b.cause = re.cause
	}
	return nil
}

// has reports whether a problem names name.
func (b *badRequest) has(name string) bool {
	for i := range b.params {
		if b.params[i].Name == name {
			return true
		}
	}
	return false
}

// err returns the invalid-request naming every problem, or nil for none.
func (b *badRequest) err() error {
	if len(b.params) == 0 {
		return nil
	}
	detail := b.parts[0]
	if n := len(b.parts) + b.more; n > 1 {
		detail = strconv.Itoa(n) + " problems: " + strings.Join(b.parts, "; ")
		if b.more > 0 {
			detail += "; and " + strconv.Itoa(b.more) + " more"
		}
	}
	return &requestError{kind: kInvalid, detail: detail, params: b.params, parts: b.parts, more: b.more, unreadable: b.unreadable, cause: b.cause}
}

// whole reports whether err, from reading a body, is about the request as
// a whole (413, 415, 408) and so answers alone, before any field.
func whole(err error) bool {
	re, ok := err.(*requestError)
	return err != nil && (!ok || re.kind != kInvalid)
}

// errTree is the errors of an error tree in the order errors.Is and
// errors.As visit them (depth first, each error before what it wraps), for
// the several tests that classify and describe an error: errors.Is and As
// would each unwrap it again, and a *service.Error allocates the slice of
// what it wraps on each Unwrap.
type errTree []error

// flatten returns the errors of err's tree, in buf if it fits.
func flatten(buf []error, err error) errTree {
	var stackBuf [4]error
	stack := append(stackBuf[:0], err)
	for len(stack) > 0 {
		e := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		for e != nil {
			buf = append(buf, e)
			switch x := e.(type) {
			case interface{ Unwrap() error }:
				e = x.Unwrap()
			case interface{ Unwrap() []error }:
				kids := x.Unwrap()
				e = nil
				if len(kids) > 0 {
					e = kids[0]
					for i := len(kids) - 1; i >= 1; i-- {
						stack = append(stack, kids[i])
					}
				}
			default:
				e = nil
			}
		}
	}
	return buf
}

// is reports what errors.Is(err, target) does, for a comparable target.
func (t errTree) is(target error) bool {
	for _, e := range t {
		if e == target {
			return true
		}
		if x, ok := e.(interface{ Is(error) bool }); ok && x.Is(target) {
			return true
		}
	}
	return false
}

// asErr returns what errors.As(err, &target) would set for a target of
// type P.
func asErr[P interface {
	*T
	error
}, T any](t errTree) (P, bool) {
	for _, e := range t {
		if v, ok := e.(P); ok {
			return v, true
		}
		if x, ok := e.(interface{ As(any) bool }); ok {
			var v P
			if x.As(&v) {
				return v, true
			}
		}
	}
	return nil, false
}

// classify maps an error to its row of the table. The order matters: a wait
// timeout also matches the reason of its last attempt.
func classify(err error) kind {
	var buf [8]error
	return flatten(buf[:0], err).classify()
}

func (t errTree) classify() kind {
	if re, ok := asErr[*requestError](t); ok {
		return re.kind
	}
	if ae, ok := asErr[*authError](t); ok {
		return ae.kind
	}
	switch {
	case t.is(service.ErrInvalid):
		return kInvalid
	case t.is(service.ErrWaitStopped):
		return kShutdown
	case t.is(service.ErrWaitTimeout) && t.is(service.ErrHeld):
		return kWaitTimeout
	case t.is(service.ErrHeld):
		return kHeld
	case t.is(service.ErrQuorum):
		return kQuorum
	case t.is(service.ErrFencing):
		return kFencing
	case t.is(service.ErrExpired):
		return kExpired
	case t.is(service.ErrLost):
		return kLost
	case t.is(service.ErrNotHolder):
		return kNotHolder
	case t.is(fencing.ErrStale):
		return kStale
	case t.is(refstore.ErrNotFound):
		return kNoResource
	case t.is(refstore.ErrPrecondition):
		return kPrecond
	case t.is(refstore.ErrInvalidData):
		return kInvalid
	case t.is(refstore.ErrUnavailable):
		return kStore
	case t.is(context.Canceled):
		return kCancelled
	}
	return kInternal
}

// retryAfterMS is d in whole milliseconds, rounded up: a wait that is due
// in less than one is 1, since 0 means "unknown".
func retryAfterMS(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64((d + time.Millisecond - 1) / time.Millisecond)
}

func retryAfterHeader(w http.ResponseWriter, d time.Duration) {
	secs := max(int64(math.Ceil(d.Seconds())), 1)
	v := ""
	if secs < 100 {
		v = smallInts[secs]
	} else {
		v = strconv.FormatInt(secs, 10)
	}
	setHeader(w, "Retry-After", v)
}

// smallInts are the decimal strings of 0 to 99.
var smallInts = func() (s [100]string) {
	for i := range s {
		s[i] = strconv.Itoa(i)
	}
	return s
}()

// writeError writes err as problem+json and logs what the client must not see.
func (h *Handler) writeError(w http.ResponseWriter, r *http.Request, err error) {
	var buf [8]error
	h.writeErrorTree(w, r, err, flatten(buf[:0], err))
}

// writeErrorTree is writeError with err's tree flattened by the caller.
func (h *Handler) writeErrorTree(w http.ResponseWriter, r *http.Request, err error, tree errTree) {
	k := tree.classify()
	p := &Problem{Type: k.typ, Title: k.title, Status: k.status, Instance: instance(r), RequestID: requestID(r.Context())}
	re, isRE := asErr[*requestError](tree)
	ae, isAE := asErr[*authError](tree)
	stale, isStale := asErr[*fencing.StaleError](tree)
	switch {
	case isRE:
		p.Detail, p.InvalidParams = re.detail, re.params
		if re.identityOnly {
			setHeader(w, "Accept-Encoding", "identity")
		}
		if k == kTimeout && r.ProtoMajor == 1 {
			// The rest of the body may still come: this connection
			// cannot carry another request (RFC 9110 §15.5.9). (HTTP/2
			// resets the stream alone; Connection: close there would end
			// every stream of the connection.)
			setHeader(w, "Connection", "close")
		}
	case isAE:
		ae.describe(w, p)
	case isStale:
		cur := int64(stale.Current)
		p.CurrentFencingToken = &cur
		// Name the name, not the storage key: a tenant's key is
		// "tenant/name", and the answer must read the same in every namespace.
		shown := *stale
		if _, name, ok := strings.Cut(shown.Key, "/"); ok {
			shown.Key = name
		}
		p.Detail = strings.TrimPrefix(shown.Error(), "fencing: ")
	case k == kPrecond:
		if pe, ok := asErr[*refstore.PreconditionError](tree); ok && pe.Version > 0 {
			v := pe.Version
			p.CurrentVersion = &v
			setHeader(w, "ETag", etag(v))
			p.Detail = fmt.Sprintf("the document is at version %d (ETag %s)", v, etag(v))
			if r.Method != http.MethodGet && r.Method != http.MethodHead {
				p.Detail += ": nothing was written; read it again before writing"
			}
		} else {
			p.Detail = "there is no document under this name: nothing was written"
		}
	case k == kNoResource:
		p.Detail = "no document has been written under this name"
	case tree.is(refstore.ErrInvalidData):
		if de, ok := asErr[*refstore.DataError](tree); ok {
			p.Detail = "data " + de.Reason
			p.InvalidParams = []InvalidParam{{Name: "data", Reason: de.Reason}}
			break
		}
		p.Detail = "Postgres cannot store this data"
		p.InvalidParams = []InvalidParam{{Name: "data", Reason: "not storable in Postgres"}}
	case k == kStore && r.Method == http.MethodGet:
		p.Detail = "Postgres did not answer in time (or no connection of the documents' pool was free); the document could not be read"
	case k == kStore && tree.is(refstore.ErrOutcomeUnknown):
		p.Detail = "Postgres did not answer the write's commit in time; the write may or may not have been applied (its commit may still land): read the document before writing again"
	case k == kStore:
		p.Detail = "Postgres did not answer in time (or no connection of the documents' pool was free); nothing was written"
	case tree.is(service.ErrInvalid):
		p.Detail = err.Error()
	case tree.is(errAnswerLate) && k == kExpired:
		p.Detail = "the lock was granted, but this server stalled until its lease ran out before the answer could be sent; the grant is withdrawn: acquire again"
	case tree.is(errAnswerLate) && k == kLost:
		p.Detail = "the lease was extended, but this server stalled until it ran out before the answer could be sent; acquire again to get a new fencing token"
	}
	if se, ok := asErr[*service.Error](tree); ok {
		if len(se.Nodes) > 0 {
			p.Nodes = make([]NodeOutcome, 0, len(se.Nodes))
		}
		for _, n := range se.Nodes {
			o := NodeOutcome{Address: n.Addr, Outcome: n.Outcome.String()}
			if n.Err != nil {
				var ne *service.NodeError
				if errors.Is(n.Err, service.ErrMemoryLost) {
					o.Error = memoryLost
				} else if errors.As(n.Err, &ne) {
					o.Error = nodeErrorText(ne.Err)
				} else {
					o.Error = nodeErrorText(n.Err)
				}
			}
			p.Nodes = append(p.Nodes, o)
		}
		switch k {
		case kHeld, kWaitTimeout:
			ms := retryAfterMS(se.RetryAfter)
			p.RetryAfterMS = &ms
			retryAfterHeader(w, se.RetryAfter)
			p.Detail = "the lock is held on a majority of nodes; retry after retry_after_ms or pass wait_ms"
			if k == kWaitTimeout {
				p.Detail = "the lock was still held when wait_ms ran out; retry after retry_after_ms or wait longer"
			}
		case kQuorum:
			p.Detail = quorumDetail(se.Nodes)
			if se.RetryAfter > 0 { // only quarantines keep a majority from counting
				ms := retryAfterMS(se.RetryAfter)
				p.RetryAfterMS = &ms
				retryAfterHeader(w, se.RetryAfter)
			}
		case kFencing:
			switch se.Op {
			case "extend":
				p.Detail = "Postgres could not confirm that this grant is the newest, so the lease was not extended; your deadline stands"
			case "status":
				p.Detail = "Postgres did not answer, so the lock's fencing token is unknown"
			default:
				p.Detail = "Postgres did not issue a fencing token, so nothing was granted"
				if tree.is(fencing.ErrExhausted) {
					p.Detail = "this name has been issued its last fencing token (2^53-1, the most JSON carries exactly), so it can be granted no more: use another name"
				}
			}
		case kExpired:
			p.Detail = "a majority was won but the lease ran out before the fencing token was issued; nothing was granted"
		case kShutdown:
			p.Detail = "this server is shutting down, so the waiting acquire stopped before it was granted; nothing was granted: retry, on another server if there is one"
		case kLost:
			p.Detail = "the lease expired or was superseded; acquire again to get a new fencing token"
		case kNotHolder:
			p.Detail = "no node holds this lock with this token (already released or expired)"
		}
	}
	if k.status == http.StatusServiceUnavailable && p.RetryAfterMS == nil {
		retryAfterHeader(w, time.Second)
	}
	level := slog.LevelInfo
	if k.status >= 500 && k.status != kCancelled.status {
		level = slog.LevelWarn
	}
	if k == kInternal {
		level = slog.LevelError
	}
	// err quotes the client's text at most (a name, a field name), which
	// may hold an API key or the request's own lock token.
	if ctx := r.Context(); h.raw.Enabled(ctx, level) {
		h.logRecord(ctx, time.Now(), PrincipalFrom(ctx), level, "request failed", slog.String("request_id", p.RequestID),
			slog.String("problem", k.slug), slog.String("error", redact(r, err.Error())))
	}
	if k == kCancelled && errors.Is(context.Cause(r.Context()), ErrCutShort) {
		if st := stateFrom(r.Context()); st != nil {
			st.rw.code, st.rw.aborted = k.status, true // logged as cancelled, not answered
			return
		}
		panic(http.ErrAbortHandler)
	}
	writeProblem(w, r, p)
}

// writeProblem writes p, the answer to r, without the secrets r's client
// may have put in the text it quotes (see redactProblem).
func writeProblem(w http.ResponseWriter, r *http.Request, p *Problem) {
	redactProblem(r, p)
	buf := getBuf()
	defer putBuf(buf)
	*buf = appendProblem(*buf, p)
	writeBody(w, p.Status, "application/problem+json", *buf)
}

// redactProblem replaces the secrets p quotes with "[redacted]" (see
// redact): an API key or r's own lock token pasted into the path, the
// method, a field name or an owner may be quoted by the detail, the
// invalid_params and the instance, and a key's name by a node's error.
func redactProblem(r *http.Request, p *Problem) {
	p.Instance = redact(r, p.Instance)
	p.Detail = redact(r, p.Detail)
	copied := false
	for i, ip := range p.InvalidParams {
		name, reason := redact(r, ip.Name), redact(r, ip.Reason)
		if name == ip.Name && reason == ip.Reason {
			continue
		}
		if !copied { // the slice may be a requestError's
			p.InvalidParams, copied = slices.Clone(p.InvalidParams), true
		}
		p.InvalidParams[i] = InvalidParam{Name: name, Reason: reason}
	}
	for i := range p.Nodes {
		p.Nodes[i].Error = redact(r, p.Nodes[i].Error)
	}
}

// redact returns s, text a client sent that is logged or echoed, with the
// secret of every API key in it (apikey.Redact) and every copy of the
// request's own lock token (its Lock-Token header) replaced by
// "[redacted]", wherever the client put them: in the path, the method or a
// field name.
func redact(r *http.Request, s string) string {
	s = apikey.Redact(s)
	for _, t := range r.Header[LockTokenHeader] {
		if len(t) == lockTokenLen && base64URL(t) {
			s = strings.ReplaceAll(s, t, "[redacted]")
		}
	}
	return s
}

// maxShownPath bounds the path a problem or an access line quotes. Only a
// request refused for its size or its route has a longer one, and quoting
// it back whole (up to MaxHeaderBytes, 64 KiB by default) helps nobody.
const maxShownPath = 1024

// shownMethod is the request's method as a problem's detail and the access
// log quote it: redacted (see redact) and, like the path, cut after
// maxShownPath bytes and ended in "...". A method is a token (ASCII), so
// the cut splits no character.
func shownMethod(r *http.Request) string {
	m := redact(r, r.Method)
	if len(m) > maxShownPath {
		m = m[:maxShownPath] + "..."
	}
	return m
}

// instance is the problem's instance, and the path the access log shows:
// the request's path as sent, with the secret of an API key in it redacted,
// even when the path spells part of the key percent-encoded. A path longer
// than maxShownPath is cut there (before a split %XX) and ends in "...".
func instance(r *http.Request) string {
	p := redactedPath(r)
	if len(p) <= maxShownPath {
		return p
	}
	n := maxShownPath
	if i := strings.LastIndexByte(p[n-2:n], '%'); i >= 0 {
		n -= 2 - i
	}
	return p[:n] + "..."
}

// redactedPath is instance before the cut.
func redactedPath(r *http.Request) string {
	p := r.URL.EscapedPath()
	if secret, ok := tokenInPath(r); ok {
		// base64url needs no escaping: the sent path spells it as is,
		// unless the client escaped some of it (then the decoded path).
		if !strings.Contains(p, secret) {
			p = (&url.URL{Path: r.URL.Path}).EscapedPath()
		}
		return strings.Replace(p, secret, "[redacted]", 1)
	}
	// The request's own lock token, wherever the path has it, and those
	// past a lock's name (see tokensPastName): a client that put one in
	// the wrong place. They are redacted last, from whichever spelling the
	// API keys leave.
	var toks []string
	for _, t := range append(tokensPastName(r.URL.Path), r.Header[LockTokenHeader]...) {
		if len(t) != lockTokenLen || !base64URL(t) || !strings.Contains(r.URL.Path, t) {
			continue
		}
		toks = append(toks, t)
		if !strings.Contains(p, t) {
			p = (&url.URL{Path: r.URL.Path}).EscapedPath()
		}
	}
	if apikey.Redact(r.URL.Path) != r.URL.Path { // the decoded path holds any key the sent one does
		red := apikey.Redact(p)
		if u, err := url.PathUnescape(red); err != nil || u != apikey.Redact(r.URL.Path) {
			// A key spelt partly percent-encoded: the decoded path,
			// redacted, in the canonical spelling, with the mark as
			// Redact writes it elsewhere.
			red = strings.ReplaceAll((&url.URL{Path: apikey.Redact(r.URL.Path)}).EscapedPath(), "%5Bredacted%5D", "[redacted]")
		}
		p = red // otherwise no key spelt partly percent-encoded: redacted as sent
	}
	for _, t := range toks {
		p = strings.ReplaceAll(p, t, "[redacted]")
	}
	return p
}

// quorumDetail says why no majority was reached, from the nodes' outcomes.
func quorumDetail(nodes []service.NodeResult) string {
	var failed, quarantined int
	for _, n := range nodes {
		switch n.Outcome {
		case service.Failed, service.Timeout:
			failed++
		case service.Quarantined:
			quarantined++
		}
	}
	majority := len(nodes)/2 + 1
	switch {
	case len(nodes) == 0 || len(nodes)-failed < majority:
		return "fewer Redis nodes than a majority answered; see nodes"
	case len(nodes)-failed-quarantined < majority:
		return fmt.Sprintf("fewer Redis nodes than a majority count: of %d nodes, %d are quarantined (they restarted without their data, or may evict keys: their answers do not count until their quarantine ends) and %d did not answer; see nodes", len(nodes), quarantined, failed)
	case quarantined > 0 || failed > 0:
		return fmt.Sprintf("no majority either way: of %d nodes, %d did not answer and %d are quarantined (their answers do not count), and the others' answers split; retry (see nodes)", len(nodes), failed, quarantined)
	default:
		return "no majority either way: the nodes' answers split; retry (see nodes)"
	}
}

// nodeErrorText says what went wrong with one node for a client: a timeout
// as one sentence whatever layer noticed it, a broken connection without
// this server's socket addresses or Go's wording, anything else (the
// node's own error reply, a refusal) as it is.
func nodeErrorText(err error) string {
	var ne net.Error
	var oe *net.OpError
	switch {
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded),
		errors.As(err, &ne) && ne.Timeout():
		return "no answer within the per-node timeout"
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
		return "the node closed the connection"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "connection refused (is the node running?)"
	case errors.As(err, &oe):
		return "connection failed: " + oe.Op + ": " + fmt.Sprint(oe.Err)
	}
	return err.Error()
}
