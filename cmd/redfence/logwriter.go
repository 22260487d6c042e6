package main

import (
	"io"
	"sync"
)

// maxPendingLog bounds the log bytes an asyncWriter holds while its
// goroutine is writing: a Write beyond it waits, so a slow log destination
// slows the server down (as a synchronous writer does) instead of growing
// memory or dropping lines.
const maxPendingLog = 1 << 20

// asyncWriter takes the log's write(2) off the request path. Write copies
// the line into a buffer and returns; one goroutine writes whatever has
// accumulated, as soon as it can, so a request no longer waits for the
// write(2) of its audit and access lines before its response goes out, and
// under load many lines share one write(2).
//
// Guarantees: lines are written whole and in the order of the Writes;
// nothing is dropped (see maxPendingLog); Close writes everything buffered
// before it returns, and Writes after Close go straight to the destination.
// Not guaranteed: lines buffered when the process dies without Close (a
// crash, SIGKILL) are lost; at most the lines of the last write(2)'s
// duration.
type asyncWriter struct {
	w     io.Writer
	limit int // maxPendingLog; smaller in tests
	done  chan struct{}
	wake  chan struct{} // capacity 1: the goroutine has lines to write

	mu      sync.Mutex
	room    sync.Cond // signalled when the goroutine takes the buffer
	pending []byte    // lines not yet taken by the goroutine
	woken   bool      // a wake is in the channel (or being taken by run)
	closed  bool      // Close was called
	stopped bool      // the goroutine has written everything and exited
}

// newAsyncWriter starts an asyncWriter in front of w. Close it.
func newAsyncWriter(w io.Writer) *asyncWriter {
	a := &asyncWriter{w: w, limit: maxPendingLog, done: make(chan struct{}), wake: make(chan struct{}, 1)}
	a.room.L = &a.mu
	go a.run()
	return a
}

// Write queues a copy of p (a log line: slog writes each record with one
// Write) and returns at once, unless maxPendingLog bytes already wait.
func (a *asyncWriter) Write(p []byte) (int, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for len(a.pending) >= a.limit && !a.stopped {
		a.room.Wait()
	}
	if a.stopped {
		return a.w.Write(p)
	}
	a.pending = append(a.pending, p...)
	if !a.woken {
		a.woken = true
		a.wake <- struct{}{} // never blocks: woken guards the one slot
	}
	return len(p), nil
}

// Close writes what is buffered, stops the goroutine and waits for it.
// Writes after Close go straight to the destination.
func (a *asyncWriter) Close() error {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		<-a.done
		return nil
	}
	a.closed = true
	if !a.woken {
		a.woken = true
		a.wake <- struct{}{}
	}
	a.mu.Unlock()
	<-a.done
	return nil
}

func (a *asyncWriter) run() {
	defer close(a.done)
	var out []byte
	for {
		<-a.wake
		a.mu.Lock()
		a.woken = false // the wake is taken: the next Write sends one
		// Write until the buffer is empty, swapping buffers so Writes go
		// on into the one just written.
		for {
			out, a.pending = a.pending, out[:0]
			a.room.Broadcast()
			if len(out) == 0 {
				break
			}
			a.mu.Unlock()
			// A log write error has nowhere to be reported (slog drops its
			// handler's errors too); the next lines are still tried.
			_, _ = a.w.Write(out)
			a.mu.Lock()
			if a.woken {
				// A Write sent a wake meanwhile (under mu, so it is in the
				// channel): take it, its lines are written next.
				<-a.wake
				a.woken = false
			}
		}
		if a.closed {
			a.stopped = true
			a.room.Broadcast()
			a.mu.Unlock()
			return
		}
		a.mu.Unlock()
	}
}
