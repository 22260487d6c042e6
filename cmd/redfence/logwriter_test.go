package main

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redfence/redfence/internal/testutil"
)

// gatedWriter collects what is written; while gate is set, each Write waits
// for a value on it first.
type gatedWriter struct {
	gate    chan struct{}
	entered chan struct{} // a Write has started (buffered)
	testutil.Buffer

	// Written by the asyncWriter's goroutine, read after its Close.
	writes int
	max    int // the longest single write
}

func (g *gatedWriter) Write(p []byte) (int, error) {
	if g.entered != nil {
		select {
		case g.entered <- struct{}{}:
		default:
		}
	}
	if g.gate != nil {
		<-g.gate
	}
	g.writes++
	g.max = max(g.max, len(p))
	return g.Buffer.Write(p)
}

// TestAsyncWriter_OrderAndCompleteness writes from many goroutines and
// checks that after Close every line is there, whole, and each goroutine's
// lines in order.
func TestAsyncWriter_OrderAndCompleteness(t *testing.T) {
	t.Parallel()
	dst := &gatedWriter{}
	a := newAsyncWriter(dst)
	a.limit = 512 // force the backpressure path too
	const writers, lines = 8, 500
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for i := range lines {
				line := fmt.Sprintf("w%d line %04d %s\n", w, i, strings.Repeat("x", i%50))
				if n, err := a.Write([]byte(line)); n != len(line) || err != nil {
					t.Errorf("Write = %d, %v; want %d, nil", n, err, len(line))
				}
			}
		})
	}
	wg.Wait()
	if err := a.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	next := make([]int, writers)
	got := strings.Split(strings.TrimSuffix(dst.String(), "\n"), "\n")
	if len(got) != writers*lines {
		t.Fatalf("%d lines written; want %d", len(got), writers*lines)
	}
	for _, l := range got {
		var w, i int
		if _, err := fmt.Sscanf(l, "w%d line %d", &w, &i); err != nil || w < 0 || w >= writers {
			t.Fatalf("line %q is not whole: %v", l, err)
		}
		if want := fmt.Sprintf("w%d line %04d %s", w, i, strings.Repeat("x", i%50)); l != want {
			t.Fatalf("line %q; want %q", l, want)
		}
		if i != next[w] {
			t.Fatalf("writer %d: line %d after line %d", w, i, next[w]-1)
		}
		next[w]++
	}
	// A write carries at most the pending limit plus the line that crossed it.
	if limit := a.limit + 100; dst.max > limit {
		t.Errorf("a write of %d bytes; the buffer is bounded by %d", dst.max, limit)
	}
}

// TestAsyncWriter_DoesNotWaitForTheDestination: while the destination is
// stuck in a write, Write still returns, and the lines written meanwhile go
// out together in the next write.
func TestAsyncWriter_DoesNotWaitForTheDestination(t *testing.T) {
	t.Parallel()
	dst := &gatedWriter{gate: make(chan struct{}), entered: make(chan struct{}, 1)}
	a := newAsyncWriter(dst)
	if _, err := a.Write([]byte("first\n")); err != nil {
		t.Fatal(err)
	}
	<-dst.entered // the goroutine is stuck writing "first"
	for i := range 10 {
		if _, err := fmt.Fprintf(a, "line %d\n", i); err != nil { // returns: nothing waits for the gate
			t.Fatal(err)
		}
	}
	close(dst.gate)
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	want := "first\n"
	for i := range 10 {
		want += fmt.Sprintf("line %d\n", i)
	}
	if got := dst.String(); got != want {
		t.Errorf("written %q; want %q", got, want)
	}
	if dst.writes != 2 {
		t.Errorf("%d writes; want 2 (the ten lines queued during the first share the second)", dst.writes)
	}
	// After Close, writes go straight through.
	if _, err := a.Write([]byte("late\n")); err != nil {
		t.Fatal(err)
	}
	if got := dst.String(); !strings.HasSuffix(got, "line 9\nlate\n") {
		t.Errorf("after Close, written %q; want it to end with the late line", got)
	}
	if err := a.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// TestAsyncWriter_DropsWhileStuck: with the destination stuck in a write
// and the buffer full, a Write waits at most its bound, then it and the
// Writes after it are dropped at once (counted), instead of holding every
// request; once the destination takes lines again, the count is reported
// after the lines that were waiting, and lines are kept again.
func TestAsyncWriter_DropsWhileStuck(t *testing.T) {
	t.Parallel()
	dst := &gatedWriter{gate: make(chan struct{}), entered: make(chan struct{}, 1)}
	a := newAsyncWriter(dst)
	a.limit, a.wait = 16, 10*time.Millisecond
	reported := make(chan int, 1)
	a.reportDrops(func(n int) {
		fmt.Fprintf(a, "dropped %d\n", n)
		reported <- n
	})
	if _, err := a.Write([]byte("first\n")); err != nil {
		t.Fatal(err)
	}
	<-dst.entered // the goroutine is stuck writing "first"
	full := strings.Repeat("a", 16) + "\n"
	for _, line := range []string{full, "x\n", "y\n"} { // the first fills the buffer, the others are dropped
		if n, err := a.Write([]byte(line)); n != len(line) || err != nil {
			t.Fatalf("Write(%q) = %d, %v; want %d, nil", line, n, err, len(line))
		}
	}
	close(dst.gate)
	if n := <-reported; n != 2 {
		t.Errorf("reported %d lines dropped; want 2", n)
	}
	if _, err := a.Write([]byte("after\n")); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if got, want := dst.String(), "first\n"+full+"dropped 2\nafter\n"; got != want {
		t.Errorf("written %q; want %q", got, want)
	}
}

// TestAsyncWriter_CloseDoesNotWaitForever: a destination stuck for good
// does not keep Close, and so the process, from ending; Close says what
// was lost.
func TestAsyncWriter_CloseDoesNotWaitForever(t *testing.T) {
	t.Parallel()
	dst := &gatedWriter{gate: make(chan struct{}), entered: make(chan struct{}, 1)}
	a := newAsyncWriter(dst)
	a.closeWait = 10 * time.Millisecond
	defer close(dst.gate) // lets the goroutine end with the test
	if _, err := a.Write([]byte("first\n")); err != nil {
		t.Fatal(err)
	}
	<-dst.entered // stuck for good
	if _, err := a.Write([]byte("second\n")); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err == nil {
		t.Error("Close with the destination stuck = nil; want an error saying lines are lost")
	}
}

// TestWriteBounded: the last error line of a process whose stderr nobody
// reads does not keep it from exiting.
func TestWriteBounded(t *testing.T) {
	t.Parallel()
	stuck := &gatedWriter{gate: make(chan struct{})}
	defer close(stuck.gate)
	writeBounded(stuck, "redfence: failed\n", 10*time.Millisecond) // returns
	free := &gatedWriter{}
	writeBounded(free, "redfence: failed\n", time.Minute)
	if got := free.String(); got != "redfence: failed\n" {
		t.Errorf("written %q", got)
	}
}

// TestAsyncWriter_NeverWaits: with no wait (redfence lock's own lines), a
// Write finding the buffer full drops its line at once instead of waiting
// for a destination that takes nothing, and the drops are reported once it
// takes lines again.
func TestAsyncWriter_NeverWaits(t *testing.T) {
	t.Parallel()
	dst := &gatedWriter{gate: make(chan struct{}), entered: make(chan struct{}, 1)}
	a := newAsyncWriterBounds(dst, 16, 0, time.Hour)
	a.reportDrops(func(n int) { fmt.Fprintf(a, "dropped %d\n", n) })
	if _, err := a.Write([]byte("first\n")); err != nil {
		t.Fatal(err)
	}
	<-dst.entered // the goroutine is stuck writing "first"
	full := strings.Repeat("a", 16) + "\n"
	for _, line := range []string{full, "x\n", "y\n", "z\n"} { // a wait here would hang the test
		if n, err := a.Write([]byte(line)); n != len(line) || err != nil {
			t.Fatalf("Write(%q) = %d, %v; want %d, nil", line, n, err, len(line))
		}
	}
	close(dst.gate)
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if got, want := dst.String(), "first\n"+full+"dropped 3\n"; got != want {
		t.Errorf("written %q; want %q", got, want)
	}
}

// TestAsyncWriter_Flush: flush returns once the lines written before it
// are out, not before.
func TestAsyncWriter_Flush(t *testing.T) {
	t.Parallel()
	dst := &gatedWriter{gate: make(chan struct{}), entered: make(chan struct{}, 1)}
	a := newAsyncWriter(dst)
	a.flush(time.Hour) // nothing written: returns at once
	if _, err := a.Write([]byte("line\n")); err != nil {
		t.Fatal(err)
	}
	flushed := make(chan struct{})
	go func() {
		a.flush(time.Hour)
		close(flushed)
	}()
	<-dst.entered // the line is being written, and cannot be done yet
	select {
	case <-flushed:
		t.Fatal("flush returned while its line was still being written")
	default:
	}
	close(dst.gate)
	<-flushed
	if got := dst.String(); got != "line\n" { // written before flush returned
		t.Errorf("written %q after flush; want %q", got, "line\n")
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
}
