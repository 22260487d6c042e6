// Package api is Redfence's HTTP/JSON interface: a chi router, handlers,
// request validation, RFC 9457 problem+json errors and middleware.
//
// Guarantees: a request that fails validation changes nothing; every error
// body is application/problem+json with a stable type; lock tokens are only
// ever written in the body of a successful acquire, never in logs, GET
// responses or errors.
package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net"
	"net/http"
	"net/url"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/time/rate"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/apikey"
	"github.com/redfence/redfence/internal/keyspace"
	"github.com/redfence/redfence/internal/refstore"
	"github.com/redfence/redfence/service"
)

// Locker is the lock manager as the API uses it (*service.Locker).
type Locker interface {
	Acquire(ctx context.Context, key string, req service.Request) (*service.Grant, error)
	Extend(ctx context.Context, key, token string, ttl time.Duration) (*service.Grant, error)
	Release(ctx context.Context, key, token string) error
	Status(ctx context.Context, key string) (*service.Status, error)
	Nodes(ctx context.Context) []service.NodeStatus
	Quorum() int
}

// granter is a Locker that can tell it grants nothing for now
// (*service.Locker: its heartbeat in the registry is stale).
type granter interface {
	Granting() error
}

// Store is the reference store as the API uses it (*store.DB).
type Store interface {
	PutResourceIf(ctx context.Context, key string, token fencing.Token, data json.RawMessage, cond refstore.Condition) (*refstore.Resource, error)
	GetResource(ctx context.Context, key string) (*refstore.Resource, error)
	Ping(ctx context.Context) error
}

// answerTimeout bounds writing the answer of a blocking acquire (which may
// outlast the server's WriteTimeout), and the release of a grant whose
// client left.
const answerTimeout = 10 * time.Second

// LockTokenHeader carries the lock token to extend and release.
const LockTokenHeader = "Lock-Token"

// lockTokenLen is the length of a lock token: 20 random bytes in unpadded
// base64url.
const lockTokenLen = 27

// Options tunes a Handler. Zero fields take the documented defaults.
type Options struct {
	// DefaultTTL is used when a request gives no ttl_ms. The default is 10s.
	DefaultTTL time.Duration
	// MaxBodyBytes bounds request bodies (413 above). The default is 1 MiB.
	MaxBodyBytes int64
	// MaxHeaderBytes bounds the request line and headers (431 above). The
	// default is 64 KiB. Give the http.Server a larger MaxHeaderBytes: its
	// own refusal is plain text, this one is problem+json.
	MaxHeaderBytes int
	// Logger receives one line per request and failures. The default discards.
	// The access, audit and failure lines carry no source location (their
	// records have no program counter).
	Logger *slog.Logger
	// Registry receives the HTTP metrics and is served at /metrics. The
	// default is a new registry.
	Registry *prometheus.Registry
	// Namespace returns the namespace of a request (a tenant). The default
	// is the API key's tenant (Tenant) with Auth, else the default namespace.
	Namespace func(*http.Request) string
	// Auth, if set, requires an API key with the route's scope on every /v1
	// route and /metrics (see auth.go). Nil leaves the API open.
	Auth Authenticator
	// RateLimit is the requests per second each API key may send on
	// average (a token bucket per key; needs Auth). The default, 0, is no
	// limit.
	RateLimit float64
	// RateBurst is how many requests an API key may send at once. The
	// default is RateLimit rounded up.
	RateBurst int
	// StoreTimeout bounds each reference-store call, including the wait for
	// a pooled connection, so an exhausted pool answers 503 quickly. The
	// default is 2s.
	StoreTimeout time.Duration
	// Now is the clock for validity. The default is time.Now.
	Now func() time.Time
	// OpenAPI is the spec served at /openapi.yaml.
	OpenAPI []byte
	// QuietAccessLog logs the access line of every request ("http
	// request") at debug instead of info: the audit lines stay at info.
	// Successful probes and scrapes (/healthz, /readyz, /metrics) are
	// logged at debug anyway.
	QuietAccessLog bool
	// WriteTimeout is the serving http.Server's WriteTimeout. It bounds
	// every answer but a blocking acquire's, which sets its own write
	// deadline as it starts: its wait plus WriteTimeout (HTTP/2 resets a
	// stream whose deadline passes, even while its handler waits). 0: the
	// server has none.
	WriteTimeout time.Duration
}

// Handler serves the API.
type Handler struct {
	locker Locker
	store  Store
	opts   Options
	log    *slog.Logger
	// raw is the handler of Options.Logger, for the lines that add the
	// principal themselves (the hot path) or must not have it.
	raw    slog.Handler
	router *chi.Mux
	m      *metrics
	limits *limiter
	ids    *requestIDs
	routes routeLabels
	grants *grantCache
	// acquireH and releaseH serve POST and DELETE /v1/locks/{name} past
	// the router: authorization and the handler.
	acquireH, releaseH http.Handler
	// drain is closed by Drain: blocking acquires stop waiting.
	drain chan struct{}
	// audits counts the audit lines written after their handler returned
	// (see auditGrant); auditMu guards it and waited, set by Wait, after
	// which such lines are written before their handler returns.
	audits  sync.WaitGroup
	auditMu sync.Mutex
	waited  bool
	// lookups holds a token per grant lookup in Postgres under way (see
	// lookupGrant).
	lookups   chan struct{}
	drainOnce sync.Once
	// unready is set by Unready: /readyz fails.
	unready atomic.Bool
	// ready runs /readyz's checks: concurrent requests share one run, so
	// a flood of unauthenticated probes asks the backends one at a time.
	ready readiness
	// readyJoined, if set (tests), is called once a /readyz request has
	// joined or started a check.
	readyJoined func()
	// ttlMS and waitMS are the bounds of ttl_ms and wait_ms: the
	// Locker's (see lockerBounds).
	ttlMS, waitMS msBounds
}

// Unready makes /readyz answer 503 shutting-down from now on, while every
// other request is served as before: a load balancer takes the server out of
// its pool before it shuts down (REDFENCE_SHUTDOWN_DELAY).
func (h *Handler) Unready() { h.unready.Store(true) }

// Drain ends the wait of every blocking acquire, in flight or to come: each
// answers 503 shutting-down after its current try (a free lock is still
// granted). A server calls it as its shutdown begins, so that waiting
// clients retry elsewhere at once instead of holding the shutdown up. It
// may be called more than once.
func (h *Handler) Drain() {
	h.drainOnce.Do(func() { close(h.drain) })
}

// Wait waits for the audit lines still to be written after their requests
// were answered (each waits 1 s at most for Postgres); from then on such
// lines are written before their handler returns. A server calls it once it
// stopped serving (a handler may still run if its shutdown timed out),
// before it closes the store.
func (h *Handler) Wait() {
	h.auditMu.Lock()
	h.waited = true // no line is left to a goroutine any more
	h.auditMu.Unlock()
	h.audits.Wait()
}

// NewHandler returns the API over locker and st.
func NewHandler(locker Locker, st Store, opts Options) *Handler {
	if opts.DefaultTTL <= 0 {
		opts.DefaultTTL = 10 * time.Second
	}
	if opts.MaxBodyBytes <= 0 {
		opts.MaxBodyBytes = 1 << 20
	}
	if opts.MaxHeaderBytes <= 0 {
		opts.MaxHeaderBytes = 64 << 10
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Registry == nil {
		opts.Registry = prometheus.NewRegistry()
	}
	if opts.Namespace == nil {
		opts.Namespace = Tenant
	}
	raw := opts.Logger.Handler()
	opts.Logger = slog.New(principalLog{raw})
	if opts.StoreTimeout <= 0 {
		opts.StoreTimeout = 2 * time.Second
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	h := &Handler{locker: locker, store: st, opts: opts, log: opts.Logger, raw: raw, m: newMetrics(opts.Registry),
		ids: newRequestIDs(), grants: newGrantCache(), drain: make(chan struct{}), lookups: make(chan struct{}, maxGrantLookups)}
	h.ttlMS, h.waitMS = lockerBounds(locker)
	h.limits = newLimiter(rate.Limit(opts.RateLimit), opts.RateBurst)
	h.router = h.newRouter()
	h.acquireH = h.authorize(apikey.ScopeLocks)(http.HandlerFunc(h.acquire))
	h.releaseH = h.authorize(apikey.ScopeLocks)(http.HandlerFunc(h.release))
	return h
}

// lockRoute is the route of the lock: its acquire and release skip the
// router.
const (
	lockRoute  = "/v1/locks/{name}"
	lockPrefix = "/v1/locks/"
)

// ServeHTTP implements http.Handler.
//
// Acquire and release (POST and DELETE /v1/locks/{name}), most of the
// traffic, go past the router straight to the same middleware and handler:
// the router's context, path values and pattern joins cost more than the
// rest of the routing. Only requests the router would certainly send there
// take this way (TestFastRoute compares): a path of the form
// /v1/locks/NAME with no escaped form of its own (the router would route
// on that), NAME not empty and without a slash, and no router already in
// the context (a Handler mounted in another chi router).
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if next, name := h.fastRoute(r); next != nil {
		h.serve(w, r, name, lockRoute, next)
		return
	}
	h.router.ServeHTTP(w, r)
}

// fastRoute returns the handler and the raw {name} of a request that can
// skip the router, or nil.
func (h *Handler) fastRoute(r *http.Request) (http.Handler, string) {
	var next http.Handler
	switch r.Method {
	case http.MethodPost:
		next = h.acquireH
	case http.MethodDelete:
		next = h.releaseH
	default:
		return nil, ""
	}
	p := r.URL.Path
	if r.URL.RawPath != "" || len(p) <= len(lockPrefix) || p[:len(lockPrefix)] != lockPrefix ||
		strings.IndexByte(p[len(lockPrefix):], '/') >= 0 || r.Context().Value(chi.RouteCtxKey) != nil {
		return nil, ""
	}
	return next, p[len(lockPrefix):]
}

// Routes returns the router, for route listing in tests and docs.
func (h *Handler) Routes() chi.Routes { return h.router }

func (h *Handler) newRouter() *chi.Mux {
	r := chi.NewRouter()
	r.Use(h.front)
	notFound := func(w http.ResponseWriter, r *http.Request) {
		if st := stateFrom(r.Context()); st != nil {
			st.route = "unmatched" // not "/v1/*", the mount it fell into
		}
		if r.ProtoMajor == 2 && r.Method == "PRI" && r.RequestURI == "*" {
			// HTTP/2's preface (prior knowledge) on an HTTP/1 connection:
			// net/http hands it over rather than answering 505 itself.
			w.Header().Set("Connection", "close")
			writeProblem(w, r, &Problem{Type: kVersion.typ, Title: kVersion.title, Status: kVersion.status,
				Detail:   "this server speaks HTTP/2 only over TLS, or without TLS where REDFENCE_H2C is on; send HTTP/1.1",
				Instance: instance(r), RequestID: requestID(r.Context())})
			return
		}
		detail := "no route " + instance(r)
		if r.URL.Path == "" && r.Method == http.MethodConnect {
			// CONNECT host:port: an authority, no path (and no URI
			// reference, so no instance either).
			host := r.URL.Host
			if len(host) > maxShownPath {
				host = strings.ToValidUTF8(host[:maxShownPath], "") + "..."
			}
			detail = "no route for CONNECT " + host + ": this server is not a proxy"
		}
		writeProblem(w, r, &Problem{Type: kNotFound.typ, Title: kNotFound.title, Status: kNotFound.status,
			Detail: detail, Instance: instance(r), RequestID: requestID(r.Context())})
	}
	r.NotFound(notFound)
	// endpoints are the patterns that serve something (filled in below):
	// a mount's own path (/v1) matches too, yet serves nothing.
	endpoints := map[string]bool{}
	r.MethodNotAllowed(func(w http.ResponseWriter, req *http.Request) {
		var allow []string
		for _, m := range []string{http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodDelete} {
			rctx := chi.NewRouteContext()
			if r.Match(rctx, m, routePath(req)) && endpoints[rctx.RoutePattern()] &&
				// an empty {name} is not found whatever the method (nameRequired)
				!(strings.Contains(rctx.RoutePattern(), "{name}") && rctx.URLParam("name") == "") {
				allow = append(allow, m)
			}
		}
		if len(allow) == 0 {
			// chi answers 405 to a method it does not know on any path:
			// a path that serves no method is not found (RFC 9110 §15.5.6:
			// a 405's Allow lists what the target supports).
			notFound(w, req)
			return
		}
		method := shownMethod(req)
		if req.Method == http.MethodHead {
			// HEAD is answered as GET would be, without the body: its
			// Content-Length must be the GET answer's (RFC 9110 §8.6).
			method = http.MethodGet
		}
		w.Header().Set("Allow", strings.Join(allow, ", "))
		writeProblem(w, req, &Problem{Type: kMethod.typ, Title: kMethod.title, Status: kMethod.status,
			Detail:   fmt.Sprintf("%s is not allowed here; use %s", method, strings.Join(allow, ", ")),
			Instance: instance(req), RequestID: requestID(req.Context())})
	})

	// get routes GET, and HEAD to the same handler: net/http sends no body
	// for HEAD (RFC 9110 §9.3.2: HEAD wherever GET).
	get := func(r chi.Router, pattern string, hf http.Handler) {
		r.Method(http.MethodGet, pattern, hf)
		r.Method(http.MethodHead, pattern, hf)
	}
	get(r, "/healthz", http.HandlerFunc(h.healthz))
	get(r, "/readyz", http.HandlerFunc(h.readyz))
	get(r.With(h.authorize(apikey.ScopeAdmin)), "/metrics", promhttp.HandlerFor(h.opts.Registry, promhttp.HandlerOpts{}))
	get(r, "/openapi.yaml", http.HandlerFunc(h.openapi))

	r.Route("/v1", func(r chi.Router) {
		// An empty {name} (the router matches /v1/locks//extend) names no
		// operation: 404, as for any unknown path, before authorization.
		named := r.With(nameRequired(notFound))
		locks, resources, admin := named.With(h.authorize(apikey.ScopeLocks)), named.With(h.authorize(apikey.ScopeResources)), r.With(h.authorize(apikey.ScopeAdmin))
		locks.Post("/locks/{name}", h.acquire)
		get(locks, "/locks/{name}", http.HandlerFunc(h.status))
		locks.Delete("/locks/{name}", h.release)
		locks.Post("/locks/{name}/extend", h.extend)
		resources.Put("/resources/{name}", h.putResource)
		get(resources, "/resources/{name}", http.HandlerFunc(h.getResource))
		get(admin, "/nodes", http.HandlerFunc(h.nodes))
	})
	_ = chi.Walk(r, func(_, route string, _ http.Handler, _ ...func(http.Handler) http.Handler) error {
		endpoints[route] = true
		return nil
	})
	return r
}

// nameRequired answers a request whose {name} is empty with notFound.
func nameRequired(notFound http.HandlerFunc) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if chi.URLParam(r, "name") != "" {
				next.ServeHTTP(w, r)
				return
			}
			notFound(w, r)
		})
	}
}

// utf8Label reports whether a charset names UTF-8: "utf-8" or one of its
// aliases in the WHATWG Encoding Standard ("utf8" and the rest), in any case.
func utf8Label(cs string) bool {
	switch strings.ToLower(cs) {
	case "utf-8", "utf8", "unicode-1-1-utf-8", "unicode11utf8", "unicode20utf8", "x-unicode20utf8":
		return true
	}
	return false
}

// routePath is the path as the router matches it: the request's spelling
// when net/http kept it (RawPath), the decoded path otherwise.
func routePath(r *http.Request) string {
	if r.URL.RawPath != "" {
		return r.URL.RawPath
	}
	return r.URL.Path
}

// key validates the {name} path parameter and returns its storage key.
func (h *Handler) key(r *http.Request) (name, key string, err error) {
	// The path is percent-decoded once, by net/http. The router matches
	// r.URL.RawPath when the request spelled the path in a way its decoded
	// form does not give back (an escaped "/", say): only then is the
	// parameter still encoded.
	if st := stateFrom(r.Context()); st != nil && st.name != "" {
		name = st.name // fastRoute's, from the decoded path
	} else if name = chi.URLParam(r, "name"); r.URL.RawPath != "" {
		if name, err = url.PathUnescape(name); err != nil {
			return name, "", invalid("the name in the path is not valid percent-encoding", InvalidParam{Name: "name", Reason: "bad percent-encoding"})
		}
	}
	reason := keyspace.ValidName(name)
	if reason == "" && apikey.Redact(name) != name {
		// A name is shown to every reader of the lock, and echoed in
		// its answers: a key in it, even cut short, would be handed to
		// them (as owners).
		reason = "must not hold an API key, whole or cut short (rf_, a key id, _ and part of the secret: every reader of the lock is shown its name)"
	}
	if r.URL.RawQuery != "" || r.URL.ForceQuery {
		// Closed, as the bodies are (a bare "?" too: a client that
		// meant to send a query and sent none): a ttl_ms or a lock_token put in the
		// query would be ignored, and the request served as if it were
		// not there. Its text is not echoed (it may hold a secret).
		var bad badRequest
		if reason != "" {
			bad.add("the name in the path is invalid: "+reason, InvalidParam{Name: "name", Reason: reason})
		}
		bad.add("the request has a query string, which this API does not take: request fields go in the JSON body, the lock token in the "+LockTokenHeader+" header",
			InvalidParam{Name: "query", Reason: queryReason})
		return name, "", bad.err()
	}
	if reason != "" {
		return name, "", invalid("the name in the path is invalid: "+reason, InvalidParam{Name: "name", Reason: reason})
	}
	if h.opts.Auth != nil && PrincipalFrom(r.Context()) == nil {
		// A route that skipped authorize (a bug): fail closed rather than
		// act in the default namespace, which is no tenant's.
		return name, "", errNoPrincipal
	}
	return name, keyspace.Key(h.opts.Namespace(r), name), nil
}

// errNoPrincipal is key's error for a request with no API key checked while
// access control is on: a 500, never the shared namespace.
var errNoPrincipal = errors.New("api: a lock or document call reached its handler without an API key checked")

// queryReason is why a query string is refused.
const queryReason = "must be absent: no operation on a lock or a document takes query parameters"

// lockToken reads the Lock-Token header: the 27-character base64url token
// acquire returned.
func lockToken(r *http.Request) (string, error) {
	v := r.Header[LockTokenHeader] // canonical: Values without canonicalising
	if len(v) != 1 {
		return "", invalid(fmt.Sprintf("exactly one %s header is required, got %d", LockTokenHeader, len(v)),
			InvalidParam{Name: LockTokenHeader, Reason: "required, once"})
	}
	t := v[0]
	if len(t) != lockTokenLen || !base64URL(t) {
		return "", invalid(LockTokenHeader+" is malformed: want the 27-character lock_token returned by acquire",
			InvalidParam{Name: LockTokenHeader, Reason: "must be 27 characters of base64url"})
	}
	return t, nil
}

// tokenInPath returns the {name} of a release or an extend when it has the
// shape of a lock token and the Lock-Token header is missing, malformed or
// the same: most likely a lock token put in the path by a client that
// swapped its arguments. Being a secret, it is redacted from the path the
// access log and problems show (see instance).
func tokenInPath(r *http.Request) (string, bool) {
	p := r.URL.Path
	if len(p) <= len(lockPrefix) || p[:len(lockPrefix)] != lockPrefix {
		return "", false
	}
	name := p[len(lockPrefix):]
	switch {
	case r.Method == http.MethodDelete:
	case r.Method == http.MethodPost && strings.HasSuffix(name, "/extend"):
		name = name[:len(name)-len("/extend")]
	default:
		return "", false
	}
	if len(name) != lockTokenLen || !base64URL(name) {
		return "", false
	}
	if v := r.Header[LockTokenHeader]; len(v) == 1 && v[0] != name && len(v[0]) == lockTokenLen && base64URL(v[0]) {
		return "", false // a well-formed token of its own: the name is a name
	}
	return name, true
}

// base64URL reports whether s is made of the base64url alphabet only.
func base64URL(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// header returns the first value of the header key, which must be in
// canonical form: Header.Get without canonicalising.
func header(h http.Header, key string) string {
	if v := h[key]; len(v) > 0 {
		return v[0]
	}
	return ""
}

// decode reads a JSON body into v strictly: one object, no unknown fields, no
// trailing data, at most MaxBodyBytes. An empty body leaves v unchanged when
// optional is true.
func (h *Handler) decode(_ http.ResponseWriter, r *http.Request, v any, optional bool) error {
	buf := getBuf()
	defer putBuf(buf)
	body, err := h.readJSON(r, buf, optional)
	if err != nil || body == nil {
		return err
	}
	return decodeJSON(body, v)
}

// decodeAcquire is decode for an acquire body: plain bodies take a fast
// path (fastAcquireRequest), the rest encoding/json's.
func (h *Handler) decodeAcquire(r *http.Request, req *AcquireRequest) error {
	buf := getBuf()
	defer putBuf(buf)
	body, err := h.readJSON(r, buf, true)
	if err != nil || body == nil || fastAcquireRequest(body, req) {
		return err
	}
	slow := new(AcquireRequest) // escapes, as anything encoding/json decodes into
	err = decodeJSON(body, slow)
	*req = *slow // what was decoded before an error too, as decode would leave it
	return err
}

// readJSON reads the body of r into *buf and checks it is a JSON object
// sent as JSON: it returns the body, or nil for an empty body when optional
// is true. The body aliases *buf.
func (h *Handler) readJSON(r *http.Request, buf *[]byte, optional bool) ([]byte, error) {
	if r.ContentLength > h.opts.MaxBodyBytes {
		// Refused unread: a client that sent Expect: 100-continue is
		// told before it uploads (net/http sends 100 on the first read).
		return nil, &requestError{kind: kTooLarge, detail: fmt.Sprintf("the body exceeds %d bytes", h.opts.MaxBodyBytes)}
	}
	if r.ContentLength > 0 {
		// A body declared non-empty is refused for its encoding or media
		// type unread too, for the same reason; a chunked one only once
		// read, since an empty body takes the defaults whatever its type.
		if err := mediaTypeError(r); err != nil {
			return nil, err
		}
	}
	body, err := readBody((*buf)[:0], r.Body, h.opts.MaxBodyBytes)
	*buf = body
	if err != nil {
		return nil, bodyReadError(err)
	}
	if len(body) == 0 {
		// Only an empty body takes the defaults: whitespace is not a
		// JSON text (it is refused below, as any non-object).
		if optional {
			return nil, nil
		}
		return nil, unreadableBody("a JSON body is required", "required", nil)
	}
	if r.ContentLength <= 0 { // else checked before the read
		if err := mediaTypeError(r); err != nil {
			return nil, err
		}
	}
	if bytes.HasPrefix(body, utf8BOM) {
		// RFC 8259 §8.1: a JSON text MUST NOT begin with a byte-order
		// mark (a parser MAY ignore one); Redfence refuses it, as it
		// refuses everything but one plain JSON object, so that what it
		// accepts reads the same to every JSON parser.
		return nil, unreadableBody("the body starts with a UTF-8 byte-order mark, which JSON text must not (RFC 8259 §8.1): send the JSON object without it",
			"must not start with a byte-order mark", nil)
	}
	if i := skipJSONSpace(body, 0); i == len(body) {
		detail := "the body holds only whitespace: send a JSON object"
		if optional {
			detail += ", or no body at all for the defaults"
		}
		return nil, unreadableBody(detail, "must be a JSON object", nil)
	} else if body[i] != '{' {
		return nil, unreadableBody("the body must be a JSON object", "must be a JSON object", nil)
	}
	return body, nil
}

// mediaTypeError returns the 415 for a non-empty body of r that is not
// plain JSON: one with a Content-Encoding other than identity, more than
// one Content-Type, or a Content-Type that is not JSON or names a charset
// other than UTF-8; or nil.
func mediaTypeError(r *http.Request) error {
	if ce := r.Header["Content-Encoding"]; len(ce) > 0 && !(len(ce) == 1 && strings.EqualFold(strings.TrimSpace(ce[0]), "identity")) {
		// RFC 9110 §15.5.16: 415 for a content coding the server does
		// not take, and Accept-Encoding names the ones it does.
		return &requestError{kind: kMediaType, detail: "the body must be sent without Content-Encoding (identity)", identityOnly: true}
	}
	if len(r.Header["Content-Type"]) > 1 {
		return &requestError{kind: kMediaType, detail: "the request has more than one Content-Type header"}
	}
	ct := header(r.Header, "Content-Type")
	if ct != "application/json" { // what ParseMediaType would accept at once
		mt, params, err := mime.ParseMediaType(ct)
		if err != nil || !jsonMediaType(mt) {
			// The header's value is not quoted: it is the client's, and
			// could be anything, a secret pasted by mistake included.
			return &requestError{kind: kMediaType, detail: "the Content-Type is not application/json"}
		}
		if cs, ok := params["charset"]; ok && !utf8Label(cs) {
			return &requestError{kind: kMediaType, detail: "the Content-Type names a charset other than UTF-8; JSON is UTF-8 (RFC 8259)"}
		}
	}
	return nil
}

// utf8BOM is the UTF-8 encoding of U+FEFF, the byte-order mark.
var utf8BOM = []byte("\xef\xbb\xbf")

// jsonMediaType reports whether mt, a media type as mime.ParseMediaType
// returns it (lower case), is JSON: application/json, or a type/subtype
// whose subtype has the +json suffix after a name (RFC 6839 §3.1).
func jsonMediaType(mt string) bool {
	typ, sub, ok := strings.Cut(mt, "/")
	if !ok || typ == "" {
		return false
	}
	if typ == "application" && sub == "json" {
		return true
	}
	name, found := strings.CutSuffix(sub, "+json")
	return found && name != ""
}

// bodyReadError is the answer to a body that could not be read: 413 past
// the limit, 408 when the server's read timeout ran out first, 503
// shutting-down when the server closed the connection, else 400.
// Neither says why in Go's words, which name the connection's addresses;
// the cause is logged.
func bodyReadError(err error) error {
	var mbe *http.MaxBytesError
	var ne net.Error
	switch {
	case errors.As(err, &mbe):
		return &requestError{kind: kTooLarge, detail: fmt.Sprintf("the body exceeds %d bytes", mbe.Limit)}
	case errors.As(err, &ne) && ne.Timeout():
		return &requestError{kind: kTimeout, detail: "the body did not arrive in full before the server's read timeout; nothing was done", cause: err}
	case errors.Is(err, io.ErrUnexpectedEOF):
		return unreadableBody("the body ended early: the connection closed before the bytes its Content-Length (or chunked encoding) announced arrived",
			"ended early", err)
	case errors.Is(err, net.ErrClosed):
		// This server closed the connection under the read: its shutdown's
		// grace period ran out. Not the client's fault.
		return &requestError{kind: kShutdown, detail: "the server shut down while the body was arriving; nothing was done", cause: err}
	}
	return unreadableBody("the body could not be read", "could not be read", err)
}

// decodeJSON decodes body, a JSON object, into v (a pointer to a struct of
// at most 64 fields) with encoding/json, strictly, and names every member at
// fault: an unknown one (encoding/json would ignore it), one whose name
// matches a field only when case is ignored (which encoding/json would
// take), one that appears twice (two parsers could each take a different
// one), null for a field that is not free-form JSON (json.RawMessage), and a
// value of the wrong type. Malformed JSON and trailing data are problems of
// the body as a whole. The members that are right are decoded, even when
// others are not.
func decodeJSON(body []byte, v any) error {
	rv := reflect.ValueOf(v).Elem()
	t := rv.Type()
	dec := json.NewDecoder(bytes.NewReader(body))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return malformedJSON(err)
	}
	var bad badRequest
	var seen uint64 // bit i: field i appeared
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return malformedJSON(err)
		}
		name, _ := tok.(string)
		var raw json.RawMessage
		start := dec.InputOffset()
		if err := dec.Decode(&raw); err != nil {
			if !tooDeep(err) {
				return malformedJSON(err)
			}
			// encoding/json stops at 10,000 levels of nesting, inside this
			// member's value: the member is at fault, and what follows it
			// cannot be read.
			bad.add(deepMember(t, name, body[start:]))
			bad.unreadable = true
			return bad.err()
		}
		i, known := jsonField(t, name)
		if !known {
			bad.add(unknownField(t, name))
			continue
		}
		if seen&(1<<i) != 0 {
			bad.add(fmt.Sprintf("field %q appears more than once", name), InvalidParam{Name: name, Reason: "must appear at most once"})
			continue
		}
		seen |= 1 << i
		f := t.Field(i)
		if string(raw) == "null" && f.Type != rawMessageType {
			bad.add(nullField(v, name))
			continue
		}
		if err := json.Unmarshal(raw, rv.Field(i).Addr().Interface()); err != nil {
			rv.Field(i).SetZero() // not the pointer to 0 encoding/json leaves
			reason := typeReason(f.Type, err)
			bad.add(fmt.Sprintf("field %q %s", name, reason), InvalidParam{Name: name, Reason: reason})
		}
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return malformedJSON(err)
	}
	if _, err := dec.Token(); err != io.EOF {
		bad.add("the body has data after the JSON object", InvalidParam{Name: "body", Reason: "trailing data"})
	}
	return bad.err()
}

// tooDeep reports whether err is encoding/json's refusal of a value nested
// deeper than it reads.
func tooDeep(err error) bool {
	var se *json.SyntaxError
	return errors.As(err, &se) && strings.Contains(se.Error(), "exceeded max depth")
}

// deepMember is the problem of member name of a body decoded into struct t,
// whose value (the rest of the body, from just after the name) nests
// arrays and objects deeper than encoding/json reads: free-form JSON (data)
// is told its own limit, as a value past that limit but within
// encoding/json's is.
func deepMember(t reflect.Type, name string, rest []byte) (string, InvalidParam) {
	i, known := jsonField(t, name)
	if !known {
		return unknownField(t, name)
	}
	reason := "must not nest arrays and objects 10000 levels deep or more"
	if ft := t.Field(i).Type; ft != rawMessageType {
		if ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		reason = fmt.Sprintf("must be %s, got an array or object nested 10000 levels deep or more", jsonType(ft.Kind().String()))
	} else if de := (*refstore.DataError)(nil); errors.As(refstore.CheckJSON(rest), &de) {
		reason = de.Reason
	}
	return fmt.Sprintf("field %q %s", name, reason), InvalidParam{Name: name, Reason: reason}
}

// malformedJSON is the answer to a body that is not one JSON text.
func malformedJSON(err error) error {
	reason := "malformed JSON"
	if err != nil {
		reason = jsonReason(err)
	}
	return unreadableBody("the body is not valid JSON: "+reason, reason, nil)
}

// requiredFields is implemented by request types with fields that have no
// default: required says what such a field must be ("a positive integer").
type requiredFields interface {
	required(field string) (what string, ok bool)
}

// nullField is the problem of a member of v that is null: a field with a
// default is left out for it, a required one has none.
func nullField(v any, name string) (string, InvalidParam) {
	if rf, ok := v.(requiredFields); ok {
		if what, ok := rf.required(name); ok {
			return fmt.Sprintf("field %q is required and must be %s, not null", name, what),
				InvalidParam{Name: name, Reason: "required: " + what + ", not null"}
		}
	}
	return fmt.Sprintf("field %q must not be null (leave it out for the default)", name),
		InvalidParam{Name: name, Reason: "must not be null (leave it out for the default)"}
}

// reasonBeyondInt64 is the reason for an integer beyond 64 bits; a field
// with bounds of its own replaces it with them (badRequest.outOfBounds).
const reasonBeyondInt64 = "must fit in a 64-bit integer"

// typeReason says why encoding/json refused a value for a field of type t.
func typeReason(t reflect.Type, err error) string {
	var te *json.UnmarshalTypeError
	if !errors.As(err, &te) {
		return "is not valid: " + jsonReason(err)
	}
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t.Kind() == reflect.Int64 && isIntegerLiteral(strings.TrimPrefix(te.Value, "number ")) {
		return reasonBeyondInt64
	}
	// A number's literal is quoted, cut short as an unknown field's name is:
	// it goes into the answer and the log.
	got := te.Value
	if len(got) > len("number ")+maxQuotedField {
		got = got[:len("number ")+maxQuotedField] + "…"
	}
	return fmt.Sprintf("must be %s, got %s", jsonType(t.Kind().String()), got)
}

var rawMessageType = reflect.TypeFor[json.RawMessage]()

// jsonField returns the index of the field of struct t (of at most 64
// fields) that encoding/json names name, matching case exactly.
func jsonField(t reflect.Type, name string) (int, bool) {
	for i := range min(t.NumField(), 64) {
		f := t.Field(i)
		tag, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if tag == name && tag != "-" && f.IsExported() {
			return i, true
		}
	}
	return 0, false
}

// unknownField is the problem of an unknown member of a body decoded into
// t. The member's name (the client's) is cut short and without the secret
// of an API key pasted into it: it goes into the answer and the log.
func unknownField(t reflect.Type, name string) (string, InvalidParam) {
	shown := apikey.Redact(name)
	if len(shown) > maxQuotedField {
		shown = strings.ToValidUTF8(shown[:maxQuotedField], "") + "…"
	}
	reason := "unknown field"
	for i := range min(t.NumField(), 64) {
		tag, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ",")
		if tag != "-" && tag != "" && strings.EqualFold(tag, name) {
			reason = fmt.Sprintf("unknown field (names are case-sensitive: did you mean %q?)", tag)
			break
		}
	}
	return "unknown field " + strconv.Quote(shown) + strings.TrimPrefix(reason, "unknown field"), InvalidParam{Name: shown, Reason: reason}
}

// readBody appends body to buf, reading at most limit bytes: past that it
// returns an *http.MaxBytesError, as http.MaxBytesReader would.
func readBody(buf []byte, body io.Reader, limit int64) ([]byte, error) {
	for {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		room := buf[len(buf):cap(buf)]
		if over := int64(len(buf)) + int64(len(room)) - (limit + 1); over > 0 {
			room = room[:int64(len(room))-over] // read one byte past the limit, no more
		}
		n, err := body.Read(room)
		buf = buf[:len(buf)+n]
		if int64(len(buf)) > limit {
			return buf[:limit], &http.MaxBytesError{Limit: limit}
		}
		if err == io.EOF {
			return buf, nil
		}
		if err != nil {
			return buf, err
		}
	}
}

func jsonReason(err error) string {
	var se *json.SyntaxError
	switch {
	case errors.As(err, &se):
		// The message names a character of the body at most, or the nesting
		// limit: "invalid character 'x' after object key".
		return fmt.Sprintf("malformed JSON at byte %d: %s", se.Offset, strings.TrimPrefix(se.Error(), "json: "))
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF):
		// json.Decoder.Token says io.EOF when the body ends inside an
		// object.
		return "truncated JSON"
	}
	return err.Error()
}

// isIntegerLiteral reports whether s is a JSON number without fraction or
// exponent.
func isIntegerLiteral(s string) bool {
	s = strings.TrimPrefix(s, "-")
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// maxQuotedField bounds how much of an unknown field's name, or of a number
// of the wrong type, an error quotes.
const maxQuotedField = 64

func jsonType(kind string) string {
	switch kind {
	case "int64", "int":
		return "an integer"
	case "string":
		return "a string"
	case "ptr":
		return "a value of the documented type"
	}
	return kind
}

// msBounds are the bounds of a millisecond field, in milliseconds.
type msBounds struct {
	lo, hi int64
	// what the bounds are, for the reason.
	what string
}

// reason is why a value outside b is refused: it names the bounds, in
// milliseconds as the field, whatever the value.
func (b msBounds) reason() string {
	return fmt.Sprintf("must be from %d to %d (%s, in milliseconds)", b.lo, b.hi, b.what)
}

// lockerBounds are the bounds of ttl_ms and wait_ms: the configured ones
// of a Locker that has Options (a *service.Locker), so that a value outside
// is refused with the other problems of its request and with the bounds in
// the field's unit. Another Locker (a fake) checks its own: the API only
// keeps the milliseconds within a day.
func lockerBounds(l Locker) (ttl, wait msBounds) {
	if o, ok := l.(interface{ Options() service.Options }); ok {
		opts := o.Options()
		// Whole milliseconds within the bounds (which Durations may
		// split finer): the minimum rounded up, the maxima down.
		return msBounds{lo: int64((opts.MinTTL + time.Millisecond - 1) / time.Millisecond), hi: opts.MaxTTL.Milliseconds(), what: "the server's TTL bounds"},
			msBounds{lo: 0, hi: opts.MaxWait.Milliseconds(), what: "the server's longest wait"}
	}
	day := (24 * time.Hour).Milliseconds()
	return msBounds{lo: 0, hi: day, what: "at most a day"}, msBounds{lo: 0, hi: day, what: "at most a day"}
}

// millis validates an optional millisecond field within b, adding its
// problem to bad; def is its default.
func millis(bad *badRequest, name string, v *int64, def time.Duration, b msBounds) time.Duration {
	if v != nil && bad.has(name) {
		return def // refused already (repeated): its first value is not judged too
	}
	if v == nil {
		if len(bad.params) > 0 {
			bad.outOfBounds(name, b) // an integer beyond 64 bits is out of bounds too
		}
		return def
	}
	if *v < b.lo || *v > b.hi {
		reason := b.reason()
		bad.add(name+" "+reason, InvalidParam{Name: name, Reason: reason})
		return def
	}
	return time.Duration(*v) * time.Millisecond
}

// outOfBounds gives the field name, refused as beyond 64 bits, the reason
// of its bounds b instead.
func (b *badRequest) outOfBounds(name string, bounds msBounds) {
	b.beyondInt64(name, bounds.reason())
}

// beyondInt64 gives the field name, refused as beyond 64 bits, reason
// instead: the bounds of its own.
func (b *badRequest) beyondInt64(name, reason string) {
	for i, p := range b.params {
		if p.Name == name && p.Reason == reasonBeyondInt64 {
			b.params[i].Reason = reason
			b.parts[i] = name + " " + reason
		}
	}
}

// serviceBounds turns a *service.InvalidError into an invalid-request naming
// the JSON field.
func serviceBounds(err error) error {
	var buf [8]error
	if ie, ok := asErr[*service.InvalidError](flatten(buf[:0], err)); ok {
		field := ie.Field + "_ms"
		return invalid(field+" "+ie.Reason, InvalidParam{Name: field, Reason: ie.Reason})
	}
	return err
}

func (h *Handler) acquire(w http.ResponseWriter, r *http.Request) {
	name, key, err := h.key(r)
	var req AcquireRequest
	var sreq service.Request
	if err = h.acquireRequest(err, h.decodeAcquire(r, &req), &req, &sreq); err == nil {
		err = h.doAcquire(w, r, name, key, &sreq)
	}
	if err != nil {
		var buf [8]error
		tree := flatten(buf[:0], err)
		outcome := tree.classify().slug
		h.m.acquire(outcome)
		// Only what passed validation is logged: a refused name or owner
		// can be any text the client sent, up to the body limit.
		owner := ""
		if req.Owner != nil && validOwner(*req.Owner) == "" {
			owner = *req.Owner
		}
		if keyspace.ValidName(name) != "" {
			name = ""
		}
		if !errors.Is(err, errAnswerLate) { // that one has its own line
			h.audit(r, slog.LevelInfo, "lock refused", name, owner, 0, outcome, noTTL)
		}
		h.writeErrorTree(w, r, err, tree)
	}
}

// problems gathers the problems of a request's path and headers (pathErr)
// and of its body (bodyErr), to be answered together; a problem of the
// body as a whole (413, 415, 408) is returned instead, to answer alone.
func problems(pathErr, bodyErr error) (badRequest, error) {
	if whole(bodyErr) {
		return badRequest{}, bodyErr
	}
	var bad badRequest
	for _, err := range [2]error{pathErr, bodyErr} {
		if err := bad.merge(err); err != nil {
			return badRequest{}, err // not a client's mistake (errNoPrincipal)
		}
	}
	return bad, nil
}

// acquireRequest validates an acquire into sreq: the name (nameErr is its
// problem), the body (bodyErr, decoded into req) and each field, every
// problem named in one answer. A problem of the body as a whole (413, 415,
// 408) answers alone.
func (h *Handler) acquireRequest(nameErr, bodyErr error, req *AcquireRequest, sreq *service.Request) error {
	bad, err := problems(nameErr, bodyErr)
	if err != nil {
		return err
	}
	if bad.unreadable {
		return bad.err()
	}
	sreq.TTL = millis(&bad, "ttl_ms", req.TTLMS, h.opts.DefaultTTL, h.ttlMS)
	sreq.Wait = millis(&bad, "wait_ms", req.WaitMS, 0, h.waitMS)
	if req.Owner != nil {
		if reason := validOwner(*req.Owner); reason != "" {
			bad.add("owner is invalid: "+reason, InvalidParam{Name: "owner", Reason: reason})
		} else {
			sreq.Owner = *req.Owner
		}
	}
	return bad.err()
}

func (h *Handler) doAcquire(w http.ResponseWriter, r *http.Request, name, key string, sreq *service.Request) error {
	ttl, wait, owner := sreq.TTL, sreq.Wait, sreq.Owner
	sreq.Stop = h.drain
	if wait > 0 && h.opts.Auth != nil {
		// The key was checked before the wait, which can outlast its
		// revocation: check it again before every retry (from the cache,
		// which a revocation empties at once).
		sreq.Continue = func(context.Context) error {
			_, err := h.authenticate(r)
			return err
		}
	}
	start := time.Now()
	if wait > 0 && h.opts.WriteTimeout > 0 {
		// The server's WriteTimeout runs from the request's arrival, and
		// a wait may outlast it.
		_ = http.NewResponseController(w).SetWriteDeadline(start.Add(wait + h.opts.WriteTimeout))
	}
	g, err := h.locker.Acquire(r.Context(), key, *sreq)
	if wait > 0 {
		// The answer gets a deadline of its own, from now.
		_ = http.NewResponseController(w).SetWriteDeadline(time.Now().Add(answerTimeout))
	}
	if err != nil {
		if ae := (*authError)(nil); errors.As(err, &ae) {
			return ae
		}
		return serviceBounds(err)
	}
	if err := r.Context().Err(); err != nil {
		// The client left as the grant was made: nobody will learn the
		// lock token, so the lease is released rather than left to hold
		// the name for its TTL. Its fencing token is spent.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), answerTimeout)
		defer cancel()
		if rerr := h.locker.Release(rctx, key, g.Token); rerr != nil {
			return errors.Join(err, rerr)
		}
		return err
	}
	h.audit(r, slog.LevelInfo, "lock granted", name, owner, g.Fencing, "granted", ttl.Milliseconds())
	if h.answeredLate(r, key, g) {
		// This process stalled after the grant (a pause, a stuck log
		// destination) until the lease ended: another client may hold the
		// name by now. The grant is not answered.
		h.audit(r, slog.LevelWarn, "lock grant withdrawn: its lease ended before the answer", name, owner, g.Fencing, "lease-expired", ttl.Milliseconds())
		return fmt.Errorf("acquire %q: %w: %w", name, errAnswerLate, service.ErrExpired)
	}
	h.m.acquire("granted")
	h.m.acquireSeconds.Observe(time.Since(start).Seconds())
	h.remember(r, key, g)
	loc := r.URL.Path // "/v1/locks/"+name, without building it, when it is
	if len(loc) != len(lockPrefix)+len(name) || loc[:len(lockPrefix)] != lockPrefix || loc[len(lockPrefix):] != name {
		loc = lockPrefix + name
	}
	setHeader(w, "Location", loc)
	h.writeLock(w, http.StatusCreated, name, g, true, h.arrival(r))
	return nil
}

// remember caches the grant g of key for the audit line of its release,
// when audit lines are logged at all.
func (h *Handler) remember(r *http.Request, key string, g *service.Grant) {
	if h.raw.Enabled(r.Context(), slog.LevelInfo) {
		h.grants.put(g.Token, grantEntry{key: key, owner: g.Owner, fencing: g.Fencing, expires: g.Expires}, h.opts.Now())
	}
}

// grantFor returns the owner and fencing token of the grant lockToken
// received for key, for an audit line at level: from the cache of this
// Handler's grants, else looked up in the background (see lookupGrant); the
// returned function waits for the answer.
func (h *Handler) grantFor(r *http.Request, level slog.Level, key, lockToken string) grantAnswer {
	if !h.raw.Enabled(r.Context(), level) {
		return grantAnswer{}
	}
	if e, ok := h.grants.get(key, lockToken, h.opts.Now()); ok {
		return grantAnswer{owner: e.owner, fencing: e.fencing}
	}
	return grantAnswer{lookup: h.lookupGrant(r, level, key, lockToken)}
}

// grantAnswer is grantFor's answer: known, or being looked up.
type grantAnswer struct {
	owner   string
	fencing fencing.Token
	lookup  *grantLookup
}

// get returns the owner and fencing token, waiting for the lookup (empty
// when unknown).
func (a grantAnswer) get() (string, fencing.Token) {
	if a.lookup != nil {
		<-a.lookup.done
		return a.lookup.owner, a.lookup.token
	}
	return a.owner, a.fencing
}

// auditGrant writes the info audit line of a release or a refusal, naming
// grant's owner and fencing token. When they are still being looked up in
// Postgres (another server's grant, or one made before a restart), which
// neither a release nor a refusal needs, the line is written once the lookup
// ends (1 s at most), and the handler returns now: its answer, and the next
// request on the connection, do not wait for Postgres.
func (h *Handler) auditGrant(r *http.Request, msg, name string, grant grantAnswer, outcome string) {
	if grant.ready() {
		owner, ft := grant.get()
		h.audit(r, slog.LevelInfo, msg, name, owner, ft, outcome, noTTL)
		return
	}
	// What audit reads of r, kept apart from r, which the server is done
	// with once the handler returns: its values, and its Lock-Token
	// header (for redaction).
	later := (&http.Request{Header: http.Header{LockTokenHeader: slices.Clone(r.Header[LockTokenHeader])}}).
		WithContext(context.WithoutCancel(r.Context()))
	h.auditMu.Lock()
	defer h.auditMu.Unlock()
	if h.waited {
		// Shutting down (or a test waiting for its lines): written now.
		owner, ft := grant.get()
		h.audit(r, slog.LevelInfo, msg, name, owner, ft, outcome, noTTL)
		return
	}
	h.audits.Go(func() {
		owner, ft := grant.get()
		h.audit(later, slog.LevelInfo, msg, name, owner, ft, outcome, noTTL)
	})
}

// ready reports whether get would not wait.
func (a grantAnswer) ready() bool {
	if a.lookup == nil {
		return true
	}
	select {
	case <-a.lookup.done:
		return true
	default:
		return false
	}
}

// maxOwner is the most characters (code points) an owner may have, as
// openapi.yaml's maxLength counts them.
const maxOwner = 256

func validOwner(s string) string {
	if len(s) > maxOwner && utf8.RuneCountInString(s) > maxOwner {
		return "must be at most 256 characters (Unicode code points)"
	}
	for _, c := range s {
		switch {
		case c == unicode.ReplacementChar:
			return "must be printable UTF-8 text, not U+FFFD (which stands for invalid UTF-8)"
		case !unicode.IsPrint(c):
			return fmt.Sprintf("must be printable UTF-8 text: letters, marks, numbers, punctuation, symbols and the space U+0020, not U+%04X", c)
		}
	}
	if apikey.Redact(s) != s {
		// An owner is shown to every reader of the lock: a key in it,
		// even cut short, would be handed to them.
		return "must not hold an API key, whole or cut short (rf_, a key id, _ and part of the secret: every reader of the lock is shown its owner)"
	}
	return ""
}

// writeLock writes the LockResponse of g, encoded by hand, for a request that
// arrived at arrived. Its validity_ms counts from then, not from now: the
// client counts it from its send time, which came before, so its deadline
// falls before the lease's end however long the request took (a wait
// included).
func (h *Handler) writeLock(w http.ResponseWriter, status int, name string, g *service.Grant, withToken bool, arrived time.Time) {
	buf := getBuf()
	defer putBuf(buf)
	var expires [40]byte
	resp := LockResponse{
		Name:         name,
		FencingToken: int64(g.Fencing),
		TTLMS:        g.TTL.Milliseconds(),
		ValidityMS:   max(g.ValidityFrom(arrived).Milliseconds(), 0),
		Owner:        g.Owner,
	}
	if withToken {
		resp.LockToken = g.Token
	}
	*buf = appendLockResponse(*buf, &resp, appendRFC3339Nano(expires[:0], g.Expires))
	writeBody(w, status, "application/json", *buf)
}

func (h *Handler) extend(w http.ResponseWriter, r *http.Request) {
	if err := h.doExtend(w, r); err != nil {
		h.m.failed("extend", err)
		h.writeError(w, r, err)
	}
}

// held validates the name and the Lock-Token header of a request that acts
// on a held lock (extend, release).
func (h *Handler) held(r *http.Request) (name, key, token string, err error) {
	name, key, nameErr := h.key(r)
	token, tokenErr := lockToken(r)
	if nameErr == nil && tokenErr == nil && name == token {
		// A client that swapped its arguments: the secret is not a name
		// to act on (nor to log: see tokenInPath).
		return name, key, token, invalid("the path holds the lock token: the path takes the lock's name, the "+LockTokenHeader+" header its lock_token",
			InvalidParam{Name: "name", Reason: "is the lock token, a secret"})
	}
	if nameErr == nil && tokenErr == nil {
		return name, key, token, nil
	}
	var bad badRequest
	for _, err := range [2]error{nameErr, tokenErr} {
		if err := bad.merge(err); err != nil {
			return name, key, token, err // not a client's mistake (errNoPrincipal)
		}
	}
	return name, key, token, bad.err()
}

func (h *Handler) doExtend(w http.ResponseWriter, r *http.Request) error {
	name, key, token, err := h.held(r)
	var req ExtendRequest
	bad, err := problems(err, h.decode(w, r, &req, true))
	if err != nil {
		return err
	}
	ttl := h.opts.DefaultTTL
	if !bad.unreadable {
		ttl = millis(&bad, "ttl_ms", req.TTLMS, h.opts.DefaultTTL, h.ttlMS)
	}
	if err := bad.err(); err != nil {
		return err
	}
	g, err := h.locker.Extend(r.Context(), key, token, ttl)
	if err == nil {
		h.audit(r, slog.LevelDebug, "lock extended", name, g.Owner, g.Fencing, "extended", ttl.Milliseconds())
		if h.answeredLate(r, key, g) {
			// Stalled after the extension until its lease ended (see
			// doAcquire): the lock is lost.
			err = fmt.Errorf("extend %q: %w: %w", name, errAnswerLate, service.ErrLost)
		}
	}
	if err != nil {
		grant := h.grantFor(r, slog.LevelInfo, key, token)
		answer := serviceBounds(err)
		h.m.failed("extend", answer)
		h.writeError(w, r, answer)
		h.auditGrant(r, "lock extend refused", name, grant, classifyOutcome(err))
		return nil
	}
	h.m.extended("extended")
	h.remember(r, key, g)
	h.writeLock(w, http.StatusOK, name, g, false, h.arrival(r))
	return nil
}

// errAnswerLate is a grant or extension whose lease ended before its answer
// could be written (see answeredLate).
var errAnswerLate = errors.New("the lease ended before the answer could be sent")

// answeredLate reports whether g's lease has ended already, just before its
// answer is written: this process stalled since the grant (a pause, a log
// line held up by a stuck destination), and another client may hold the
// name by now. Its keys are then deleted, in case some node still has them.
func (h *Handler) answeredLate(r *http.Request, key string, g *service.Grant) bool {
	if h.opts.Now().Before(g.Expires) {
		return false
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), answerTimeout)
	defer cancel()
	_ = h.locker.Release(ctx, key, g.Token) // nothing to tell: the lease is over anyway
	return true
}

func (h *Handler) release(w http.ResponseWriter, r *http.Request) {
	if err := h.doRelease(w, r); err != nil {
		h.m.failed("release", err)
		h.writeError(w, r, err)
	}
}

func (h *Handler) doRelease(w http.ResponseWriter, r *http.Request) error {
	name, key, token, err := h.held(r)
	if err != nil {
		return err
	}
	grant := h.grantFor(r, slog.LevelInfo, key, token) // for the audit line; a lookup runs in parallel
	start := time.Now()
	if err := h.locker.Release(r.Context(), key, token); err != nil {
		h.m.failed("release", err)
		h.writeError(w, r, err)
		h.auditGrant(r, "lock release refused", name, grant, classifyOutcome(err))
		return nil
	}
	h.m.releaseSeconds.Observe(time.Since(start).Seconds())
	h.m.released("released")
	h.grants.drop(token)
	w.WriteHeader(http.StatusNoContent)
	h.auditGrant(r, "lock released", name, grant, "released")
	return nil
}

func (h *Handler) status(w http.ResponseWriter, r *http.Request) {
	name, key, err := h.key(r)
	if err != nil {
		h.writeError(w, r, err)
		return
	}
	st, err := h.locker.Status(r.Context(), key)
	if err != nil {
		h.m.failed("status", err)
		h.writeError(w, r, err)
		return
	}
	resp := &LockStatus{Name: name, Held: st.Held, RemainingMS: st.Remaining.Milliseconds(), LastFencingToken: int64(st.Last.Token)}
	if st.Held {
		resp.Owner = st.Last.Owner
	}
	writeJSON(w, http.StatusOK, resp)
}

func (h *Handler) putResource(w http.ResponseWriter, r *http.Request) {
	if err := h.doPut(w, r); err != nil {
		if errors.Is(err, fencing.ErrStale) {
			h.m.staleWrites.Inc()
		}
		h.writeError(w, r, err)
	}
}

func (h *Handler) doPut(w http.ResponseWriter, r *http.Request) error {
	name, key, err := h.key(r)
	var req PutResourceRequest
	bad, err := problems(err, h.decode(w, r, &req, false))
	if err != nil {
		return err
	}
	cond, cerr := putCondition(r)
	_ = bad.merge(cerr) // an invalid-request, or nil
	if !bad.unreadable {
		switch {
		case bad.has("fencing_token"): // null, not an integer, repeated: said
			bad.beyondInt64("fencing_token", "must be a positive integer at most 9007199254740991 (2^53-1)")
		case req.FencingToken == nil:
			bad.add("fencing_token is required: a positive integer (the fencing_token of your grant)",
				InvalidParam{Name: "fencing_token", Reason: "required: a positive integer"})
		case *req.FencingToken < 1:
			bad.add("fencing_token must be a positive integer (the fencing_token of your grant)",
				InvalidParam{Name: "fencing_token", Reason: "must be a positive integer"})
		case *req.FencingToken > int64(fencing.MaxToken):
			bad.add("fencing_token must be at most 9007199254740991 (2^53-1, the largest token issued)",
				InvalidParam{Name: "fencing_token", Reason: "must be at most 9007199254740991 (2^53-1)"})
		}
		if len(req.Data) == 0 {
			bad.add("data is required (any JSON value)", InvalidParam{Name: "data", Reason: "required (any JSON value)"})
		} else if err := refstore.CheckJSON(req.Data); err != nil {
			// What Postgres would refuse, refused with the rest (the
			// store checks it again).
			var de *refstore.DataError
			if errors.As(err, &de) {
				bad.add("data "+de.Reason, InvalidParam{Name: "data", Reason: de.Reason})
			}
		}
	}
	if err := bad.err(); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.opts.StoreTimeout)
	defer cancel()
	res, err := h.store.PutResourceIf(ctx, key, fencing.Token(*req.FencingToken), req.Data, cond)
	if err != nil {
		return err
	}
	setHeader(w, "ETag", etag(res.Version))
	writeJSON(w, http.StatusOK, resourceJSON(name, res))
	return nil
}

func resourceJSON(name string, res *refstore.Resource) *Resource {
	return &Resource{Name: name, Data: res.Data, FencingToken: int64(res.FencingToken), Version: res.Version,
		UpdatedAt: res.UpdatedAt.UTC().Format(time.RFC3339Nano)}
}

func (h *Handler) getResource(w http.ResponseWriter, r *http.Request) {
	name, key, err := h.key(r)
	if err != nil {
		h.writeError(w, r, err)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.opts.StoreTimeout)
	defer cancel()
	// Malformed conditions are refused before the store is asked.
	im, err := parseEntityTags(r.Header, "If-Match")
	if err != nil {
		h.writeError(w, r, err)
		return
	}
	inm, err := parseEntityTags(r.Header, "If-None-Match")
	if err != nil {
		h.writeError(w, r, err)
		return
	}
	res, err := h.store.GetResource(ctx, key)
	if err != nil {
		// With no document the answer is 404 whatever the conditions: a
		// server ignores them when the request without them would fail
		// (RFC 9110 §13.2.1), as a GET of nothing does.
		h.writeError(w, r, err)
		return
	}
	setHeader(w, "ETag", etag(res.Version))
	if im.present && !im.match(res.Version) {
		h.writeError(w, r, &refstore.PreconditionError{Key: key, Version: res.Version})
		return
	}
	if inm.present && inm.noneMatch(res.Version) {
		setHeader(w, "Cache-Control", "no-store")
		w.WriteHeader(http.StatusNotModified)
		return
	}
	writeJSON(w, http.StatusOK, resourceJSON(name, res))
}

func (h *Handler) nodes(w http.ResponseWriter, r *http.Request) {
	ns := h.locker.Nodes(r.Context())
	if err := r.Context().Err(); err != nil {
		// The client left: the pings it cut short say nothing of the nodes.
		h.writeError(w, r, fmt.Errorf("nodes: %w", err))
		return
	}
	resp := &NodeList{Quorum: h.locker.Quorum(), Nodes: make([]Node, len(ns))}
	for i, n := range ns {
		resp.Nodes[i] = Node{Address: n.Addr, Up: n.Up, LatencyMS: float64(n.Latency.Microseconds()) / 1000}
		if !n.QuarantinedUntil.IsZero() {
			resp.Nodes[i].QuarantinedUntil = n.QuarantinedUntil.UTC().Format(time.RFC3339Nano)
			resp.Nodes[i].QuarantineReason = n.QuarantineReason
		}
		if n.Up {
			resp.Up++
		} else if n.Err != nil {
			resp.Nodes[i].Error = nodeErrorText(n.Err)
		}
	}
	writeJSON(w, http.StatusOK, resp)
}

func (h *Handler) healthz(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, &Health{Status: "ok"})
}

func (h *Handler) readyz(w http.ResponseWriter, r *http.Request) {
	if h.unready.Load() {
		retryAfterHeader(w, time.Second)
		writeJSON(w, http.StatusServiceUnavailable, &Health{Status: "shutting-down"})
		return
	}
	run := h.ready.join(r.Context(), h.checkReady)
	if h.readyJoined != nil {
		h.readyJoined()
	}
	select {
	case <-run.done:
		if run.panic != nil {
			panic(run.panic) // recovered as any handler's panic: a 500
		}
		code := http.StatusOK
		if run.health.Status != "ready" {
			code = http.StatusServiceUnavailable
			retryAfterHeader(w, time.Second)
		}
		writeJSON(w, code, run.health)
	case <-r.Context().Done():
		// The client left: there is nobody to answer. The last one to
		// leave a check ends it, so no later request joins a check
		// that began before it was sent.
		h.ready.leave(run)
		h.writeError(w, r, fmt.Errorf("readiness: %w", r.Context().Err()))
	}
}

// readiness runs /readyz's checks. A request joins the check running when it
// arrives, if any, else starts one, so concurrent probes share one check. A
// request's answer comes from a check that had not answered yet when it
// arrived: a check is forgotten once it answered or every request waiting
// for it left.
type readiness struct {
	mu  sync.Mutex
	run *readyRun
}

// readyRun is one check and the requests waiting for it.
type readyRun struct {
	waiters int
	cancel  context.CancelFunc
	// done is closed once health (or panic, if the check panicked) is set.
	done   chan struct{}
	health *Health
	panic  any
}

// join returns the running check, or starts one with check. The check is not
// cut short by the client that started it (others may join it), only when
// every waiter left.
func (rd *readiness) join(ctx context.Context, check func(context.Context) *Health) *readyRun {
	rd.mu.Lock()
	defer rd.mu.Unlock()
	if run := rd.run; run != nil {
		run.waiters++
		return run
	}
	cctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	run := &readyRun{waiters: 1, cancel: cancel, done: make(chan struct{})}
	rd.run = run
	go func() {
		defer close(run.done)
		defer cancel()
		defer rd.forget(run)
		defer func() { run.panic = recover() }()
		run.health = check(cctx)
	}()
	return run
}

// leave ends a waiter's interest in run, and run itself when it was the last.
func (rd *readiness) leave(run *readyRun) {
	rd.mu.Lock()
	defer rd.mu.Unlock()
	if run.waiters--; run.waiters == 0 && rd.run == run {
		rd.run = nil
		run.cancel()
	}
}

// forget makes run's check no longer joinable.
func (rd *readiness) forget(run *readyRun) {
	rd.mu.Lock()
	defer rd.mu.Unlock()
	if rd.run == run {
		rd.run = nil
	}
}

// checkReady asks the Redis nodes, then Postgres (within 2 s), for /readyz.
func (h *Handler) checkReady(ctx context.Context) *Health {
	ns := h.locker.Nodes(ctx)
	rh := &RedisHealth{Total: len(ns), Quorum: h.locker.Quorum()}
	for _, n := range ns {
		switch {
		case !n.QuarantinedUntil.IsZero():
			rh.Quarantined++
		case n.Up:
			rh.Up++
		}
	}
	ph := &PostgresHealth{Up: true}
	pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	start := time.Now()
	if err := h.store.Ping(pctx); err != nil {
		ph.Up, ph.Error = false, "postgres does not answer"
		if ctx.Err() == nil {
			h.log.LogAttrs(ctx, slog.LevelWarn, "readiness: postgres down", slog.String("error", err.Error()))
		} else {
			// Every waiter left (probes with a short timeout): the ping
			// was cut short, which says only how long Postgres had not
			// answered.
			h.log.LogAttrs(ctx, slog.LevelInfo, "readiness: every probe left before postgres answered",
				slog.Float64("waited_ms", float64(time.Since(start).Microseconds())/1000))
		}
	}
	if g, ok := h.locker.(granter); ok && ph.Up {
		// Postgres answers, but does not record this server's heartbeat
		// (read-only, or its table locked): nothing is granted.
		if err := g.Granting(); err != nil {
			ph.Up, ph.Error = false, "postgres does not record this server's heartbeat (read-only, or blocked): nothing is granted"
			h.log.LogAttrs(ctx, slog.LevelWarn, "readiness: heartbeat not recorded", slog.String("error", err.Error()))
		}
	}
	resp := &Health{Status: "ready", Redis: rh, Postgres: ph}
	if rh.Up < rh.Quorum || !ph.Up {
		resp.Status = "unavailable"
	}
	return resp
}

func (h *Handler) openapi(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/yaml")
	_, _ = w.Write(h.opts.OpenAPI)
}

func encodeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	return enc.Encode(v)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	setHeader(w, "Content-Type", "application/json")
	setHeader(w, "Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = encodeJSON(w, v)
}
