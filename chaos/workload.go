package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	mathrand "math/rand/v2"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"
)

// problemPrefix prefixes every problem type URI (api.ProblemTypePrefix).
const problemPrefix = "urn:redfence:problem:"

// StallHeader asks an in-process test server to run its AfterQuorum hook
// for this request (the production server ignores it).
const StallHeader = "X-Chaos-Stall"

// Client makes Redfence API calls and records each one as an Op.
type Client struct {
	// ID names the client in the history; each element it writes is
	// ID-<n>, so elements are unique across clients.
	ID string
	// HTTP sends the requests.
	HTTP *http.Client
	// Record receives every operation once it has returned.
	Record func(Op)

	mu  sync.Mutex
	seq int
}

// Link is a way to reach a server: a base URL and the client to send with.
type Link struct {
	Base string
	HTTP *http.Client
}

// Grant is what a granted acquire returned.
type Grant struct {
	Name string `json:"name"`
	// LockToken is the holder's secret; never printed.
	LockToken  string `json:"-"`
	Token      int64  `json:"token"`
	ValidityMS int64  `json:"validity_ms"`
	// Call is when the acquire was sent: the client's deadline is Call +
	// ValidityMS.
	Call int64 `json:"call"`
}

// ClientLine is one line a client process (chaos/client) prints: an
// operation, or a pause point (a grant whose document was read and is about
// to be written).
type ClientLine struct {
	Op    *Op    `json:"op,omitempty"`
	Pause *Grant `json:"pause,omitempty"`
}

type response struct {
	status     int
	problem    string
	nodes      string
	retryAfter string
	current    *int64
	body       []byte
	err        error
}

func (c *Client) do(ctx context.Context, l Link, method, path string, hdr http.Header, body any) response {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return response{err: err}
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, l.Base+path, rd)
	if err != nil {
		return response{err: err}
	}
	for k, v := range hdr {
		req.Header[k] = v
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	hc := l.HTTP
	if hc == nil {
		hc = c.HTTP
	}
	resp, err := hc.Do(req)
	if err != nil {
		return response{err: err}
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return response{err: err}
	}
	r := response{status: resp.StatusCode, body: data, retryAfter: resp.Header.Get("Retry-After")}
	if resp.StatusCode >= 300 {
		var p struct {
			Type    string `json:"type"`
			Current *int64 `json:"current_fencing_token"`
			Nodes   []struct {
				Outcome string `json:"outcome"`
			} `json:"nodes"`
		}
		if json.Unmarshal(data, &p) == nil {
			r.problem, r.current = strings.TrimPrefix(p.Type, problemPrefix), p.Current
			outcomes := make([]string, len(p.Nodes))
			for i, n := range p.Nodes {
				outcomes[i] = n.Outcome
			}
			r.nodes = strings.Join(outcomes, ",")
		}
	}
	return r
}

func (c *Client) finish(op Op, r response) Op {
	op.Return = Now()
	op.Status, op.Problem, op.Nodes, op.RetryAfter, op.Current = r.status, r.problem, r.nodes, r.retryAfter, r.current
	if r.err != nil {
		op.Err = r.err.Error()
	}
	if c.Record != nil {
		c.Record(op)
	}
	return op
}

func lockPath(name string) string     { return "/v1/locks/" + url.PathEscape(name) }
func resourcePath(name string) string { return "/v1/resources/" + url.PathEscape(name) }

// Acquire asks for the lock on name. stall sets StallHeader.
func (c *Client) Acquire(ctx context.Context, l Link, name string, ttl, wait time.Duration, stall bool) (Op, *Grant) {
	var hdr http.Header
	if stall {
		hdr = http.Header{StallHeader: {"1"}}
	}
	body := map[string]any{"ttl_ms": ttl.Milliseconds(), "wait_ms": wait.Milliseconds(), "owner": c.ID}
	op := Op{Client: c.ID, Kind: Acquire, Name: name, Server: l.Base, Stall: stall, Call: Now()}
	r := c.do(ctx, l, http.MethodPost, lockPath(name), hdr, body)
	var g *Grant
	if r.status == http.StatusCreated {
		var lr struct {
			LockToken    string `json:"lock_token"`
			FencingToken int64  `json:"fencing_token"`
			ValidityMS   int64  `json:"validity_ms"`
		}
		if err := json.Unmarshal(r.body, &lr); err != nil {
			r.err = fmt.Errorf("decode grant: %w", err)
		} else {
			op.Token, op.ValidityMS = lr.FencingToken, lr.ValidityMS
			g = &Grant{Name: name, LockToken: lr.LockToken, Token: lr.FencingToken, ValidityMS: lr.ValidityMS, Call: op.Call}
		}
	}
	return c.finish(op, r), g
}

// Extend renews g for ttl; on success it updates g's validity and call time.
func (c *Client) Extend(ctx context.Context, l Link, g *Grant, ttl time.Duration) Op {
	op := Op{Client: c.ID, Kind: Extend, Name: g.Name, Server: l.Base, Token: g.Token, Call: Now()}
	r := c.do(ctx, l, http.MethodPost, lockPath(g.Name)+"/extend", http.Header{"Lock-Token": {g.LockToken}},
		map[string]any{"ttl_ms": ttl.Milliseconds()})
	if r.status == http.StatusOK {
		var lr struct {
			ValidityMS int64 `json:"validity_ms"`
		}
		if json.Unmarshal(r.body, &lr) == nil {
			op.ValidityMS = lr.ValidityMS
			g.ValidityMS, g.Call = lr.ValidityMS, op.Call
		}
	}
	return c.finish(op, r)
}

// Release releases g.
func (c *Client) Release(ctx context.Context, l Link, g *Grant) Op {
	op := Op{Client: c.ID, Kind: Release, Name: g.Name, Server: l.Base, Token: g.Token, Call: Now()}
	return c.finish(op, c.do(ctx, l, http.MethodDelete, lockPath(g.Name), http.Header{"Lock-Token": {g.LockToken}}, nil))
}

// Read reads the document under name.
func (c *Client) Read(ctx context.Context, l Link, name string) Op {
	op := Op{Client: c.ID, Kind: Read, Name: name, Server: l.Base, Call: Now()}
	r := c.do(ctx, l, http.MethodGet, resourcePath(name), nil, nil)
	if r.status == http.StatusOK {
		var res struct {
			Data         []string `json:"data"`
			FencingToken int64    `json:"fencing_token"`
		}
		if err := json.Unmarshal(r.body, &res); err != nil {
			r.err = fmt.Errorf("decode document: %w", err)
			r.status = 0
		} else {
			op.Found, op.Elems, op.Token = true, res.Data, res.FencingToken
		}
	}
	return c.finish(op, r)
}

// Write replaces the document under name with elems, carrying token; elem
// is the element this write appends.
func (c *Client) Write(ctx context.Context, l Link, name string, token int64, elems []string, elem string, paused bool) Op {
	op := Op{Client: c.ID, Kind: Write, Name: name, Server: l.Base, Token: token, Elems: elems, Elem: elem, Paused: paused, Call: Now()}
	return c.finish(op, c.do(ctx, l, http.MethodPut, resourcePath(name), nil,
		map[string]any{"fencing_token": token, "data": elems}))
}

// NextElem returns a new element unique to this client.
func (c *Client) NextElem() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.seq++
	return fmt.Sprintf("%s-%d", c.ID, c.seq)
}

// CycleOptions tunes one Cycle.
type CycleOptions struct {
	// TTL is the lease asked for; Wait how long the server may wait for it.
	TTL, Wait time.Duration
	// Stall sets StallHeader on the acquire.
	Stall bool
	// Extend renews the lease (for TTL) between the read and the write and
	// skips the write when that fails.
	Extend bool
	// Pause, if set, runs between the read and the write: a GC pause, a
	// SIGSTOP, a slow link. It returns the link to send the write on (nil:
	// the cycle's link) and whether it paused.
	Pause func(ctx context.Context, g *Grant) (*Link, bool)
}

// Cycle runs acquire, read, write of the read document plus a new element,
// and release on name. It returns the grant, or nil when none was granted.
func (c *Client) Cycle(ctx context.Context, l Link, name string, o CycleOptions) *Grant {
	_, g := c.Acquire(ctx, l, name, o.TTL, o.Wait, o.Stall)
	if g == nil {
		return nil
	}
	defer c.Release(context.WithoutCancel(ctx), l, g)
	rd := c.Read(ctx, l, name)
	if rd.Status != http.StatusOK && rd.Status != http.StatusNotFound {
		return g
	}
	wl, paused := &l, false
	if o.Pause != nil {
		var pl *Link
		pl, paused = o.Pause(ctx, g)
		if pl != nil {
			wl = pl
		}
	}
	if o.Extend {
		if e := c.Extend(ctx, l, g, o.TTL); e.Status != http.StatusOK {
			return g
		}
	}
	elem := c.NextElem()
	c.Write(ctx, *wl, name, g.Token, append(append([]string{}, rd.Elems...), elem), elem, paused)
	return g
}

// Workload runs clients that repeatedly Cycle on names picked at random.
type Workload struct {
	// Clients is the number of concurrent clients; IDs are Prefix0, Prefix1...
	Clients int
	Prefix  string
	// Names are the names the clients contend for; with PerClient each
	// client uses only Names[i % len(Names)] (no contention).
	Names     []string
	PerClient bool
	// Cycles bounds the cycles per client; Until stops starting new ones
	// (0 / zero: no bound). One of them must be set.
	Cycles int
	Until  <-chan struct{}
	// Options returns the options of a client's n-th cycle.
	Options func(client, n int) CycleOptions
	// Links returns the servers to use; client i's n-th cycle uses
	// Links()[(i+n) % len].
	Links func() []Link
	// HTTP is every client's default HTTP client.
	HTTP *http.Client
	// Record receives every operation.
	Record func(Op)
	// Seed makes the name choices reproducible.
	Seed uint64
}

// Run runs the workload until every client is done.
func (w *Workload) Run(ctx context.Context) {
	var wg sync.WaitGroup
	for i := range w.Clients {
		c := &Client{ID: fmt.Sprintf("%s%d", w.Prefix, i), HTTP: w.HTTP, Record: w.Record}
		rng := mathrand.New(mathrand.NewPCG(w.Seed, uint64(i)))
		wg.Go(func() {
			for n := 0; w.Cycles == 0 || n < w.Cycles; n++ {
				if ctx.Err() != nil || closed(w.Until) {
					return
				}
				name := w.Names[rng.IntN(len(w.Names))]
				if w.PerClient {
					name = w.Names[i%len(w.Names)]
				}
				links := w.Links()
				c.Cycle(ctx, links[(i+n)%len(links)], name, w.Options(i, n))
			}
		})
	}
	wg.Wait()
}

func closed(ch <-chan struct{}) bool {
	if ch == nil {
		return false
	}
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// Status reads GET /v1/locks/{name} without recording it: the HTTP status,
// the problem type, whether the lock is held and the newest token issued.
func (c *Client) Status(ctx context.Context, l Link, name string) (status int, problem string, held bool, last int64) {
	r := c.do(ctx, l, http.MethodGet, lockPath(name), nil, nil)
	if r.status == http.StatusOK {
		var st struct {
			Held             bool  `json:"held"`
			LastFencingToken int64 `json:"last_fencing_token"`
		}
		if json.Unmarshal(r.body, &st) == nil {
			held, last = st.Held, st.LastFencingToken
		}
	}
	return r.status, r.problem, held, last
}
