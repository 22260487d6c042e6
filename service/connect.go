package service

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// connector keeps a node's connection pool supplied with a connection that
// is set up. A new connection takes several round trips before it carries
// a command (the TCP and TLS handshakes, HELLO, then the OnConnect hook's
// INFO and CONFIG GET), and go-redis runs them under the deadline of the
// command that asked for the connection, dropping the connection when that
// deadline passes. Against a node whose round trip is more than about a
// fifth of the per-node timeout, no connection would ever be set up again
// once the node's connections were lost (a timeout, a reset, a restart),
// and every command would dial and handshake anew, a storm of handshakes
// on a node that may be struggling already.
//
// So once a command fails for want of its connection, the pool is cold: the
// connector sets up one connection in the background, under the dial
// timeout (one at a time), and puts it in the pool; commands wait for it
// within their own deadlines, and fail with a timeout when it is not ready
// by then. go-redis keeps pipelines on a pool of their own: a node has a
// connector for each (see RedisNode).
type connector struct {
	// warm runs one command on a connection of the pool (a PING).
	warm    func(ctx context.Context) error
	timeout time.Duration
	// cold: the pool may hold no connection set up (the first use, or a
	// command failed other than by the node's reply).
	cold atomic.Bool
	mu   sync.Mutex
	// running is closed when the connect under way ends (nil: none is);
	// err is the error of the last one, took how long it took.
	running chan struct{}
	err     error
	took    time.Duration
}

// newConnector returns a cold connector of the pool warm runs a command on.
func newConnector(warm func(ctx context.Context) error, timeout time.Duration) *connector {
	c := &connector{warm: warm, timeout: timeout}
	c.cold.Store(true)
	return c
}

// pingMain and pingPipelined warm the client's pool of single commands and
// its pool of pipelines.
func pingMain(client *redis.Client) func(context.Context) error {
	return func(ctx context.Context) error { return client.Ping(ctx).Err() }
}

func pingPipelined(client *redis.Client) func(context.Context) error {
	return func(ctx context.Context) error {
		_, err := client.Pipelined(ctx, func(p redis.Pipeliner) error {
			p.Ping(ctx)
			return nil
		})
		return err
	}
}

// ready returns nil once the pool holds a connection set up: at once unless
// the node is cold; otherwise when the connect it starts (or the one under
// way) succeeds. It returns that connect's error if it failed, or one
// matching ctx.Err() if ctx ends first (the connect goes on). It also
// returns one matching context.DeadlineExceeded if the connect succeeded
// but less time is left before ctx's deadline than the connect took (at
// least four round trips): a command sent then would likely time out, and
// go-redis drops a connection whose command timed out, so the connection
// is kept for the next command instead.
func (c *connector) ready(ctx context.Context) error {
	if !c.cold.Load() {
		return nil
	}
	c.mu.Lock()
	if !c.cold.Load() {
		c.mu.Unlock()
		return nil
	}
	done := c.running
	if done == nil {
		done = make(chan struct{})
		c.running = done
		go c.connect(done)
	}
	c.mu.Unlock()
	select {
	case <-done:
	case <-ctx.Done():
		return fmt.Errorf("connecting: %w", ctx.Err())
	}
	c.mu.Lock()
	err, took := c.err, c.took
	c.mu.Unlock()
	if err != nil {
		return fmt.Errorf("connecting: %w", err)
	}
	if d, ok := ctx.Deadline(); ok && time.Until(d) < took {
		return fmt.Errorf("connecting: set up in %v, too late for this command: %w", took.Round(time.Millisecond), context.DeadlineExceeded)
	}
	return nil
}

// connect sets up a connection in the pool (a PING on a new one runs the
// whole set-up) under the dial timeout, and leaves it idle there. The
// node's error reply to the PING (LOADING while it loads its data: PING is
// refused then, INFO and the lock scripts' commands are not) still leaves
// the connection set up; only a refusal of the credentials does not.
func (c *connector) connect(done chan struct{}) {
	t0 := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	err := c.warm(ctx)
	if rerr, ok := errors.AsType[redis.Error](err); ok && !redis.IsAuthError(rerr) && !errors.Is(err, errConnectHook) {
		err = nil
	}
	cancel()
	c.mu.Lock()
	c.err, c.took, c.running = err, time.Since(t0), nil
	c.cold.Store(err != nil)
	c.mu.Unlock()
	close(done)
}

// failed notes a command's error: any but the node's own reply to the
// command (a timeout, a reset, a failed dial or set-up) means go-redis
// dropped the connection it ran on, or had none, and makes the pool cold.
func (c *connector) failed(err error) {
	if err != nil && (!isReply(err) || errors.Is(err, errConnectHook)) {
		c.cold.Store(true)
	}
}

// errConnectHook marks the errors of a new connection's OnConnect hook
// (RedisNode.connected): go-redis drops the connection then, even for the
// node's error reply (INFO refused).
var errConnectHook = errors.New("new connection")

// isReply reports whether err is the node's error reply (or redis.Nil),
// after which go-redis keeps the connection.
func isReply(err error) bool {
	_, ok := errors.AsType[redis.Error](err)
	return ok
}
