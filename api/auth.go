package api

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/singleflight"

	"github.com/redfence/redfence/internal/apikey"
)

// Access control. When Options.Auth is set, every /v1 route and /metrics
// needs "Authorization: Bearer <API key>" with the route's scope (locks,
// resources or admin), each key is rate limited on its own, and the key's
// tenant is the namespace of every lock and resource name, so a tenant cannot
// see or touch another tenant's locks and resources: they behave exactly as
// if they did not exist. /healthz, /readyz and /openapi.yaml stay open.
//
// Refusals: 401 unauthorized (no, malformed, unknown, revoked or wrong key,
// all with the same answer and WWW-Authenticate), 403 forbidden (the key
// lacks the scope), 429 rate-limited (with Retry-After), 503
// auth-unavailable (the key could not be checked). The API key itself is
// never logged; its id (the public part) is.

// Authenticator resolves an API key (the bearer token) to its principal.
// The principal may be shared by the requests of a key: it is read-only.
type Authenticator interface {
	// Authenticate returns the principal of key. The error matches
	// ErrUnauthorized when key is malformed, unknown, revoked or wrong; any
	// other error means the key could not be checked. Errors never contain
	// the key.
	Authenticate(ctx context.Context, key string) (*Principal, error)
}

// ErrUnauthorized is returned by an Authenticator for a key that grants
// nothing.
var ErrUnauthorized = errors.New("api: API key is malformed, unknown, revoked or wrong")

// Principal is who a request acts for: an API key and its tenant.
type Principal struct {
	// KeyID is the public id of the API key (safe to log).
	KeyID string
	// Tenant is the namespace of every name the request touches.
	Tenant string
	// Scopes are what the key may do.
	Scopes []string
}

// HasScope reports whether p carries scope.
func (p *Principal) HasScope(scope string) bool {
	for _, s := range p.Scopes {
		if s == scope {
			return true
		}
	}
	return false
}

type principalKey struct{}

// PrincipalFrom returns the principal authenticated for a request's context,
// or nil when the API is open.
func PrincipalFrom(ctx context.Context) *Principal {
	if st := stateFrom(ctx); st != nil && st.principal != nil {
		return st.principal
	}
	p, _ := ctx.Value(principalKey{}).(*Principal)
	return p
}

// Tenant returns the tenant of the request's API key, or "" (the default
// namespace) when the API is open. It is the default Options.Namespace when
// Options.Auth is set.
func Tenant(r *http.Request) string {
	if p := PrincipalFrom(r.Context()); p != nil {
		return p.Tenant
	}
	return ""
}

// authRealm is the realm of every WWW-Authenticate challenge.
const authRealm = `Bearer realm="redfence"`

// authError is a request refused by access control: the problem kind and the
// detail the client sees, and the cause, which is logged but not shown.
type authError struct {
	kind   kind
	detail string
	// challenge is the WWW-Authenticate value (401, 403).
	challenge string
	// retryAfter is when the key may send again (429).
	retryAfter time.Duration
	cause      error
}

func (e *authError) Error() string {
	if e.cause == nil {
		return e.detail
	}
	return e.detail + ": " + e.cause.Error()
}

func (e *authError) Unwrap() error { return e.cause }

// describe fills in the client's view of e: headers and problem members.
func (e *authError) describe(w http.ResponseWriter, p *Problem) {
	p.Detail = e.detail
	if e.challenge != "" {
		w.Header().Set("WWW-Authenticate", e.challenge)
	}
	if e.kind == kRateLimited {
		ms := max(retryAfterMS(e.retryAfter), 1) // known: the limiter says when
		p.RetryAfterMS = &ms
		retryAfterHeader(w, e.retryAfter)
	}
}

// The client sees one answer for every key that grants nothing, so that
// nothing tells a guessed id from a revoked key or a wrong secret.
func unauthorized(cause error) *authError {
	return &authError{kind: kUnauthorized, cause: cause,
		detail:    "a valid API key is required: send Authorization: Bearer <API key>",
		challenge: authRealm + `, error="invalid_token"`}
}

// noBearer is unauthorized for a request without Bearer credentials: its
// challenge has no error code (RFC 6750 §3.1).
func noBearer(cause error) *authError {
	e := unauthorized(cause)
	e.challenge = authRealm
	return e
}

// bearer returns the credentials of the request's one Authorization: Bearer
// header.
func bearer(r *http.Request) (string, error) {
	v := r.Header["Authorization"] // canonical: Values without canonicalising
	if len(v) == 0 {
		return "", noBearer(errors.New("no Authorization header"))
	}
	if len(v) > 1 {
		return "", unauthorized(fmt.Errorf("%d Authorization headers", len(v)))
	}
	scheme, cred, ok := strings.Cut(v[0], " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", noBearer(errors.New("the Authorization scheme is not Bearer"))
	}
	return strings.TrimSpace(cred), nil
}

// authorize returns middleware that lets a request through only with an API
// key that carries scope and is within its rate limit, and puts the key's
// principal in the request's context. Without Options.Auth it does nothing.
func (h *Handler) authorize(scope string) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		if h.opts.Auth == nil {
			return next
		}
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			p, err := h.authenticate(r)
			if err == nil {
				if wait := h.limits.reserve(p.KeyID, h.opts.Now()); wait > 0 {
					err = &authError{kind: kRateLimited, retryAfter: wait,
						detail: "this API key sent more requests than its rate limit allows; retry after retry_after_ms",
						cause:  fmt.Errorf("key %s over its rate limit", p.KeyID)}
				}
			}
			if err == nil && !p.HasScope(scope) {
				err = &authError{kind: kForbidden,
					detail:    fmt.Sprintf("this API key lacks the %q scope this call needs", scope),
					challenge: fmt.Sprintf(`%s, error="insufficient_scope", scope=%q`, authRealm, scope),
					cause:     fmt.Errorf("key %s of tenant %q lacks scope %q", p.KeyID, p.Tenant, scope)}
			}
			if err != nil {
				h.writeError(w, r, err)
				return
			}
			if st, ok := r.Context().(*reqState); ok {
				// The request's state holds it: no new context and request.
				// The access and panic lines, written by the layers around,
				// go without it, as they did when it was in a new context.
				st.principal = p
				next.ServeHTTP(w, r)
				return
			}
			next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), principalKey{}, p)))
		})
	}
}

func (h *Handler) authenticate(r *http.Request) (*Principal, error) {
	key, err := bearer(r)
	if err != nil {
		return nil, err
	}
	p, err := h.opts.Auth.Authenticate(r.Context(), key)
	switch {
	case err == nil:
		return p, nil
	case errors.Is(err, ErrUnauthorized):
		return nil, unauthorized(err)
	case errors.Is(err, context.Canceled) && r.Context().Err() != nil:
		return nil, err // the client went away
	}
	return nil, &authError{kind: kAuthUnavailable, cause: err,
		detail: "the API key could not be checked (Postgres did not answer); nothing was done"}
}

// KeyStore is the API key table as KeyAuth uses it (*store.DB).
type KeyStore interface {
	// Key returns the key with id, revoked or not, or an error matching
	// apikey.ErrNotFound.
	Key(ctx context.Context, id string) (*apikey.Key, error)
}

// KeyAuthOptions tunes a KeyAuth. Zero fields take the documented defaults.
type KeyAuthOptions struct {
	// CacheTTL is how long a key's record (or its absence) is trusted
	// without asking Postgres again: the longest a revocation can take to
	// apply on a server that missed its notification. The default is 1s.
	CacheTTL time.Duration
	// MaxCached bounds the number of cached key ids, and apart from them
	// the number of cached unknown ids, so that a flood of made-up keys
	// never evicts a valid one. The default is 10000.
	MaxCached int
	// LookupTimeout bounds each lookup in Postgres, its wait for a lookup
	// slot included. The default is 2s.
	LookupTimeout time.Duration
	// MaxLookups bounds the lookups in Postgres of ids not cached as keys
	// under way at once, so that a flood of made-up keys (each a lookup)
	// cannot take every connection of a pool it shares with token
	// issuance. Refreshing a cached key's entry does not wait for them.
	// The default is 2.
	MaxLookups int
	// Now is the clock. The default is time.Now.
	Now func() time.Time
}

// KeyAuth is the Authenticator of API keys stored by package store: it looks
// keys up by id, compares the hash of the whole key in constant time, and
// caches what it read for at most CacheTTL. Changed drops cached entries
// early; feed it store.DB.WatchKeys so revocations apply at once.
//
// Guarantee: a key revoked (or deleted) in Postgres is refused by this
// KeyAuth no later than CacheTTL after the revocation committed, even if the
// notification is lost; with notifications flowing, as soon as one arrives.
// Both hold while this server can reach Postgres.
//
// When Postgres cannot answer, a key that was valid at its last lookup keeps
// working, beyond CacheTTL, until a lookup succeeds again (Consul's ACL
// down_policy "extend-cache"): a release or a read needs no Postgres, and a
// client must be able to let its lock go during an outage. Lookups of such a
// key then run in the background, one at a time, so a request does not wait
// LookupTimeout for each; once one succeeds, what it read applies (the
// requests that came while it ran got the earlier answer). A key this
// KeyAuth has not seen valid is refused with a 503, never let through.
type KeyAuth struct {
	ks   KeyStore
	opts KeyAuthOptions

	mu sync.Mutex
	// gen counts invalidations. A lookup that started before one of its id
	// must not cache what it read, which may predate the change; one of
	// another key does not concern it. flushed is the last invalidation of
	// every key, changed[id] the last one of id since.
	gen, flushed uint64
	changed      map[string]uint64
	// cache holds the ids of keys (valid or revoked), unknown the ids
	// that name no key: each is bounded by MaxCached on its own.
	cache, unknown map[string]cached
	group          singleflight.Group
	// slots holds a token per lookup under way (MaxLookups).
	slots chan struct{}
	// waiting, if set (tests), is called when a lookup waits for a slot.
	waiting func()
}

type cached struct {
	key *apikey.Key // nil: no key has this id
	// principal is the key's principal, made once for every request with
	// the key (nil with key).
	principal *Principal
	at        time.Time // when the lookup started
	// down is set once a later lookup failed (Postgres did not answer):
	// the entry is then served past CacheTTL while lookups retry in the
	// background.
	down bool
}

var _ Authenticator = (*KeyAuth)(nil)

// NewKeyAuth returns a KeyAuth over ks.
func NewKeyAuth(ks KeyStore, opts KeyAuthOptions) *KeyAuth {
	if opts.CacheTTL <= 0 {
		opts.CacheTTL = time.Second
	}
	if opts.MaxCached <= 0 {
		opts.MaxCached = 10000
	}
	if opts.LookupTimeout <= 0 {
		opts.LookupTimeout = 2 * time.Second
	}
	if opts.MaxLookups <= 0 {
		opts.MaxLookups = 2
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	return &KeyAuth{ks: ks, opts: opts, cache: make(map[string]cached), unknown: make(map[string]cached),
		changed: make(map[string]uint64), slots: make(chan struct{}, opts.MaxLookups)}
}

// version is the last invalidation of id: a lookup of id may cache what it
// read only if it started after it, and may share the query of another
// lookup that started after it. a.mu is held.
func (a *KeyAuth) version(id string) uint64 {
	return max(a.flushed, a.changed[id])
}

// Changed drops what is cached about the key that changed. A KeyChange with
// no ID (notifications may have been missed) makes every cached key be
// looked up again on its next use, waiting for the answer; the entries stay
// only for when Postgres cannot give one.
func (a *KeyAuth) Changed(c apikey.Change) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.gen++
	if c.ID == "" || len(a.changed) >= a.opts.MaxCached {
		// Every key's lookups, also when too many keys changed to track
		// them one by one.
		a.flushed = a.gen
		clear(a.changed)
	}
	if c.ID == "" {
		clear(a.unknown)
		for id, e := range a.cache {
			e.at, e.down = time.Time{}, false // long expired, looked up before use
			a.cache[id] = e
		}
		return
	}
	a.changed[c.ID] = a.gen
	delete(a.cache, c.ID)
	delete(a.unknown, c.ID)
}

// Authenticate implements Authenticator.
func (a *KeyAuth) Authenticate(ctx context.Context, key string) (*Principal, error) {
	id, ok := apikey.ParseID(key)
	if !ok {
		return nil, fmt.Errorf("%w: not of the form %s<id>_<secret>", ErrUnauthorized, apikey.Prefix)
	}
	c, err := a.lookup(ctx, id)
	if err != nil {
		return nil, err
	}
	switch k := c.key; {
	case k == nil:
		return nil, fmt.Errorf("%w: no key has id %s", ErrUnauthorized, id)
	case !k.Verify(key):
		return nil, fmt.Errorf("%w: wrong secret for key %s", ErrUnauthorized, id)
	case k.Revoked():
		return nil, fmt.Errorf("%w: key %s was revoked at %s", ErrUnauthorized, id, k.RevokedAt.UTC().Format(time.RFC3339))
	}
	return c.principal, nil
}

// lookup returns the key with id (nil if there is none) from the cache, or
// from the store. Concurrent lookups of one id share one query, unless an
// invalidation of id came between them: a lookup that started before it
// may have read what it invalidated.
func (a *KeyAuth) lookup(ctx context.Context, id string) (cached, error) {
	now := a.opts.Now()
	a.mu.Lock()
	e, known := a.cache[id]
	ok := known
	if !ok {
		e, ok = a.unknown[id]
	}
	gen := a.version(id)
	a.mu.Unlock()
	if ok && !now.Before(e.at) && now.Sub(e.at) < a.opts.CacheTTL {
		return e, nil
	}
	// The query serves every caller waiting on it: it must not end because
	// the first one went away.
	ch := a.group.DoChan(id+"\x00"+strconv.FormatUint(gen, 10), func() (any, error) {
		return a.fetch(context.WithoutCancel(ctx), id, gen, known)
	})
	if ok && e.down {
		return e, nil // Postgres was down at the last lookup: the one just started runs in the background
	}
	select {
	case res := <-ch:
		if res.Err != nil {
			return cached{}, res.Err
		}
		return res.Val.(cached), nil
	case <-ctx.Done():
		return cached{}, ctx.Err()
	}
}

// fetch looks id up in the store and caches the answer. If the store cannot
// answer and id was last seen as a valid key, it returns that entry, marked
// down (see KeyAuth). The lookup of an id not cached as a key (known) waits
// for one of the MaxLookups slots first; that of a key's id, which only
// its holders can cause (once per CacheTTL), never waits behind made-up ids.
func (a *KeyAuth) fetch(ctx context.Context, id string, gen uint64, known bool) (cached, error) {
	lctx, cancel := context.WithTimeout(ctx, a.opts.LookupTimeout)
	defer cancel()
	if !known {
		if err := a.takeSlot(lctx); err != nil {
			return cached{}, err
		}
		defer func() { <-a.slots }()
	}
	start := a.opts.Now() // after any wait: the entry is as old as the read
	k, err := a.ks.Key(lctx, id)
	if errors.Is(err, apikey.ErrNotFound) {
		k, err = nil, nil
	}
	if err != nil {
		if e, ok := a.markDown(id); ok {
			return e, nil
		}
		return cached{}, err
	}
	c := cached{key: k, at: start}
	if k != nil {
		c.principal = &Principal{KeyID: k.ID, Tenant: k.Tenant, Scopes: k.Scopes}
	}
	a.store(id, c, gen)
	return c, nil
}

// takeSlot takes one of the MaxLookups slots (give it back by receiving
// from a.slots), or fails with ctx's error once it ends.
func (a *KeyAuth) takeSlot(ctx context.Context) error {
	select {
	case a.slots <- struct{}{}:
		return nil
	default:
	}
	if a.waiting != nil {
		a.waiting()
	}
	select {
	case a.slots <- struct{}{}:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("waiting for one of the %d lookup slots, all taken by lookups of unknown key ids: %w", cap(a.slots), ctx.Err())
	}
}

// markDown marks the cached entry of id down and returns it, if id is cached
// as a key (valid or revoked: a revoked one is still refused). A key whose
// change was notified is not cached any more; an id cached as unknown is not
// served past CacheTTL: the key may have been created since.
func (a *KeyAuth) markDown(id string) (cached, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	e, ok := a.cache[id]
	if !ok || e.key == nil {
		return cached{}, false
	}
	e.down = true
	a.cache[id] = e
	return e, true
}

// store caches e under id unless id was invalidated since gen (see
// version). Then it drops id's entry if it is down: Postgres answers again,
// and the next request must wait for its answer rather than be served the
// old one.
func (a *KeyAuth) store(id string, e cached, gen uint64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.version(id) != gen {
		if old, ok := a.cache[id]; ok && old.down {
			delete(a.cache, id)
		}
		return
	}
	// A key's entry and an unknown id's live apart: made-up ids, however
	// many, only ever evict one another.
	m, other := a.cache, a.unknown
	if e.key == nil {
		m, other = a.unknown, a.cache
	}
	delete(other, id) // a key created, or deleted, since
	if _, ok := m[id]; !ok && len(m) >= a.opts.MaxCached {
		now := a.opts.Now()
		for k, v := range m {
			if now.Before(v.at) || now.Sub(v.at) >= a.opts.CacheTTL {
				delete(m, k)
			}
		}
		if len(m) >= a.opts.MaxCached {
			clear(m) // a flood of distinct ids: start over
		}
	}
	m[id] = e
}

// principalLog adds the tenant and key id of the request's principal to
// every record logged with its context, so that log lines say who acted.
type principalLog struct{ slog.Handler }

func (h principalLog) Handle(ctx context.Context, r slog.Record) error {
	if p := PrincipalFrom(ctx); p != nil {
		r = r.Clone()
		r.AddAttrs(slog.String("tenant", p.Tenant), slog.String("key_id", p.KeyID))
	}
	return h.Handler.Handle(ctx, r)
}

func (h principalLog) WithAttrs(attrs []slog.Attr) slog.Handler {
	return principalLog{h.Handler.WithAttrs(attrs)}
}

func (h principalLog) WithGroup(name string) slog.Handler {
	return principalLog{h.Handler.WithGroup(name)}
}
