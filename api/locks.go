// The lock operations: acquire, extend, release and status.

package api

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/apikey"
	"github.com/redfence/redfence/internal/keyspace"
	"github.com/redfence/redfence/service"
)

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
