// Package client is the Go client for Redfence: leases with a watchdog, in
// the spirit of etcd's concurrency package and Consul's api/lock.go, on top of
// the generated low-level client in package rest.
//
//	c, _ := client.New("http://127.0.0.1:8080", client.Options{})
//	err := c.Do(ctx, "orders", nil, func(ctx context.Context, l *client.Lease) error {
//		// ctx is cancelled the moment the lease is lost or runs out.
//		_, err := c.PutResource(ctx, "orders", l.FencingToken(), map[string]int{"total": 42})
//		return err
//	})
//
// Guarantees: a Lease's deadline is computed from the client's own send time
// plus the server's validity_ms, and has passed once the monotonic clock or
// the wall clock says so (the monotonic one stops while the machine is
// suspended), so it never lies later than the server's view of the lease; Done() closes (and Context() is
// cancelled) as soon as a renewal learns the lease is lost, and at the latest
// when the deadline (less LockOptions.Margin) passes without a renewal.
// Errors match ErrHeld, ErrLost, ErrStale, ErrUnavailable, ... with errors.Is.
//
// Not guaranteed: mutual exclusion. A lease is a lease: a process paused past
// its deadline (GC, swap, VM migration) still believes it holds the lock until
// it runs again, and no client can prevent that. It is NOT safe to assume the
// lock is held until Done() closes; only a storage layer that checks the
// fencing token (FencingToken) keeps data safe. See README.md.
package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/redfence/redfence/client/rest"
	"github.com/redfence/redfence/fencing"
)

// Options configures a Client. Zero fields take the documented defaults.
type Options struct {
	// HTTPClient sends the requests. The default is a client with a clone
	// of http.DefaultTransport. A copy of it is used that follows no
	// redirects: the API never redirects, and a redirect would carry the
	// lock token (a secret) to wherever it points. A request that times
	// out closes its transport's idle connections (one may be dead), so
	// one without a Transport gets a clone of http.DefaultTransport, not
	// the process-wide one.
	HTTPClient *http.Client
	// RequestTimeout bounds each request (an acquire's gets its wait on
	// top, and no more than its TTL after the wait: an answer later than
	// that grants nothing that lasts; a renewal is bounded by the lease's
	// deadline too); a request that times out fails with ErrUnavailable.
	// The default is 30s.
	RequestTimeout time.Duration
	// APIKey, if set, is sent as "Authorization: Bearer <APIKey>". New
	// refuses one holding a control character (ErrInvalid), such as a
	// line break read with it: no request could carry it.
	APIKey string
	// Owner labels the leases this client acquires (shown by GET and in the
	// server's audit log) unless LockOptions.Owner is set. The default is none.
	Owner string
	// MaxServerWait is the longest wait_ms sent in one acquire request;
	// longer waits are split into several requests. Keep it at most the
	// server's REDFENCE_MAX_WAIT. The default is 30s.
	MaxServerWait time.Duration
	// Logger receives watchdog events (renewal failures). The default
	// discards them. It is called on a lease's watchdog goroutine, so it
	// must not block, as LockOptions.OnRenew must not: a handler writing
	// to a destination that takes nothing (a full pipe nobody reads) would
	// hold up the watchdog, and Done would close late, past the lease's
	// deadline (Err still checks the deadline itself).
	Logger *slog.Logger
}

// Client talks to one Redfence server. It is safe for concurrent use.
type Client struct {
	api  *rest.Client
	opts Options
	// wall reads the wall clock (tests move it as a suspend would); nil
	// is time.Now.
	wall func() time.Time
}

// wallNow is the wall-clock time, without a monotonic reading (so that
// comparisons with it use the wall clock).
func (c *Client) wallNow() time.Time {
	if c.wall != nil {
		return c.wall().Round(0)
	}
	return time.Now().Round(0)
}

// New returns a client for the Redfence server at baseURL
// (e.g. "http://127.0.0.1:8080").
func New(baseURL string, opts Options) (*Client, error) {
	if u, err := url.Parse(baseURL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("%w: server URL %s: want http://host:port or https://host:port", ErrInvalid, quoteURL(baseURL))
	}
	if bad := badKeyByte(opts.APIKey); bad >= 0 {
		// Refused here, as a bad URL is: every request would fail before
		// it is sent, as an outage (ErrUnavailable) an acquire with a
		// Wait keeps retrying. The key itself is not echoed.
		return nil, fmt.Errorf("%w: the API key holds a control character (byte %d of %d): it cannot be sent in an Authorization header (a line break read from a file or secret with it?)",
			ErrInvalid, bad+1, len(opts.APIKey))
	}
	// A transport of its own by default: a request that times out closes
	// the idle connections of its client's transport (see exchange), which
	// must not be every idle connection of the process.
	hc := &http.Client{}
	if opts.HTTPClient != nil {
		*hc = *opts.HTTPClient
	}
	if hc.Transport == nil { // not http.DefaultTransport, the process's
		hc.Transport = http.DefaultTransport.(*http.Transport).Clone()
	}
	hc.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	opts.HTTPClient = hc
	if opts.RequestTimeout <= 0 {
		opts.RequestTimeout = 30 * time.Second
	}
	if opts.MaxServerWait <= 0 {
		opts.MaxServerWait = 30 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	editor := func(_ context.Context, req *http.Request) error {
		req.Header.Set("User-Agent", "redfence-go-client")
		if opts.APIKey != "" {
			req.Header.Set("Authorization", "Bearer "+opts.APIKey)
		}
		return nil
	}
	api, err := rest.NewClient(baseURL, rest.WithHTTPClient(opts.HTTPClient), rest.WithRequestEditorFn(editor))
	if err != nil {
		return nil, fmt.Errorf("client: client for %s: %w", quoteURL(baseURL), err)
	}
	return &Client{api: api, opts: opts}, nil
}

// quoteURL quotes the server URL s for an error, with the password of its
// user information replaced by "xxxxx" (url.URL.Redacted): errors are
// logged. One that does not parse is not quoted, as it may hold a password
// that cannot be told apart.
func quoteURL(s string) string {
	u, err := url.Parse(s)
	if err != nil {
		return "(not quoted: it does not parse, and may hold a password)"
	}
	return strconv.Quote(u.Redacted())
}

// badKeyByte returns the index of the first byte of key that no HTTP header
// value may hold (a control character other than tab, RFC 9110 §5.5), or -1.
func badKeyByte(key string) int {
	for i := 0; i < len(key); i++ {
		if c := key[i]; c < ' ' && c != '\t' || c == 0x7f {
			return i
		}
	}
	return -1
}

// CloseIdleConnections closes the connections the client keeps open for
// reuse, as http.Client.CloseIdleConnections does (those of the transport
// of Options.HTTPClient, if one was given). It ends no lease: a lease's
// next renewal opens a connection again.
func (c *Client) CloseIdleConnections() { c.opts.HTTPClient.CloseIdleConnections() }

// REST returns the generated low-level client, for the operations this
// package does not wrap (GET /v1/locks/{name}, /v1/nodes, ...).
func (c *Client) REST() *rest.Client { return c.api }

// maxAnswer bounds how much of an answer is read: a document echoed by
// PUT or read by GET is at most the server's body limit
// (REDFENCE_MAX_BODY_BYTES, 1 MiB by default) plus its envelope.
const maxAnswer = 64 << 20

// errRequestTimeout is the cause of a request that ran out of
// Options.RequestTimeout.
var errRequestTimeout = errors.New("no answer within the request timeout")

// timeout bounds one request by the client's RequestTimeout plus extra: the
// context a request runs with, cancelled with errRequestTimeout as cause.
func (c *Client) timeout(ctx context.Context, extra time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeoutCause(ctx, c.opts.RequestTimeout+extra, errRequestTimeout)
}

// exchange reads a response whole and returns its body, or the error for a
// status other than want. ctx is the request's context: a caller's
// cancellation is returned as such; the end of the lease a renewal was for
// as ErrLost; its own timeout (see Client.timeout) as ErrUnavailable, after which idle connections are closed (a connection
// that went dead without a word is one of the ways a request times out).
func (c *Client) exchange(ctx context.Context, op, name string, resp *http.Response, err error, want int) ([]byte, error) {
	failed := func(status int, err error) error {
		if cause := context.Cause(ctx); errors.Is(cause, errLeaseEnded) {
			return &Error{Op: op, Name: name, Status: status, sentinel: ErrLost, cause: cause}
		}
		if errors.Is(context.Cause(ctx), errRequestTimeout) {
			c.opts.HTTPClient.CloseIdleConnections()
			return &Error{Op: op, Name: name, Status: status, sentinel: ErrUnavailable, cause: errRequestTimeout}
		}
		if cerr := ctx.Err(); cerr != nil {
			return fmt.Errorf("client: %s %q: %w", op, shownName(name), cerr)
		}
		return &Error{Op: op, Name: name, Status: status, sentinel: ErrUnavailable, cause: err}
	}
	if err != nil {
		return nil, failed(0, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswer))
	if err != nil {
		return nil, failed(resp.StatusCode, err)
	}
	if resp.StatusCode != want {
		return nil, problemError(op, name, resp, body)
	}
	return body, nil
}

func decode(op, name string, body []byte, v any) error {
	if err := json.Unmarshal(body, v); err != nil {
		return &Error{Op: op, Name: name, Status: http.StatusOK, sentinel: ErrUnavailable,
			cause: fmt.Errorf("decoding the answer: %w", err)}
	}
	return nil
}

// grant is an acquire or extend answer, with the send time of its request.
type grant struct {
	fencing  fencing.Token
	lock     string
	ttl      time.Duration
	validity time.Duration
	owner    string
	sent     time.Time
}

// errDotName is the cause of a name the server cannot be sent: URL paths
// normalise . and .. away, so the request would reach another route.
var errDotName = errors.New("a name must not be . or .. (URL paths normalise them away)")

// checkName refuses, as ErrInvalid, a name no request can carry.
func checkName(op, name string) error {
	if name == "." || name == ".." {
		return &Error{Op: op, Name: name, sentinel: ErrInvalid, cause: errDotName}
	}
	return nil
}

// acquireOnce sends one acquire request.
func (c *Client) acquireOnce(ctx context.Context, name string, ttl, wait time.Duration, owner string) (*grant, error) {
	if err := checkName("acquire", name); err != nil {
		return nil, err
	}
	var body rest.AcquireRequest
	if ttl > 0 {
		ms := ttl.Milliseconds()
		body.TtlMs = &ms
	}
	if wait > 0 {
		ms := wait.Milliseconds()
		body.WaitMs = &ms
	}
	if owner != "" {
		body.Owner = &owner
	}
	// The server counts a grant's validity from the request's arrival, so
	// an answer later than the wait plus the TTL has none left.
	limit := c.opts.RequestTimeout
	if ttl > 0 {
		limit = min(limit, ttl)
	}
	ctx, cancel := context.WithTimeoutCause(ctx, wait+limit, errRequestTimeout)
	defer cancel()
	sent := time.Now()
	resp, err := c.api.AcquireLock(ctx, name, nil, body)
	b, err := c.exchange(ctx, "acquire", name, resp, err, http.StatusCreated)
	if err != nil {
		return nil, err
	}
	var r rest.AcquireResponse
	if err := decode("acquire", name, b, &r); err != nil {
		return nil, err
	}
	return &grant{fencing: fencing.Token(r.FencingToken), lock: r.LockToken, ttl: time.Duration(r.TtlMs) * time.Millisecond,
		validity: time.Duration(r.ValidityMs) * time.Millisecond, owner: r.Owner, sent: sent}, nil
}

// extend sends one extend request.
func (c *Client) extend(ctx context.Context, name, lockToken string, ttl time.Duration) (*grant, error) {
	ms := ttl.Milliseconds()
	ctx, cancel := c.timeout(ctx, 0)
	defer cancel()
	sent := time.Now()
	resp, err := c.api.ExtendLock(ctx, name, &rest.ExtendLockParams{LockToken: lockToken}, rest.ExtendRequest{TtlMs: &ms})
	b, err := c.exchange(ctx, "extend", name, resp, err, http.StatusOK)
	if err != nil {
		return nil, err
	}
	var r rest.LockResponse
	if err := decode("extend", name, b, &r); err != nil {
		return nil, err
	}
	return &grant{fencing: fencing.Token(r.FencingToken), ttl: time.Duration(r.TtlMs) * time.Millisecond,
		validity: time.Duration(r.ValidityMs) * time.Millisecond, owner: r.Owner, sent: sent}, nil
}

// release sends one release request.
func (c *Client) release(ctx context.Context, name, lockToken string) error {
	ctx, cancel := c.timeout(ctx, 0)
	defer cancel()
	resp, err := c.api.ReleaseLock(ctx, name, &rest.ReleaseLockParams{LockToken: lockToken})
	_, err = c.exchange(ctx, "release", name, resp, err, http.StatusNoContent)
	return err
}

// Resource is a document of the reference store.
type Resource struct {
	Name string
	// Data is the document as stored: as written, without insignificant
	// whitespace.
	Data json.RawMessage
	// FencingToken is the token of the last accepted write.
	FencingToken fencing.Token
	// Version counts accepted writes, from 1.
	Version   int64
	UpdatedAt time.Time
}

type resourceJSON struct {
	Name         string          `json:"name"`
	Data         json.RawMessage `json:"data"`
	FencingToken int64           `json:"fencing_token"`
	Version      int64           `json:"version"`
	UpdatedAt    time.Time       `json:"updated_at"`
}

func (r *resourceJSON) resource() *Resource {
	return &Resource{Name: r.Name, Data: r.Data, FencingToken: fencing.Token(r.FencingToken), Version: r.Version, UpdatedAt: r.UpdatedAt}
}

// PutResource writes data (any JSON-encodable value) to the reference store
// under name with a fencing token. The server applies it only if token is the
// newest issued for name; otherwise the error matches ErrStale and carries
// CurrentFencingToken.
func (c *Client) PutResource(ctx context.Context, name string, token fencing.Token, data any) (*Resource, error) {
	return c.put(ctx, name, token, data, nil)
}

// PutResourceIf is PutResource applied only if the document is at version
// (If-Match), or, with version 0, only if there is no document yet
// (If-None-Match: *): a compare-and-set for a read-modify-write by several
// workers sharing one grant. Otherwise nothing is written and the error
// matches ErrPrecondition and carries CurrentVersion. A stale token is
// refused first (ErrStale).
func (c *Client) PutResourceIf(ctx context.Context, name string, token fencing.Token, data any, version int64) (*Resource, error) {
	if version < 0 {
		return nil, &Error{Op: "put", Name: name, sentinel: ErrInvalid, cause: fmt.Errorf("version %d: must be at least 0", version)}
	}
	params := &rest.PutResourceParams{}
	if version == 0 {
		star := "*"
		params.IfNoneMatch = &star
	} else {
		tag := `"` + strconv.FormatInt(version, 10) + `"`
		params.IfMatch = &tag
	}
	return c.put(ctx, name, token, data, params)
}

// put is PutResource with params (nil: none).
func (c *Client) put(ctx context.Context, name string, token fencing.Token, data any, params *rest.PutResourceParams) (*Resource, error) {
	if err := checkName("put", name); err != nil {
		return nil, err
	}
	raw, err := json.Marshal(data)
	if err != nil {
		return nil, fmt.Errorf("client: put %q: encoding data: %w", shownName(name), err)
	}
	body, err := json.Marshal(struct {
		FencingToken int64           `json:"fencing_token"`
		Data         json.RawMessage `json:"data"`
	}{int64(token), raw})
	if err != nil {
		return nil, fmt.Errorf("client: put %q: %w", shownName(name), err)
	}
	ctx, cancel := c.timeout(ctx, 0)
	defer cancel()
	resp, err := c.api.PutResourceWithBody(ctx, name, params, "application/json", bytes.NewReader(body))
	b, err := c.exchange(ctx, "put", name, resp, err, http.StatusOK)
	if err != nil {
		return nil, err
	}
	var r resourceJSON
	if err := decode("put", name, b, &r); err != nil {
		return nil, err
	}
	return r.resource(), nil
}

// GetResource reads the document stored under name; the error matches
// ErrNotFound when none was ever written.
func (c *Client) GetResource(ctx context.Context, name string) (*Resource, error) {
	if err := checkName("get", name); err != nil {
		return nil, err
	}
	ctx, cancel := c.timeout(ctx, 0)
	defer cancel()
	resp, err := c.api.GetResource(ctx, name, nil)
	b, err := c.exchange(ctx, "get", name, resp, err, http.StatusOK)
	if err != nil {
		return nil, err
	}
	var r resourceJSON
	if err := decode("get", name, b, &r); err != nil {
		return nil, err
	}
	return r.resource(), nil
}

// Do acquires the lock on name, runs fn with a context that is cancelled the
// moment the lease is lost or runs out (context.Cause tells why), and always
// releases the lock afterwards, even if fn panics or ctx is cancelled (with a
// context of its own, bounded by the lease's time left, 1 s at least: after
// it the lock runs out by itself). A grant whose validity ran out before its
// answer arrived is released and never handed to fn (ErrLost).
//
// It returns the acquire error, or else fn's error unchanged; if fn returned
// nil but the lease was lost before it did, an error matching ErrLost (fn's
// writes may have raced another holder: only their fencing tokens protected
// them); otherwise the release error, if any (a release the server could not
// answer, ErrUnavailable, is sent again while the lease lasts; one sent again
// that finds nothing held counts as done, see ReleaseRetrying: a loss it may
// hide came after fn returned).
func (c *Client) Do(ctx context.Context, name string, opts *LockOptions, fn func(ctx context.Context, l *Lease) error) (err error) {
	l, err := c.Acquire(ctx, name, opts)
	if err != nil {
		return err
	}
	fctx, cancel := context.WithCancelCause(ctx)
	stop := context.AfterFunc(l.Context(), func() { cancel(context.Cause(l.Context())) })
	defer func() {
		stop()
		cancel(nil)
		// Tried while the lease lasts (1 s at least): after that the lock
		// runs out by itself, and the caller need not wait on.
		rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), max(time.Until(l.Deadline()), time.Second))
		defer rcancel()
		lostErr := l.Err()
		rerr := l.ReleaseRetrying(rctx)
		if err == nil {
			if errors.Is(lostErr, ErrLost) {
				err = lostErr
			} else {
				err = rerr
			}
		}
	}()
	return fn(fctx, l)
}
