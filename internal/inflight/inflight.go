// Package inflight counts operations under way, and waits, within a
// deadline, until none is.
package inflight

import (
	"context"
	"sync"
)

// Counter counts operations under way. Unlike a sync.WaitGroup, an
// operation may start while Wait runs (Wait then waits for it too), and
// Wait gives up when its context ends. The zero value is ready to use.
type Counter struct {
	mu   sync.Mutex
	n    int
	idle chan struct{} // closed when n drops to 0; nil while it is 0
}

// Add notes that an operation started.
func (c *Counter) Add() {
	c.mu.Lock()
	if c.n == 0 {
		c.idle = make(chan struct{})
	}
	c.n++
	c.mu.Unlock()
}

// Done notes that an operation ended.
func (c *Counter) Done() {
	c.mu.Lock()
	if c.n--; c.n == 0 {
		close(c.idle)
		c.idle = nil
	}
	c.mu.Unlock()
}

// Wait returns true once no operation is under way, false if ctx ends
// first.
func (c *Counter) Wait(ctx context.Context) bool {
	for {
		c.mu.Lock()
		idle := c.idle
		c.mu.Unlock()
		if idle == nil {
			return true
		}
		select {
		case <-idle:
		case <-ctx.Done():
			return false
		}
	}
}
