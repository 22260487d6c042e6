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

// heldKeys is a KeyStore whose lookups of ids not in valid all wait until
// release is closed, then find no key; it counts those under way and their
// peak. The keys in valid are answered at once.
type heldKeys struct {
	mu        sync.Mutex
	now, peak int
	entered   chan struct{}
	release   chan struct{}
	valid     map[string]*apikey.Key
}

func (h *heldKeys) Key(ctx context.Context, id string) (*apikey.Key, error) {
	if k, ok := h.valid[id]; ok {
		return k, nil
	}
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

// TestKeyAuth_KnownKeyDoesNotWait: while made-up ids hold every lookup slot,
// the refresh of a cached key's entry (its TTL over) goes to Postgres at
// once instead of queueing behind them.
func TestKeyAuth_KnownKeyDoesNotWait(t *testing.T) {
	t.Parallel()
	key, id := apikey.New()
	ks := &heldKeys{entered: make(chan struct{}, 8), release: make(chan struct{}),
		valid: map[string]*apikey.Key{id: {ID: id, Tenant: "acme", Scopes: apikey.DefaultScopes(), Hash: apikey.Hash(key)}}}
	defer close(ks.release)
	var mu sync.Mutex
	now := time.Unix(1_000_000, 0)
	clock := func() time.Time {
		mu.Lock()
		defer mu.Unlock()
		return now
	}
	a := NewKeyAuth(ks, KeyAuthOptions{MaxLookups: 1, CacheTTL: time.Second, LookupTimeout: time.Hour, Now: clock})
	waiting := make(chan struct{}, 8)
	a.waiting = func() { waiting <- struct{}{} }
	if _, err := a.Authenticate(t.Context(), key); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		go func() {
			_, _ = a.Authenticate(t.Context(), fmt.Sprintf("%s%016x_%s", apikey.Prefix, i, strings.Repeat("x", 43)))
		}()
	}
	deadline := time.After(time.Minute) // a bound on a hang, not a timing
	for _, ch := range []chan struct{}{ks.entered, waiting, waiting} {
		select {
		case <-ch:
		case <-deadline:
			t.Fatal("the made-up ids did not take the slot and queue for it within a minute")
		}
	}
	mu.Lock()
	now = now.Add(2 * time.Second) // the key's entry expired
	mu.Unlock()
	done := make(chan error, 1)
	go func() {
		_, err := a.Authenticate(t.Context(), key)
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("the cached key, its entry expired: %v", err)
		}
	case <-deadline:
		t.Fatal("the cached key's refresh waited behind the made-up ids' lookups")
	}
}
