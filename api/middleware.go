package api

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net/http"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/go-chi/chi/v5/middleware"
)

// RequestIDHeader carries the request ID, echoed on every response.
const RequestIDHeader = "X-Request-Id"

type ctxKey int

const requestIDKey ctxKey = iota

func requestID(ctx context.Context) string {
	id, _ := ctx.Value(requestIDKey).(string)
	return id
}

// validRequestID accepts a client's ID only if it is short and plain, so it
// is safe to log and echo.
func validRequestID(s string) bool {
	if s == "" || len(s) > 64 {
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

// requestID takes the client's X-Request-Id if acceptable, or makes one.
func (h *Handler) requestID(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := r.Header.Get(RequestIDHeader)
		if !validRequestID(id) {
			var b [8]byte
			_, _ = rand.Read(b[:])
			id = hex.EncodeToString(b[:])
		}
		w.Header().Set(RequestIDHeader, id)
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), requestIDKey, id)))
	})
}

// recoverer turns a panic into a logged 500 problem.
func (h *Handler) recoverer(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			if v := recover(); v != nil {
				if v == http.ErrAbortHandler {
					panic(v)
				}
				h.log.LogAttrs(r.Context(), slog.LevelError, "panic", slog.String("request_id", requestID(r.Context())),
					slog.Any("panic", v), slog.String("stack", string(debug.Stack())))
				writeProblem(w, &Problem{Type: ProblemTypePrefix + kInternal.slug, Title: kInternal.title,
					Status: kInternal.status, Instance: r.URL.Path, RequestID: requestID(r.Context())})
			}
		}()
		next.ServeHTTP(w, r)
	})
}

// accessLog logs one line per request and records HTTP metrics. It logs the
// method, path, status and timing only: never headers (Lock-Token) or bodies.
func (h *Handler) accessLog(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		ww := middleware.NewWrapResponseWriter(w, r.ProtoMajor)
		next.ServeHTTP(ww, r)
		d := time.Since(start)
		status := ww.Status()
		if status == 0 {
			status = http.StatusOK
		}
		route := chi.RouteContext(r.Context()).RoutePattern()
		if route == "" {
			route = "unmatched"
		}
		h.m.requests.WithLabelValues(route, r.Method, strconv.Itoa(status)).Inc()
		h.m.requestSeconds.WithLabelValues(route, r.Method).Observe(d.Seconds())
		h.log.LogAttrs(r.Context(), slog.LevelInfo, "http request",
			slog.String("request_id", requestID(r.Context())),
			slog.String("method", r.Method),
			slog.String("path", r.URL.Path),
			slog.String("route", route),
			slog.Int("status", status),
			slog.Int("bytes", ww.BytesWritten()),
			slog.Float64("duration_ms", float64(d.Microseconds())/1000),
			slog.String("remote", r.RemoteAddr))
	})
}

// limitHeaders refuses requests whose request line and headers exceed
// MaxHeaderBytes with a 431 problem.
func (h *Handler) limitHeaders(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := len(r.Method) + len(r.RequestURI) + len(r.Proto) + 4
		for k, vs := range r.Header {
			for _, v := range vs {
				n += len(k) + len(v) + 4
			}
		}
		if n > h.opts.MaxHeaderBytes {
			h.writeError(w, r, &requestError{kind: kHeadersTooLarge,
				detail: fmt.Sprintf("the request line and headers take %d bytes; the limit is %d", n, h.opts.MaxHeaderBytes)})
			return
		}
		next.ServeHTTP(w, r)
	})
}
