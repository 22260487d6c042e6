package service

import (
	"context"
	"sync"
)

// activity counts operations under way; wait waits until none is.
type activity struct {
	mu   sync.Mutex
	n    int
	idle chan struct{} // closed when n drops to 0; nil while it is 0
}

func (a *activity) add() {
	a.mu.Lock()
	if a.n == 0 {
		a.idle = make(chan struct{})
	}
	a.n++
	a.mu.Unlock()
}

func (a *activity) done() {
	a.mu.Lock()
	if a.n--; a.n == 0 {
		close(a.idle)
		a.idle = nil
	}
	a.mu.Unlock()
}

// wait returns true once no operation is under way, false if ctx ends
// first.
func (a *activity) wait(ctx context.Context) bool {
	for {
		a.mu.Lock()
		idle := a.idle
		a.mu.Unlock()
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
