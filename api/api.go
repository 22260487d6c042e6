// Package api is Redfence's HTTP/JSON interface: a chi router, handlers,
// request validation, RFC 9457 problem+json errors and middleware.
//
// Guarantees: a request that fails validation changes nothing; every error
// body is application/problem+json with a stable type; lock tokens are only
// ever written in the body of a successful acquire, never in logs, GET
// responses or errors.
package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

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

// ErrCutShort is the cause with which a server cancels the contexts of the
// requests still running when its shutdown's grace period ends
// (context.WithCancelCause). Such a request is cut short: it gets no answer
// (its HTTP/1 connection is closed, its HTTP/2 stream reset), as its client
// did not leave and must not be told it did (499 cancelled), nor that
// nothing was done when a write's commit may already have been sent. It is
// logged and counted as cancelled.
var ErrCutShort = errors.New("api: the server's shutdown cut the request short")

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

// tokensPastName returns the segments of a path under /v1/locks/ that
// have the shape of a lock token and that no route reads as a lock's name:
// those past the name (a lock token put in the path as a sub-resource,
// DELETE /v1/locks/NAME/TOKEN, by a client that sent no Lock-Token header),
// and the name's own segment too when what follows it is not "extend" (no
// route takes such a path: nothing is done with the name). Being secrets,
// they are redacted from the path the access log and problems show (see
// instance).
func tokensPastName(path string) []string {
	if len(path) <= len(lockPrefix) || path[:len(lockPrefix)] != lockPrefix {
		return nil
	}
	name, rest, ok := strings.Cut(path[len(lockPrefix):], "/")
	if !ok {
		return nil
	}
	var toks []string
	if rest != "extend" && len(name) == lockTokenLen && base64URL(name) {
		toks = append(toks, name)
	}
	for seg := range strings.SplitSeq(rest, "/") {
		if len(seg) == lockTokenLen && base64URL(seg) {
			toks = append(toks, seg)
		}
	}
	return toks
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
