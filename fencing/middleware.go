package fencing

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
)

// RequireOptions tunes Require. The zero value is usable.
type RequireOptions struct {
	// Methods lists the HTTP methods that must carry a token, compared
	// without regard to case (a handler may treat "put" as PUT). The
	// default (nil) is every method but the safe ones of RFC 9110, GET,
	// HEAD, OPTIONS and TRACE, spelled exactly so: reads pass without one
	// (TokenFrom then reports false), and a method the handler may take
	// for a write (PUT, "put", MERGE, PROPPATCH, ...) needs one.
	Methods []string
	// Last, if set, returns the newest token already applied to the resource
	// r addresses (0 if none). A request carrying an older token is then
	// refused with 409 before the handler runs. This is an early refusal
	// only: the storage layer must still compare the token in the same
	// statement or transaction as the write (see the package doc and the SQL
	// recipe in examples/fenced-store), since a newer write can land between
	// this check and the handler's.
	Last func(r *http.Request) (Token, error)
	// Max is the largest token admitted; a larger one is refused with 400
	// before the handler runs. The default (0) is MaxToken, the largest
	// Redfence issues: a token above it was not issued by Redfence, and
	// once stored it would refuse every real token after it.
	Max Token
}

// safeMethod reports whether method is one RFC 9110 defines as safe
// (read-only): by default the only ones Require lets through without a
// token. Methods are case-sensitive: "get" is not GET, and needs a token.
func safeMethod(method string) bool {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	return false
}

type tokenKey struct{}

// WithToken returns a copy of ctx carrying t.
func WithToken(ctx context.Context, t Token) context.Context {
	return context.WithValue(ctx, tokenKey{}, t)
}

// TokenFrom returns the token Require found on the request whose context is
// ctx, and whether there was one.
func TokenFrom(ctx context.Context) (Token, bool) {
	t, ok := ctx.Value(tokenKey{}).(Token)
	return t, ok
}

// Require returns middleware that admits a request only when it carries
// exactly one valid Fencing-Token header (methods in opts.Methods; by
// default every method but GET, HEAD, OPTIONS and TRACE), and puts
// the token in the request's context for TokenFrom. Otherwise it answers with
// an RFC 9457 problem document, in the same form as Redfence's own API:
// 400 urn:redfence:problem:invalid-request for a missing or malformed token,
// 409 urn:redfence:problem:stale-token when opts.Last reports a newer one,
// 503 urn:redfence:problem:fencing-unavailable when opts.Last fails.
func Require(opts RequireOptions) func(http.Handler) http.Handler {
	needs := func(method string) bool { // the default: all but the safe methods
		return !safeMethod(method)
	}
	if opts.Methods != nil {
		methods := slices.Clone(opts.Methods)
		needs = func(method string) bool {
			return slices.ContainsFunc(methods, func(m string) bool { return strings.EqualFold(m, method) })
		}
	}
	limit := opts.Max
	if limit <= 0 {
		limit = MaxToken
	}
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if !needs(r.Method) {
				next.ServeHTTP(w, r)
				return
			}
			t, err := FromRequest(r)
			if err == nil && t > limit {
				err = fmt.Errorf("%w: %d is above the largest token issued (%d)", ErrInvalid, t, limit)
			}
			if err != nil {
				Refuse(w, r, err, 0)
				return
			}
			if opts.Last != nil {
				last, err := opts.Last(r)
				if err != nil {
					Refuse(w, r, err, 0)
					return
				}
				if err := Check(last, t); err != nil {
					Refuse(w, r, err, last)
					return
				}
			}
			next.ServeHTTP(w, r.WithContext(WithToken(r.Context(), t)))
		})
	}
}

// problem is the problem+json body Refuse writes.
type problem struct {
	Type                string         `json:"type"`
	Title               string         `json:"title"`
	Status              int            `json:"status"`
	Detail              string         `json:"detail,omitempty"`
	Instance            string         `json:"instance,omitempty"`
	CurrentFencingToken *int64         `json:"current_fencing_token,omitempty"`
	InvalidParams       []invalidParam `json:"invalid_params,omitempty"`
}

type invalidParam struct {
	Name   string `json:"name"`
	Reason string `json:"reason"`
}

// Refuse answers a request that a fencing check refused, as problem+json:
// 400 invalid-request when err matches ErrInvalid, 409 stale-token (with
// current_fencing_token when current is valid) when it matches ErrStale, and
// 503 fencing-unavailable for any other error, whose text is not sent.
// Storage handlers use it when their own conditional write refuses a token.
func Refuse(w http.ResponseWriter, r *http.Request, err error, current Token) {
	p := &problem{Instance: r.URL.Path}
	switch {
	case errors.Is(err, ErrInvalid):
		p.Type, p.Title, p.Status = "urn:redfence:problem:invalid-request", "The request is invalid", http.StatusBadRequest
		p.Detail = "a valid " + Header + " header is required: " + err.Error()
		p.InvalidParams = []invalidParam{{Name: Header, Reason: "exactly one positive integer fencing token is required"}}
	case errors.Is(err, ErrStale):
		p.Type, p.Title, p.Status = "urn:redfence:problem:stale-token", "The fencing token is older than one already applied", http.StatusConflict
		p.Detail = err.Error()
		if current.Valid() {
			c := int64(current)
			p.CurrentFencingToken = &c
		}
	default:
		p.Type, p.Title, p.Status = "urn:redfence:problem:fencing-unavailable", "The fencing token could not be checked", http.StatusServiceUnavailable
		w.Header().Set("Retry-After", "1")
	}
	w.Header().Set("Content-Type", "application/problem+json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(p.Status)
	_ = json.NewEncoder(w).Encode(p)
}
