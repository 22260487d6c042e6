package store

import (
	"context"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// heldProxy forwards TCP connections to a server. While held, what clients
// send is read but kept back, and new connections are refused; release
// delivers what was kept, in order, followed by the client's close if it
// closed meanwhile: a network that stalled and then delivered late, as
// TCP retransmission does.
type heldProxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	held   bool
	open   chan struct{} // closed when released
	// done receives once per connection that had bytes kept back, when the
	// server closed it: it read everything the client sent, and acted on it.
	done chan struct{}
}

func newHeldProxy(t *testing.T, target string) *heldProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &heldProxy{ln: ln, target: target, open: make(chan struct{}), done: make(chan struct{}, 16)}
	close(p.open)
	t.Cleanup(func() { ln.Close() })
	go p.serve(t)
	return p
}

func (p *heldProxy) serve(t *testing.T) {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		held := p.held
		p.mu.Unlock()
		if held {
			c.Close()
			continue
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		t.Cleanup(func() { c.Close(); s.Close() })
		var delayed atomic.Bool
		// wait waits for the gate, noting whether it was shut.
		wait := func() {
			p.mu.Lock()
			open := p.open
			p.mu.Unlock()
			select {
			case <-open:
			default:
				delayed.Store(true)
				<-open
			}
		}
		go func() { // client → server, through the gate
			buf := make([]byte, 32<<10)
			for {
				n, err := c.Read(buf)
				if n > 0 {
					wait()
					if _, werr := s.Write(buf[:n]); werr != nil {
						return
					}
				}
				if err != nil {
					wait()
					_ = s.(*net.TCPConn).CloseWrite()
					return
				}
			}
		}()
		go func() { // server → client
			_, _ = io.Copy(c, s)
			c.Close()
			if delayed.Load() {
				p.done <- struct{}{}
			}
		}()
	}
}

func (p *heldProxy) hold() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.held, p.open = true, make(chan struct{})
}

func (p *heldProxy) release() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.held = false
	close(p.open)
}

// TestDB_PutResource_LateDelivery: a write whose call gave up while the
// network to Postgres stalled (the client was told "unavailable") is not
// applied when the network delivers it late, after the holder read the
// document and wrote again through another server: the late write does not
// overwrite the acknowledged one.
func TestDB_PutResource_LateDelivery(t *testing.T) {
	t.Parallel()
	b, url := newDB(t, Options{}) // another server, with its own way to Postgres
	_, hostPort, _ := strings.Cut(strings.TrimPrefix(url, "postgres://"), "@")
	hostPort, _, _ = strings.Cut(hostPort, "/")
	proxy := newHeldProxy(t, hostPort)
	a := open(t, strings.Replace(url, hostPort, proxy.ln.Addr().String(), 1), Options{MaxConns: 1, DocMaxConns: 1})

	tok := issue(t, b, "doc")
	put(t, a, "doc", tok, `{"by":"w0"}`) // A's documents connection is open
	proxy.hold()
	ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
	_, err := a.PutResource(ctx, "doc", tok, []byte(`{"by":"w1"}`))
	cancel()
	if err == nil {
		t.Fatal("PutResource through a stalled network succeeded")
	}
	wantResource(t, b, "doc", `{"by":"w0"}`, tok, 1) // w1 seems not applied: write again
	put(t, b, "doc", tok, `{"by":"w2"}`)
	proxy.release() // w1's bytes arrive now, then A's close
	select {
	case <-proxy.done:
	case <-time.After(waitTimeout):
		t.Fatal("Postgres did not close the stalled connection once its bytes arrived")
	}
	r, err := b.GetResource(t.Context(), "doc")
	if err != nil {
		t.Fatal(err)
	}
	if !jsonEqual(t, r.Data, []byte(`{"by":"w2"}`)) {
		t.Errorf("document after the late delivery = %s (version %d); want w2's, acknowledged after w1 failed", r.Data, r.Version)
	}
}
