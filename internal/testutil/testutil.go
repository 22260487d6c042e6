// Package testutil holds the small helpers several packages' tests share:
// polling an observable condition with a deadline, and a buffer that
// concurrent writers (loggers, child processes) can share. Test-only; it
// guarantees nothing about timing beyond the deadline it is given.
package testutil

import (
	"bytes"
	"sync"
	"testing"
	"time"
)

// WaitFor polls cond every few milliseconds until it returns true. It fails
// tb when cond returns an error or when timeout passes: the deadline guards
// against hangs and is not a timing assertion.
func WaitFor(tb testing.TB, timeout time.Duration, what string, cond func() (bool, error)) {
	tb.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, err := cond()
		if err != nil {
			tb.Fatalf("waiting for %s: %v", what, err)
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("gave up waiting for %s after %v", what, timeout)
		}
		time.Sleep(5 * time.Millisecond) // polling interval, not synchronisation
	}
}

// Buffer is a bytes.Buffer safe for concurrent use.
type Buffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write appends p.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String returns what was written so far.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Reset empties the buffer.
func (b *Buffer) Reset() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf.Reset()
}
