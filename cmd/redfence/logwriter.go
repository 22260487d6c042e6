package main

import (
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"
)

// maxPendingLog bounds the log bytes an asyncWriter holds while its
// goroutine is writing: a Write beyond it waits, so a slow log destination
// slows the server down (as a synchronous writer does) instead of growing
// memory, for at most maxLogWait.
const maxPendingLog = 1 << 20

// maxLogWait is the longest a Write waits for room: a destination that took
// nothing for that long, with maxPendingLog bytes waiting, is stuck (a
// stopped journald, a pipe nobody reads), and lines are dropped, counted,
// until it takes some again, rather than holding every request (and its
// answer: a grant would go out after its lease) while health checks, which
// log nothing, say all is well.
const maxLogWait = 250 * time.Millisecond

// maxLogClose bounds how long Close waits for the buffered lines to be
// written.
const maxLogClose = 5 * time.Second

// asyncWriter takes the log's write(2) off the request path. Write copies
// the line into a buffer and returns; one goroutine writes whatever has
// accumulated, as soon as it can, so a request no longer waits for the
// write(2) of its audit and access lines before its response goes out, and
// under load many lines share one write(2).
//
// Guarantees: lines are written whole and in the order of the Writes;
// nothing is dropped unless the destination is stuck (see maxLogWait), and
// then the count of lines dropped is reported (see onDrop) once it takes
// lines again; Close writes everything buffered before it returns, unless
// the destination takes nothing for maxLogClose, and Writes after Close go
// straight to the destination. Not guaranteed: lines buffered when the
// process dies without Close (a crash, SIGKILL) are lost; at most the lines
// of the last write(2)'s duration.
type asyncWriter struct {
	w     io.Writer
	limit int           // maxPendingLog; smaller in tests
	wait  time.Duration // maxLogWait; shorter in tests
	// closeWait is maxLogClose; shorter in tests.
	closeWait time.Duration
	done      chan struct{}
	wake      chan struct{} // capacity 1: the goroutine has lines to write

	mu sync.Mutex
	// room is closed, and replaced, when the goroutine takes the buffer.
	room    chan struct{}
	pending []byte // lines not yet taken by the goroutine
	woken   bool   // a wake is in the channel (or being taken by run)
	closed  bool   // Close was called
	stopped bool   // the goroutine has written everything and exited
	// dropping is set when a Write waited maxLogWait in vain: until the
	// goroutine takes the buffer, lines are dropped at once and counted in
	// dropped.
	dropping bool
	dropped  int
	// onDrop, if set, is told how many lines were dropped, on the
	// goroutine, once the destination takes lines again; it may Write.
	onDrop func(n int)
	// idle is closed while nothing is buffered or being written (see
	// flush); a Write into an idle writer replaces it.
	idle chan struct{}
}

// newAsyncWriter starts an asyncWriter in front of w, with the server's
// bounds (maxPendingLog, maxLogWait, maxLogClose). Close it.
func newAsyncWriter(w io.Writer) *asyncWriter {
	return newAsyncWriterBounds(w, maxPendingLog, maxLogWait, maxLogClose)
}

// newAsyncWriterBounds starts an asyncWriter that holds up to limit bytes,
// makes a Write wait at most wait for room (0: a Write never waits; lines
// beyond limit are dropped at once), and whose Close waits at most
// closeWait. Close it.
func newAsyncWriterBounds(w io.Writer, limit int, wait, closeWait time.Duration) *asyncWriter {
	a := &asyncWriter{w: w, limit: limit, wait: wait, closeWait: closeWait, done: make(chan struct{}),
		wake: make(chan struct{}, 1), room: make(chan struct{}), idle: make(chan struct{})}
	close(a.idle)
	go a.run()
	return a
}

// reportDrops sets the function told of dropped lines (see onDrop).
func (a *asyncWriter) reportDrops(f func(n int)) {
	a.mu.Lock()
	a.onDrop = f
	a.mu.Unlock()
}

// reportDropsTo reports dropped lines on log, which writes to a.
func (a *asyncWriter) reportDropsTo(log *slog.Logger) {
	a.reportDrops(func(n int) {
		log.Warn("log lines dropped: the log destination took nothing for "+maxLogWait.String()+" with its buffer full (a stuck log reader); requests went on",
			slog.Int("dropped", n))
	})
}

// Write queues a copy of p (a log line: slog writes each record with one
// Write) and returns at once, unless maxPendingLog bytes already wait: then
// it waits for the goroutine to take them, at most maxLogWait, and drops p
// if it did not (see dropping).
func (a *asyncWriter) Write(p []byte) (int, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	var timer *time.Timer
	for len(a.pending) >= a.limit && !a.stopped && !a.dropping {
		if a.wait <= 0 {
			a.dropping = true
			break
		}
		if timer == nil {
			timer = time.NewTimer(a.wait)
			defer timer.Stop()
		}
		room := a.room
		a.mu.Unlock()
		select {
		case <-room:
			a.mu.Lock()
		case <-timer.C:
			a.mu.Lock()
			a.dropping = len(a.pending) >= a.limit && !a.stopped
		}
	}
	if a.stopped {
		return a.w.Write(p)
	}
	if a.dropping {
		a.dropped++
		return len(p), nil // dropped: an error would tell slog nothing more
	}
	if len(p) > 0 && chanClosed(a.idle) {
		a.idle = make(chan struct{})
	}
	a.pending = append(a.pending, p...)
	if !a.woken {
		a.woken = true
		a.wake <- struct{}{} // never blocks: woken guards the one slot
	}
	return len(p), nil
}

// Close writes what is buffered, stops the goroutine and waits for it, for
// at most maxLogClose: a destination stuck for good (a stopped log reader)
// must not keep the process from exiting; what it did not take is lost.
// Writes after Close go straight to the destination once the goroutine has
// stopped.
func (a *asyncWriter) Close() error {
	a.mu.Lock()
	if !a.closed {
		a.closed = true
		if !a.woken {
			a.woken = true
			a.wake <- struct{}{}
		}
	}
	a.mu.Unlock()
	timer := time.NewTimer(a.closeWait)
	defer timer.Stop()
	select {
	case <-a.done:
		return nil
	case <-timer.C:
		return fmt.Errorf("log: the destination took nothing for %v; lines still buffered are lost", a.closeWait)
	}
}

// flush waits until the lines written before it have been written out, or
// for max at most (a destination that takes nothing).
func (a *asyncWriter) flush(max time.Duration) {
	a.mu.Lock()
	idle := a.idle
	a.mu.Unlock()
	t := time.NewTimer(max)
	defer t.Stop()
	select {
	case <-idle:
	case <-t.C:
	}
}

// chanClosed reports whether c is closed (c is only ever closed, never sent
// on).
func chanClosed(c chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
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
			close(a.room)
			a.room = make(chan struct{})
			// The destination takes lines again (or there were none).
			a.dropping = false
			if n, report := a.dropped, a.onDrop; n > 0 {
				a.dropped = 0
				if report != nil {
					// The report goes into the buffer just emptied, after
					// the lines being written.
					a.mu.Unlock()
					report(n)
					a.mu.Lock()
				}
			}
			if len(out) == 0 {
				if len(a.pending) == 0 && !chanClosed(a.idle) {
					close(a.idle) // all written (flush)
				}
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
			close(a.room)
			a.mu.Unlock()
			return
		}
		a.mu.Unlock()
	}
}
