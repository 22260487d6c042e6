package client

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

// TestLease_EndsAfterSuspend: the monotonic clock stops while the machine
// is suspended, and the Redis nodes' expiry does not. A lease whose deadline
// passed while the machine slept (here: the wall clock jumps an hour, the
// monotonic one does not) has ended: Err says so at once, and Done closes
// without waiting for the monotonic deadline (a minute away), as does a
// lease nobody asks.
func TestLease_EndsAfterSuspend(t *testing.T) {
	c, err := New("http://127.0.0.1:1", Options{}) // never asked: NoRenew
	if err != nil {
		t.Fatal(err)
	}
	slept := sleepAfter(c)
	o, err := (&LockOptions{NoRenew: true}).withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	lease := func(name string) *Lease {
		t.Helper()
		l, err := c.newLease(name, &grant{fencing: 1, lock: "tok", ttl: time.Minute, validity: time.Minute, sent: time.Now()}, o)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.stop(); <-l.watchdogRet })
		return l
	}
	asked, unasked := lease("asked"), lease("unasked")
	if err := asked.Err(); err != nil {
		t.Fatalf("Err before the suspend = %v; want nil", err)
	}
	slept.Store(true)
	if err := asked.Err(); !errors.Is(err, ErrLost) {
		t.Errorf("Err after an hour asleep = %v; want ErrLost (the lease ran out on the nodes)", err)
	}
	// The watchdog looks at the deadline at least every wallCheck; the
	// bound here is only against a hang (the monotonic deadline is a
	// minute away).
	select {
	case <-unasked.Done():
		if err := unasked.ended(); !errors.Is(err, ErrLost) {
			t.Errorf("the unasked lease ended with %v; want ErrLost", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Done still open 30 s after the resume; want closed within wallCheck")
	}
}

// sleepAfter moves c's wall clock an hour on, and leaves its monotonic
// clock, once the flag it returns is set: what a machine suspended for an
// hour then sees.
func sleepAfter(c *Client) *atomic.Bool {
	var slept atomic.Bool
	c.wall = func() time.Time {
		if slept.Load() {
			return time.Now().Add(time.Hour)
		}
		return time.Now()
	}
	return &slept
}
