package main

import (
	"bytes"
	"fmt"
	"io"
	"sync"
	"time"
)

// diagQueue is how many of redfence lock's own lines may wait for stderr;
// more are dropped, and counted.
const diagQueue = 64

// diagWriter passes redfence lock's own messages (lease events, the
// client's renewal warnings, the notice of a loss) to stderr from a
// goroutine of its own. A stderr that takes nothing (a pipe nobody reads
// any more, a stopped log collector, a terminal on hold) then holds up
// neither the renewals nor, once the lease is lost, the signals to the
// command: writing a line never blocks; lines that find diagQueue others
// waiting are dropped, and their number is reported once stderr takes
// lines again. Lines are written whole and in order.
type diagWriter struct {
	w    io.Writer
	q    chan []byte
	done chan struct{} // closed when run has returned

	mu      sync.Mutex
	closed  bool
	queued  int           // lines in q or being written
	idle    chan struct{} // closed while queued is 0
	dropped int
}

func newDiagWriter(w io.Writer) *diagWriter {
	d := &diagWriter{w: w, q: make(chan []byte, diagQueue), done: make(chan struct{}), idle: make(chan struct{})}
	close(d.idle)
	go d.run()
	return d
}

// Write queues p (one or more whole lines) and returns at once.
func (d *diagWriter) Write(p []byte) (int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return len(p), nil
	}
	select {
	case d.q <- bytes.Clone(p):
		if d.queued == 0 {
			d.idle = make(chan struct{})
		}
		d.queued++
	default:
		d.dropped++
	}
	return len(p), nil
}

func (d *diagWriter) run() {
	defer close(d.done)
	for line := range d.q {
		d.mu.Lock()
		dropped := d.dropped
		d.dropped = 0
		d.mu.Unlock()
		if dropped > 0 {
			_, _ = fmt.Fprintf(d.w, "redfence lock: %d lines of its own dropped: stderr took none for a while\n", dropped)
		}
		_, _ = d.w.Write(line)
		d.mu.Lock()
		if d.queued--; d.queued == 0 {
			close(d.idle)
		}
		d.mu.Unlock()
	}
}

// flush waits until every line queued has been written, or for max.
func (d *diagWriter) flush(max time.Duration) {
	d.mu.Lock()
	idle := d.idle
	d.mu.Unlock()
	t := time.NewTimer(max)
	defer t.Stop()
	select {
	case <-idle:
	case <-t.C:
	}
}

// Close writes what is queued, waiting at most max for stderr to take it,
// and drops later lines.
func (d *diagWriter) Close(max time.Duration) {
	d.mu.Lock()
	if !d.closed {
		d.closed = true
		close(d.q)
	}
	d.mu.Unlock()
	t := time.NewTimer(max)
	defer t.Stop()
	select {
	case <-d.done:
	case <-t.C:
	}
}
