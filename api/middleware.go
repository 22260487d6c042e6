package api

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"log/slog"
	"net/http"
	"runtime/debug"
	"strings"
	"sync/atomic"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/redfence/redfence/internal/apikey"
)

// RequestIDHeader carries the request ID, echoed on every response.
const RequestIDHeader = "X-Request-Id"

// reqState is everything the API keeps about one request, in one
// allocation: it is the request's context (the parent's, plus itself under
// stateKey), the response writer the handlers write to (recording the status
// and size for the access log), and the backing store of the response
// headers it sets.
type reqState struct {
	context.Context // the request's context as it came in

	id string
	// principal is the authenticated API key, set by authorize just before
	// the route's handler runs (nil when the API is open).
	principal *Principal
	// name is the raw {name} path parameter when the request bypassed the
	// router (see Handler.ServeHTTP); "" otherwise.
	name string
	// route is the route pattern when the request bypassed the router.
	route string
	// arrived is when the request reached the handler (Options.Now).
	arrived time.Time

	rw respWriter

	// hv backs the values of the headers set with setHeader, saving a
	// one-string slice per header.
	hv  [8]string
	nhv int
}

type stateKey struct{}

// Value implements context.Context.
func (s *reqState) Value(key any) any {
	if _, ok := key.(stateKey); ok {
		return s
	}
	return s.Context.Value(key)
}

// String describes the context, as the standard library's contexts do.
func (s *reqState) String() string { return "api.reqState" }

// stateFrom returns the state of the request whose context is ctx, or nil.
func stateFrom(ctx context.Context) *reqState {
	if s, ok := ctx.(*reqState); ok {
		return s
	}
	s, _ := ctx.Value(stateKey{}).(*reqState)
	return s
}

// arrival returns when r reached the handler; now for a request that did
// not come through it (tests calling a handler directly).
func (h *Handler) arrival(r *http.Request) time.Time {
	if st := stateFrom(r.Context()); st != nil && !st.arrived.IsZero() {
		return st.arrived
	}
	return h.opts.Now()
}

func requestID(ctx context.Context) string {
	if s := stateFrom(ctx); s != nil {
		return s.id
	}
	return ""
}

// respWriter records the status and the body size of the response, as
// chi's middleware.WrapResponseWriter did: the first final status counts,
// later WriteHeader calls are dropped, 1xx (but 101) pass through.
type respWriter struct {
	http.ResponseWriter
	st          *reqState
	code        int
	bytes       int
	wroteHeader bool
	// aborted is set instead of an answer for a request the server cut
	// short (ErrCutShort): serve aborts it once it is logged.
	aborted bool
}

func (w *respWriter) WriteHeader(code int) {
	if code >= 100 && code <= 199 && code != http.StatusSwitchingProtocols {
		w.ResponseWriter.WriteHeader(code)
	} else if !w.wroteHeader {
		w.code = code
		w.wroteHeader = true
		w.ResponseWriter.WriteHeader(code)
	}
}

func (w *respWriter) Write(b []byte) (int, error) {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	n, err := w.ResponseWriter.Write(b)
	w.bytes += n
	return n, err
}

// Flush implements http.Flusher, flushing the underlying writer if it can.
func (w *respWriter) Flush() {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// Unwrap returns the underlying writer (for http.ResponseController).
func (w *respWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// setHeader sets the header key (in canonical form) to value on w, without
// allocating its value slice when w is the API's own writer.
func setHeader(w http.ResponseWriter, key, value string) {
	hdr := w.Header()
	if rw, ok := w.(*respWriter); ok && rw.st.nhv < len(rw.st.hv) {
		s := rw.st
		i := s.nhv
		s.hv[i] = value
		s.nhv++
		hdr[key] = s.hv[i : i+1 : i+1]
		return
	}
	hdr.Set(key, value)
}

// requestIDs makes request IDs: 16 hex digits (as the OpenAPI spec says), a
// random starting point per Handler plus a counter, instead of 8 bytes from
// crypto/rand per request. They are unique per Handler (for 2^64 requests)
// and across Handlers and processes with overwhelming probability, since
// their ranges would have to overlap; the first 8 digits name the Handler
// until it served 2^32 requests. They are not secrets and need not be
// unguessable.
type requestIDs struct {
	base uint64
	n    atomic.Uint64
}

func newRequestIDs() *requestIDs {
	var b [8]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand, Go 1.24+)
	return &requestIDs{base: binary.BigEndian.Uint64(b[:]) &^ 0xffffffff}
}

func (g *requestIDs) next() string {
	v := g.base + g.n.Add(1)
	var b [16]byte
	for i := 15; i >= 0; i-- {
		b[i] = hexDigits[v&0xf]
		v >>= 4
	}
	return string(b[:])
}

// clientRequestID returns the client's X-Request-Id when it is acceptable
// (validRequestID) and shares no 8 characters in a row with a secret the
// request carries (its Lock-Token or Authorization header), so that a
// secret pasted into it, whole or in part, is never logged or echoed; ""
// otherwise.
func clientRequestID(r *http.Request) string {
	id := header(r.Header, RequestIDHeader)
	if !validRequestID(id) {
		return ""
	}
	for _, name := range [...]string{LockTokenHeader, "Authorization"} {
		for _, secret := range r.Header[name] {
			if sharesRun(id, secret, 8) {
				return ""
			}
		}
	}
	return id
}

// sharesRun reports whether s contains n characters in a row of secret.
func sharesRun(s, secret string, n int) bool {
	for i := 0; i+n <= len(secret); i++ {
		if strings.Contains(s, secret[i:i+n]) {
			return true
		}
	}
	return false
}

// validRequestID accepts a client's ID only if it is short and plain, so it
// is safe to log and echo, and cannot be a secret pasted by mistake: it
// does not start with an API key's prefix (rf_), holds no API key, whole or
// cut short (rf_ and a key id, anywhere in it), nor one without its prefix
// (a key id, _ and a whole secret), is not a key's secret alone (43
// characters of base64url: the id that makes it a key is logged with it)
// and is not of a lock token's shape (27 characters of base64url).
func validRequestID(s string) bool {
	if s == "" || len(s) > 64 || strings.HasPrefix(s, apikey.Prefix) || holdsKey(s) || apikey.HoldsBare(s) || len(s) == lockTokenLen && base64URL(s) {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return false
		}
	}
	return true
}

// probeRoute reports whether route serves health probes or metric
// scrapes: their successful requests are logged at debug.
func probeRoute(route string) bool {
	switch route {
	case "/healthz", "/readyz", "/metrics":
		return true
	}
	return false
}

// holdsKey reports whether s holds an API key, whole or cut short.
func holdsKey(s string) bool {
	_, ok := apikey.FindID(s)
	return ok
}

// front is the middleware every request goes through, in this order:
//   - the request ID: the client's X-Request-Id if acceptable, or a new one,
//     echoed in the response and kept in the request's state;
//   - recovery: a panic becomes a logged 500 problem;
//   - the access log: one line per request and the HTTP metrics, with the
//     method, path, status and timing only: never headers (Lock-Token) or
//     bodies;
//   - the header limit: a request line and headers over MaxHeaderBytes get
//     a 431 problem.
func (h *Handler) front(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.serve(w, r, "", "", next)
	})
}

// serve runs front's steps and then next. name and route are set for a
// request that bypasses the router (see Handler.ServeHTTP).
func (h *Handler) serve(w http.ResponseWriter, r *http.Request, name, route string, next http.Handler) {
	st := &reqState{Context: r.Context(), name: name, route: route, arrived: h.opts.Now()}
	st.rw = respWriter{ResponseWriter: w, st: st}
	id := clientRequestID(r)
	if id == "" {
		id = h.ids.next()
	}
	st.id = id
	setHeader(&st.rw, RequestIDHeader, id)
	// Every answer is JSON, problem+json or text in its declared type: a
	// browser must not guess another.
	st.rw.Header()["X-Content-Type-Options"] = []string{"nosniff"}
	r = r.WithContext(st)
	if route != "" {
		r.Pattern = route // as the router sets it
	}
	defer h.recoverPanic(w, r)
	defer func() {
		if st.rw.aborted {
			// After the access line: net/http closes the connection
			// (HTTP/1) or resets the stream (HTTP/2) without an answer.
			panic(http.ErrAbortHandler)
		}
	}()

	start := time.Now()
	if n := headerBytes(r); n > h.opts.MaxHeaderBytes {
		st.route = "" // refused before routing: "unmatched", as with the router
		h.writeError(&st.rw, r, &requestError{kind: kHeadersTooLarge,
			detail: fmt.Sprintf("the request line and headers take %d bytes; the limit is %d", n, h.opts.MaxHeaderBytes)})
	} else {
		next.ServeHTTP(&st.rw, r)
	}
	end := time.Now()
	d := end.Sub(start)
	status := st.rw.code
	if status == 0 {
		status = http.StatusOK
	}
	route = st.route
	if route == "" {
		route = h.routes.label(chi.RouteContext(r.Context()))
	}
	h.m.request(route, r.Method, status, d)
	level := slog.LevelInfo
	if h.opts.QuietAccessLog || status < 400 && probeRoute(route) {
		// Probes and scrapes that succeed, every few seconds, say nothing
		// an operator needs at info.
		level = slog.LevelDebug
	}
	if !h.raw.Enabled(r.Context(), level) {
		return
	}
	sent := st.rw.bytes
	if r.Method == http.MethodHead {
		sent = 0 // net/http drops a HEAD answer's body
	}
	h.logRecord(r.Context(), end, nil, level, "http request",
		slog.String("request_id", id),
		slog.String("method", shownMethod(r)),
		slog.String("path", instance(r)),
		slog.String("route", route),
		slog.Int("status", status),
		slog.Int("bytes", sent),
		slog.Float64("duration_ms", float64(d.Microseconds())/1000),
		slog.String("remote", r.RemoteAddr))
}

// recoverPanic, deferred, turns a panic into a logged 500 problem written to
// w (the writer as it came in: the access log does not see it).
func (h *Handler) recoverPanic(w http.ResponseWriter, r *http.Request) {
	v := recover()
	if v == nil {
		return
	}
	if v == http.ErrAbortHandler {
		panic(v)
	}
	id := requestID(r.Context())
	if h.raw.Enabled(r.Context(), slog.LevelError) {
		h.logRecord(r.Context(), time.Now(), nil, slog.LevelError, "panic", slog.String("request_id", id),
			slog.Any("panic", v), slog.String("stack", string(debug.Stack())))
	}
	writeProblem(w, r, &Problem{Type: kInternal.typ, Title: kInternal.title,
		Status: kInternal.status, Instance: instance(r), RequestID: id})
}

// headerBytes is the size of the request line and headers as the header
// limit counts it: as sent in the usual form ("Name: value" lines ending in
// CRLF, list values joined with ", "), the headers net/http moves out of
// Header (Host, Transfer-Encoding, Trailer) and the blank line that ends
// them included. (An absolute-form request line's Host header is not
// counted: net/http keeps the URL's host.)
func headerBytes(r *http.Request) int {
	n := len(r.Method) + len(r.RequestURI) + len(r.Proto) + 4 + 2
	if r.Host != "" {
		n += len("Host") + len(r.Host) + 4
	}
	// Also moved out of Header: Transfer-Encoding, and Trailer's names,
	// each a list on one line ("Name: a, b\r\n").
	list := func(name string, n, size int) int {
		if n == 0 {
			return 0
		}
		return len(name) + 4 + size + 2*(n-1)
	}
	size := 0
	for _, te := range r.TransferEncoding {
		size += len(te)
	}
	n += list("Transfer-Encoding", len(r.TransferEncoding), size)
	size = 0
	for k := range r.Trailer {
		size += len(k)
	}
	n += list("Trailer", len(r.Trailer), size)
	for k, vs := range r.Header {
		for _, v := range vs {
			n += len(k) + len(v) + 4
		}
	}
	return n
}

// logRecord logs attrs at time at, then the tenant and key id of p (as principalLog
// does) when p is set, straight to the handler: the caller checked it is
// enabled. The record carries no source location: finding the caller's
// program counter took more than a tenth of the time of a request.
func (h *Handler) logRecord(ctx context.Context, at time.Time, p *Principal, level slog.Level, msg string, attrs ...slog.Attr) {
	rec := slog.NewRecord(at, level, msg, 0)
	rec.AddAttrs(attrs...)
	if p != nil {
		rec.AddAttrs(slog.String("tenant", p.Tenant), slog.String("key_id", p.KeyID))
	}
	_ = h.raw.Handle(ctx, rec)
}

// routeLabels caches the route label of chi's route patterns (joining them
// allocates): the label set is the route table's, so the cache is bounded.
type routeLabels struct {
	c seriesCache[routeKey, string]
}

// routeKey is up to two route patterns (the root router's and the /v1
// router's) and how many there are.
type routeKey struct {
	a, b string
	n    int
}

// label returns the route label of a routed request: its pattern, or
// "unmatched".
func (c *routeLabels) label(rctx *chi.Context) string {
	if rctx == nil {
		return "unmatched"
	}
	k := routeKey{n: len(rctx.RoutePatterns)}
	switch k.n {
	case 2:
		k.a, k.b = rctx.RoutePatterns[0], rctx.RoutePatterns[1]
	case 1:
		k.a = rctx.RoutePatterns[0]
	case 0:
	default:
		return routeOrUnmatched(rctx.RoutePattern())
	}
	if l, ok := c.c.load(k); ok {
		return l
	}
	return c.c.store(k, routeOrUnmatched(rctx.RoutePattern()))
}

func lenOf[K comparable, V any](m *map[K]V) int {
	if m == nil {
		return 0
	}
	return len(*m)
}

func routeOrUnmatched(route string) string {
	if route == "" {
		return "unmatched"
	}
	return route
}
