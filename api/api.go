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
	"net/http"
	"net/url"
	"strings"
	"time"
	"unicode"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/time/rate"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/keyspace"
	"github.com/redfence/redfence/service"
	"github.com/redfence/redfence/store"
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

// Store is the reference store as the API uses it (*store.DB).
type Store interface {
	PutResource(ctx context.Context, key string, token fencing.Token, data json.RawMessage) (*store.Resource, error)
	GetResource(ctx context.Context, key string) (*store.Resource, error)
	Ping(ctx context.Context) error
}

// LockTokenHeader carries the lock token to extend and release.
const LockTokenHeader = "Lock-Token"

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
}

// Handler serves the API.
type Handler struct {
	locker Locker
	store  Store
	opts   Options
	log    *slog.Logger
	router *chi.Mux
	m      *metrics
	limits *limiter
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
	opts.Logger = slog.New(principalLog{opts.Logger.Handler()})
	if opts.StoreTimeout <= 0 {
		opts.StoreTimeout = 2 * time.Second
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	h := &Handler{locker: locker, store: st, opts: opts, log: opts.Logger, m: newMetrics(opts.Registry)}
	h.limits = newLimiter(rate.Limit(opts.RateLimit), opts.RateBurst)
	h.router = h.routes()
	return h
}

// ServeHTTP implements http.Handler.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) { h.router.ServeHTTP(w, r) }

// Routes returns the router, for route listing in tests and docs.
func (h *Handler) Routes() chi.Routes { return h.router }

func (h *Handler) routes() *chi.Mux {
	r := chi.NewRouter()
	r.Use(h.requestID, h.recoverer, h.accessLog, h.limitHeaders)
	r.NotFound(func(w http.ResponseWriter, r *http.Request) {
		writeProblem(w, &Problem{Type: ProblemTypePrefix + kNotFound.slug, Title: kNotFound.title, Status: kNotFound.status,
			Detail: "no route " + r.URL.Path, Instance: r.URL.Path, RequestID: requestID(r.Context())})
	})
	r.MethodNotAllowed(func(w http.ResponseWriter, req *http.Request) {
		var allow []string
		for _, m := range []string{http.MethodGet, http.MethodPost, http.MethodPut, http.MethodDelete} {
			if r.Match(chi.NewRouteContext(), m, req.URL.Path) {
				allow = append(allow, m)
			}
		}
		w.Header().Set("Allow", strings.Join(allow, ", "))
		writeProblem(w, &Problem{Type: ProblemTypePrefix + kMethod.slug, Title: kMethod.title, Status: kMethod.status,
			Detail:   fmt.Sprintf("%s is not allowed here; use %s", req.Method, strings.Join(allow, ", ")),
			Instance: req.URL.Path, RequestID: requestID(req.Context())})
	})

	r.Get("/healthz", h.healthz)
	r.Get("/readyz", h.readyz)
	r.With(h.authorize(store.ScopeAdmin)).Method(http.MethodGet, "/metrics", promhttp.HandlerFor(h.opts.Registry, promhttp.HandlerOpts{}))
	r.Get("/openapi.yaml", h.openapi)

	r.Route("/v1", func(r chi.Router) {
		locks, resources, admin := r.With(h.authorize(store.ScopeLocks)), r.With(h.authorize(store.ScopeResources)), r.With(h.authorize(store.ScopeAdmin))
		locks.Post("/locks/{name}", h.acquire)
		locks.Get("/locks/{name}", h.status)
		locks.Delete("/locks/{name}", h.release)
		locks.Post("/locks/{name}/extend", h.extend)
		resources.Put("/resources/{name}", h.putResource)
		resources.Get("/resources/{name}", h.getResource)
		admin.Get("/nodes", h.nodes)
	})
	return r
}

// key validates the {name} path parameter and returns its storage key.
func (h *Handler) key(r *http.Request) (name, key string, err error) {
	name, err = url.PathUnescape(chi.URLParam(r, "name"))
	if err != nil {
		return name, "", invalid("the name in the path is not valid percent-encoding", InvalidParam{Name: "name", Reason: "bad percent-encoding"})
	}
	if reason := keyspace.ValidName(name); reason != "" {
		return name, "", invalid("the name in the path is invalid: "+reason, InvalidParam{Name: "name", Reason: reason})
	}
	return name, keyspace.Key(h.opts.Namespace(r), name), nil
}

// lockToken reads the Lock-Token header: the 27-character base64url token
// acquire returned.
func lockToken(r *http.Request) (string, error) {
	v := r.Header.Values(LockTokenHeader)
	if len(v) != 1 {
		return "", invalid(fmt.Sprintf("exactly one %s header is required, got %d", LockTokenHeader, len(v)),
			InvalidParam{Name: LockTokenHeader, Reason: "required, once"})
	}
	t := v[0]
	if len(t) != 27 || strings.Trim(t, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_") != "" {
		return "", invalid(LockTokenHeader+" is malformed: want the 27-character lock_token returned by acquire",
			InvalidParam{Name: LockTokenHeader, Reason: "must be 27 characters of base64url"})
	}
	return t, nil
}

// decode reads a JSON body into v strictly: one object, no unknown fields, no
// trailing data, at most MaxBodyBytes. An empty body leaves v unchanged when
// optional is true.
func (h *Handler) decode(w http.ResponseWriter, r *http.Request, v any, optional bool) error {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, h.opts.MaxBodyBytes))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return &requestError{kind: kTooLarge, detail: fmt.Sprintf("the body exceeds %d bytes", mbe.Limit)}
		}
		return invalid("could not read the body: " + err.Error())
	}
	if len(bytes.TrimSpace(body)) == 0 {
		if optional {
			return nil
		}
		return invalid("a JSON body is required", InvalidParam{Name: "body", Reason: "required"})
	}
	ct := r.Header.Get("Content-Type")
	if mt, _, err := mime.ParseMediaType(ct); err != nil || (mt != "application/json" && !strings.HasSuffix(mt, "+json")) {
		return &requestError{kind: kMediaType, detail: fmt.Sprintf("Content-Type %q is not application/json", ct)}
	}
	if body := bytes.TrimSpace(body); body[0] != '{' {
		return invalid("the body must be a JSON object", InvalidParam{Name: "body", Reason: "must be a JSON object"})
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return invalid("the body is not valid: "+jsonReason(err), InvalidParam{Name: "body", Reason: jsonReason(err)})
	}
	if _, err := dec.Token(); err != io.EOF {
		return invalid("the body has data after the JSON object", InvalidParam{Name: "body", Reason: "trailing data"})
	}
	return nil
}

func jsonReason(err error) string {
	var se *json.SyntaxError
	var te *json.UnmarshalTypeError
	switch {
	case errors.As(err, &se):
		return fmt.Sprintf("malformed JSON at byte %d", se.Offset)
	case errors.As(err, &te):
		if te.Field != "" {
			return fmt.Sprintf("field %q must be %s, got %s", te.Field, jsonType(te.Type.Kind().String()), te.Value)
		}
		return fmt.Sprintf("must be a JSON object, got %s", te.Value)
	case errors.Is(err, io.ErrUnexpectedEOF):
		return "truncated JSON"
	case strings.HasPrefix(err.Error(), "json: unknown field "):
		return "unknown field " + strings.TrimPrefix(err.Error(), "json: unknown field ")
	}
	return err.Error()
}

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

// millis validates an optional millisecond field.
func millis(name string, v *int64, def time.Duration) (time.Duration, error) {
	if v == nil {
		return def, nil
	}
	if *v < 0 || *v > int64(24*time.Hour/time.Millisecond) {
		return 0, invalid(name+" is out of range", InvalidParam{Name: name, Reason: "must be a non-negative number of milliseconds"})
	}
	return time.Duration(*v) * time.Millisecond, nil
}

// serviceBounds turns a *service.InvalidError into an invalid-request naming
// the JSON field.
func serviceBounds(err error) error {
	var ie *service.InvalidError
	if errors.As(err, &ie) {
		field := ie.Field + "_ms"
		return invalid(field+" "+ie.Reason, InvalidParam{Name: field, Reason: ie.Reason})
	}
	return err
}

func (h *Handler) acquire(w http.ResponseWriter, r *http.Request) {
	name, key, err := h.key(r)
	var req AcquireRequest
	if err == nil {
		err = h.decode(w, r, &req, true)
		if err == nil {
			err = h.doAcquire(w, r, name, key, &req)
		}
	}
	if err != nil {
		outcome := classifyOutcome(err)
		h.m.acquire(outcome)
		owner := ""
		if req.Owner != nil {
			owner = *req.Owner
		}
		h.audit(r, slog.LevelInfo, "lock refused", name, owner, 0, outcome)
		h.writeError(w, r, err)
	}
}

func (h *Handler) doAcquire(w http.ResponseWriter, r *http.Request, name, key string, req *AcquireRequest) error {
	ttl, err := millis("ttl_ms", req.TTLMS, h.opts.DefaultTTL)
	if err != nil {
		return err
	}
	wait, err := millis("wait_ms", req.WaitMS, 0)
	if err != nil {
		return err
	}
	owner := ""
	if req.Owner != nil {
		owner = *req.Owner
		if reason := validOwner(owner); reason != "" {
			return invalid("owner is invalid: "+reason, InvalidParam{Name: "owner", Reason: reason})
		}
	}
	start := time.Now()
	g, err := h.locker.Acquire(r.Context(), key, service.Request{TTL: ttl, Wait: wait, Owner: owner})
	if err != nil {
		return serviceBounds(err)
	}
	h.m.acquire("granted")
	h.m.acquireSeconds.Observe(time.Since(start).Seconds())
	h.audit(r, slog.LevelInfo, "lock granted", name, owner, g.Fencing, "granted", slog.Int64("ttl_ms", ttl.Milliseconds()))
	w.Header().Set("Location", "/v1/locks/"+name)
	writeJSON(w, http.StatusCreated, h.lockResponse(name, g, true))
	return nil
}

func validOwner(s string) string {
	if len(s) > 256 {
		return "must be at most 256 bytes"
	}
	for _, c := range s {
		if c == unicode.ReplacementChar || !unicode.IsPrint(c) {
			return "must be printable UTF-8 text"
		}
	}
	return ""
}

func (h *Handler) lockResponse(name string, g *service.Grant, withToken bool) *LockResponse {
	resp := &LockResponse{
		Name:         name,
		FencingToken: int64(g.Fencing),
		TTLMS:        g.TTL.Milliseconds(),
		ValidityMS:   max(g.Validity(h.opts.Now()).Milliseconds(), 0),
		ExpiresAt:    g.Expires.UTC().Format(time.RFC3339Nano),
		Owner:        g.Owner,
	}
	if withToken {
		resp.LockToken = g.Token
	}
	return resp
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
	if name, key, err = h.key(r); err != nil {
		return name, key, "", err
	}
	token, err = lockToken(r)
	return name, key, token, err
}

func (h *Handler) doExtend(w http.ResponseWriter, r *http.Request) error {
	name, key, token, err := h.held(r)
	if err != nil {
		return err
	}
	var req ExtendRequest
	if err := h.decode(w, r, &req, true); err != nil {
		return err
	}
	ttl, err := millis("ttl_ms", req.TTLMS, h.opts.DefaultTTL)
	if err != nil {
		return err
	}
	g, err := h.locker.Extend(r.Context(), key, token, ttl)
	if err != nil {
		owner, ft := h.lookupGrant(r, slog.LevelInfo, key, token)()
		h.audit(r, slog.LevelInfo, "lock extend refused", name, owner, ft, classifyOutcome(err))
		return serviceBounds(err)
	}
	h.m.extensions.WithLabelValues("extended").Inc()
	h.audit(r, slog.LevelDebug, "lock extended", name, g.Owner, g.Fencing, "extended", slog.Int64("ttl_ms", ttl.Milliseconds()))
	writeJSON(w, http.StatusOK, h.lockResponse(name, g, false))
	return nil
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
	grant := h.lookupGrant(r, slog.LevelInfo, key, token) // for the audit line, in parallel
	start := time.Now()
	if err := h.locker.Release(r.Context(), key, token); err != nil {
		owner, ft := grant()
		h.audit(r, slog.LevelInfo, "lock release refused", name, owner, ft, classifyOutcome(err))
		return err
	}
	h.m.releaseSeconds.Observe(time.Since(start).Seconds())
	h.m.releases.WithLabelValues("released").Inc()
	owner, ft := grant()
	h.audit(r, slog.LevelInfo, "lock released", name, owner, ft, "released")
	w.WriteHeader(http.StatusNoContent)
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
	if err != nil {
		return err
	}
	var req PutResourceRequest
	if err := h.decode(w, r, &req, false); err != nil {
		return err
	}
	var params []InvalidParam
	if req.FencingToken == nil {
		params = append(params, InvalidParam{Name: "fencing_token", Reason: "required"})
	} else if *req.FencingToken < 1 {
		params = append(params, InvalidParam{Name: "fencing_token", Reason: "must be at least 1"})
	}
	if len(req.Data) == 0 {
		params = append(params, InvalidParam{Name: "data", Reason: "required (any JSON value)"})
	}
	if len(params) > 0 {
		return invalid("the body is missing or has invalid fields", params...)
	}
	ctx, cancel := context.WithTimeout(r.Context(), h.opts.StoreTimeout)
	defer cancel()
	res, err := h.store.PutResource(ctx, key, fencing.Token(*req.FencingToken), req.Data)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, resourceJSON(name, res))
	return nil
}

func resourceJSON(name string, res *store.Resource) *Resource {
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
	res, err := h.store.GetResource(ctx, key)
	if err != nil {
		h.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, resourceJSON(name, res))
}

func (h *Handler) nodes(w http.ResponseWriter, r *http.Request) {
	ns := h.locker.Nodes(r.Context())
	resp := &NodeList{Quorum: h.locker.Quorum(), Nodes: make([]Node, len(ns))}
	for i, n := range ns {
		resp.Nodes[i] = Node{Address: n.Addr, Up: n.Up, LatencyMS: float64(n.Latency.Microseconds()) / 1000}
		if !n.QuarantinedUntil.IsZero() {
			resp.Nodes[i].QuarantinedUntil = n.QuarantinedUntil.UTC().Format(time.RFC3339Nano)
		}
		if n.Up {
			resp.Up++
		} else if n.Err != nil {
			resp.Nodes[i].Error = n.Err.Error()
		}
	}
	writeJSON(w, http.StatusOK, resp)
}

func (h *Handler) healthz(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, &Health{Status: "ok"})
}

func (h *Handler) readyz(w http.ResponseWriter, r *http.Request) {
	ns := h.locker.Nodes(r.Context())
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
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	if err := h.store.Ping(ctx); err != nil {
		ph.Up, ph.Error = false, "postgres does not answer"
		h.log.LogAttrs(r.Context(), slog.LevelWarn, "readiness: postgres down", slog.String("error", err.Error()))
	}
	resp := &Health{Status: "ready", Redis: rh, Postgres: ph}
	code := http.StatusOK
	if rh.Up < rh.Quorum || !ph.Up {
		resp.Status, code = "unavailable", http.StatusServiceUnavailable
		retryAfterHeader(w, time.Second)
	}
	writeJSON(w, code, resp)
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
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = encodeJSON(w, v)
}
