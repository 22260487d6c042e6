package api

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redfence/redfence/internal/apikey"
)

// heldKeys is a KeyStore whose lookups all wait until release is closed,
// then find no key; it counts the lookups under way and their peak.
type heldKeys struct {
	mu        sync.Mutex
	now, peak int
	entered   chan struct{}
	release   chan struct{}
}

func (h *heldKeys) Key(ctx context.Context, id string) (*apikey.Key, error) {
	h.mu.Lock()
	h.now++
	h.peak = max(h.peak, h.now)
	h.mu.Unlock()
	defer func() {
		h.mu.Lock()
		h.now--
		h.mu.Unlock()
	}()
	h.entered <- struct{}{}
	select {
	case <-h.release:
		return nil, apikey.ErrNotFound
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// TestKeyAuth_MaxLookups: lookups in Postgres beyond MaxLookups wait for a
// slot, so a flood of made-up keys cannot take every connection of the pool
// that token issuance shares; each waiting one is answered once a slot frees.
func TestKeyAuth_MaxLookups(t *testing.T) {
	t.Parallel()
	const callers = 6
	ks := &heldKeys{entered: make(chan struct{}, callers), release: make(chan struct{})}
	a := NewKeyAuth(ks, KeyAuthOptions{MaxLookups: 2, LookupTimeout: time.Hour})
	waiting := make(chan struct{}, callers)
	a.waiting = func() { waiting <- struct{}{} }
	errs := make(chan error, callers)
	for i := range callers {
		go func() {
			_, err := a.Authenticate(t.Context(), fmt.Sprintf("%s%016x_%s", apikey.Prefix, i, strings.Repeat("x", 43)))
			errs <- err
		}()
	}
	deadline := time.After(time.Minute) // a bound on a hang, not a timing
	for i := range callers {
		ch, what := waiting, "wait for a slot"
		if i < 2 {
			ch, what = ks.entered, "start"
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("lookup %d did not %s within a minute", i+1, what)
		}
	}
	close(ks.release)
	for range callers {
		if err := <-errs; !errors.Is(err, ErrUnauthorized) {
			t.Errorf("Authenticate = %v; want ErrUnauthorized (no such key)", err)
		}
	}
	if ks.peak != 2 {
		t.Errorf("%d lookups were under way at once; want at most MaxLookups (2)", ks.peak)
	}
}
