package service

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/testutil"
)

// specIssuer is a memIssuer that speculates with the semantics of
// store.DB's (conditional issuance, confirmation; an abandoned token stays
// unused), and records what it was asked.
type specIssuer struct {
	*memIssuer
	mu    sync.Mutex
	calls []string // "speculate <key> <last>", "confirm <key>", "abandon <key>"
	// speculated, if set, receives each speculation's key.
	speculated chan string
	// abandoning, if set, receives the key of each speculation being
	// abandoned; gate, if set, holds each Abandon until it is closed (a
	// speculative statement whose answer is slow to come).
	abandoning chan string
	gate       chan struct{}
}

var _ fencing.Speculator = (*specIssuer)(nil)

func (s *specIssuer) note(format string, args ...any) {
	s.mu.Lock()
	s.calls = append(s.calls, fmt.Sprintf(format, args...))
	s.mu.Unlock()
}

func (s *specIssuer) log() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.calls...)
}

func (s *specIssuer) Speculate(ctx context.Context, c fencing.Claim, last fencing.Token) (fencing.Speculation, error) {
	s.note("speculate %s %d", c.Key, last)
	if s.speculated != nil {
		s.speculated <- c.Key
	}
	m := s.memIssuer
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.recs == nil {
		m.recs = map[string]fencing.Record{}
	}
	sp := &memSpeculation{s: s, key: c.Key}
	if m.recs[c.Key].Token == last {
		m.recs[c.Key] = fencing.Record{Claim: c, Token: last + 1}
		sp.issued = last + 1
	}
	return sp, nil
}

type memSpeculation struct {
	s      *specIssuer
	key    string
	issued fencing.Token
}

func (sp *memSpeculation) Confirm(ctx context.Context) (fencing.Token, error) {
	sp.s.note("confirm %s", sp.key)
	m := sp.s.memIssuer
	m.mu.Lock()
	defer m.mu.Unlock()
	if sp.issued == 0 || m.recs[sp.key].Token != sp.issued {
		return 0, fencing.ErrNotConfirmed
	}
	return sp.issued, nil
}

func (sp *memSpeculation) Abandon(ctx context.Context) error {
	sp.s.note("abandon %s", sp.key)
	if sp.s.abandoning != nil {
		sp.s.abandoning <- sp.key
	}
	if sp.s.gate != nil {
		select {
		case <-sp.s.gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

func wantCalls(t *testing.T, iss *specIssuer, want ...string) {
	t.Helper()
	got := iss.log()
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("issuer calls = %q; want %q", got, want)
	}
}

func TestLocker_Speculation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	req := Request{TTL: time.Second}

	// A lone try speculates on a key it never saw (last 0), and again on
	// the token of its own grant once released; not while that grant is
	// held.
	t.Run("LoneTries", func(t *testing.T) {
		ns, ms := nodes(5)
		iss := &specIssuer{memIssuer: &memIssuer{}}
		l := newLocker(t, ns, iss, Options{})
		g, err := l.Acquire(ctx, key, req)
		if err != nil || g.Fencing != 1 {
			t.Fatalf("Acquire = %+v, %v; want token 1", g, err)
		}
		settle(ms)
		if _, err := l.Acquire(ctx, key, req); !errors.Is(err, ErrHeld) {
			t.Fatalf("second Acquire = %v; want ErrHeld", err)
		}
		// The refusal does not wait for the last nodes; their SETs must
		// not land after the release below (the name would look held
		// until they answer and are deleted).
		settle(ms)
		if err := l.Release(ctx, key, g.Token); err != nil {
			t.Fatal(err)
		}
		g2, err := l.Acquire(ctx, key, req)
		if err != nil || g2.Fencing != 2 {
			t.Fatalf("Acquire after release = %+v, %v; want token 2", g2, err)
		}
		wantCalls(t, iss, "speculate orders 0", "confirm orders", "speculate orders 1", "confirm orders")
	})

	// A try that fails leaves its token unused: never withdrawn, so the
	// key's token never goes back. The key is not speculated on again
	// until a grant of it here is released, so a name held elsewhere costs
	// one token, not one per refused try.
	t.Run("FailedTryBurnsOne", func(t *testing.T) {
		ns, ms := nodes(5)
		for _, m := range ms[:3] {
			m.vals[rkey] = "other"
			m.ttl[rkey] = time.Hour
		}
		iss := &specIssuer{memIssuer: &memIssuer{}}
		l := newLocker(t, ns, iss, Options{})
		for range 3 {
			if _, err := l.Acquire(ctx, key, req); !errors.Is(err, ErrHeld) {
				t.Fatalf("Acquire = %v; want ErrHeld", err)
			}
		}
		wantCalls(t, iss, "speculate orders 0", "abandon orders")
		if r, _ := iss.Last(ctx, key); r.Token != 1 {
			t.Errorf("token %d left by the refused tries; want 1 (the first one's, unused)", r.Token)
		}
		// Freed: granted with a token issued after the quorum; once that
		// grant is released here, the key is speculated on again.
		for _, m := range ms[:3] {
			m.set(rkey, "", 0)
		}
		g, err := l.Acquire(ctx, key, req)
		if err != nil || g.Fencing != 2 {
			t.Fatalf("Acquire of the freed key = %+v, %v; want token 2", g, err)
		}
		if err := l.Release(ctx, key, g.Token); err != nil {
			t.Fatal(err)
		}
		if g, err = l.Acquire(ctx, key, req); err != nil || g.Fencing != 3 {
			t.Fatalf("Acquire after release = %+v, %v; want token 3", g, err)
		}
		wantCalls(t, iss, "speculate orders 0", "abandon orders", "speculate orders 2", "confirm orders")
	})

	// A token issued elsewhere meanwhile makes the speculation ungrantable:
	// the grant gets a token issued after its quorum, and the key is not
	// speculated on again until a grant here is released.
	t.Run("NotConfirmed", func(t *testing.T) {
		ns, ms := nodes(5)
		iss := &specIssuer{memIssuer: &memIssuer{}}
		l := newLocker(t, ns, iss, Options{})
		// Before the first node answers (so before the quorum and the
		// confirmation), another server issues a token for the key.
		var once sync.Once
		for _, m := range ms {
			m.hook = func(ctx context.Context, op string) error {
				if op == "acquire" {
					once.Do(func() { _, _ = iss.memIssuer.Issue(ctx, fencing.Claim{Key: key}) })
				}
				return nil
			}
		}
		g, err := l.Acquire(ctx, key, req)
		if err != nil || g.Fencing != 3 {
			t.Fatalf("Acquire = %+v, %v; want token 3 (1 speculated, 2 issued elsewhere)", g, err)
		}
		if err := l.Release(ctx, key, g.Token); err != nil {
			t.Fatal(err)
		}
		wantCalls(t, iss, "speculate orders 0", "confirm orders")
		if g, err = l.Acquire(ctx, key, req); err != nil || g.Fencing != 4 {
			t.Fatalf("Acquire after release = %+v, %v; want token 4", g, err)
		}
		wantCalls(t, iss, "speculate orders 0", "confirm orders", "speculate orders 3", "confirm orders")
	})

	// While a node does not answer, tries do not speculate: one that then
	// failed for want of a majority would leave its token unused. Once it
	// answers again, they do.
	t.Run("NodeNotAnswering", func(t *testing.T) {
		ns, ms := nodes(5)
		iss := &specIssuer{memIssuer: &memIssuer{}}
		l := newLocker(t, ns, iss, Options{})
		var failing atomic.Bool
		failing.Store(true)
		ms[4].hook = func(context.Context, string) error {
			if failing.Load() {
				return errors.New("connection refused")
			}
			return nil
		}
		g, err := l.Acquire(ctx, key, req) // speculates: nothing known of node 4 yet
		if err != nil || g.Fencing != 1 {
			t.Fatalf("Acquire = %+v, %v; want token 1", g, err)
		}
		if err := l.Release(ctx, key, g.Token); err != nil {
			t.Fatal(err)
		}
		// Node 4's failure is noted when its answer arrives, which may be
		// after the grant and the release: wait for it, or the next
		// acquire may still speculate.
		testutil.WaitFor(t, 10*time.Second, "node 4 noted as not answering", func() (bool, error) {
			return !l.allAnswering(), nil
		})
		if g, err = l.Acquire(ctx, key, req); err != nil || g.Fencing != 2 {
			t.Fatalf("Acquire with node 4 down = %+v, %v; want token 2", g, err)
		}
		wantCalls(t, iss, "speculate orders 0", "confirm orders")
		if err := l.Release(ctx, key, g.Token); err != nil {
			t.Fatal(err)
		}
		failing.Store(false)
		if g, err = l.Acquire(ctx, key, req); err != nil || g.Fencing != 3 {
			t.Fatalf("Acquire = %+v, %v; want token 3", g, err)
		}
		if err := l.Release(ctx, key, g.Token); err != nil {
			t.Fatal(err)
		}
		// Node 4's answer (noted when it arrives, maybe after the grant).
		testutil.WaitFor(t, 10*time.Second, "node 4 noted as answering", func() (bool, error) {
			return l.allAnswering(), nil
		})
		if g, err = l.Acquire(ctx, key, req); err != nil || g.Fencing != 4 {
			t.Fatalf("Acquire = %+v, %v; want token 4", g, err)
		}
		wantCalls(t, iss, "speculate orders 0", "confirm orders", "speculate orders 3", "confirm orders")
	})

	t.Run("Off", func(t *testing.T) {
		ns, _ := nodes(5)
		iss := &specIssuer{memIssuer: &memIssuer{}}
		l := newLocker(t, ns, iss, Options{NoSpeculation: true})
		if g, err := l.Acquire(ctx, key, req); err != nil || g.Fencing != 1 {
			t.Fatalf("Acquire = %+v, %v; want token 1", g, err)
		}
		wantCalls(t, iss)
	})

	// Two tries at once: the second does not speculate, and wins the key
	// while the first (speculating) try has not won its round: its token
	// comes after the first try's, which stays unused.
	t.Run("RaceBurnsOne", func(t *testing.T) {
		ns, ms := nodes(5)
		iss := &specIssuer{memIssuer: &memIssuer{}, speculated: make(chan string, 1)}
		// The first try's held SETs time out well within the 1s lease.
		l := newLocker(t, ns, iss, Options{NodeTimeout: 250 * time.Millisecond})
		// The first try's SETs reach node 0 only; on nodes 1-4 they are
		// held until they time out, and the second try wins those.
		var mu sync.Mutex
		holding := true
		held := make(chan struct{}, 4)
		for _, m := range ms[1:] {
			m.hook = func(ctx context.Context, op string) error {
				mu.Lock()
				hold := op == "acquire" && holding
				mu.Unlock()
				if !hold {
					return nil
				}
				held <- struct{}{}
				<-ctx.Done() // the first try's SET times out
				return ctx.Err()
			}
		}
		type result struct {
			g   *Grant
			err error
		}
		a := make(chan result, 1)
		go func() {
			g, err := l.Acquire(ctx, key, req)
			a <- result{g, err}
		}()
		<-iss.speculated // the first try speculated
		for range 4 {
			<-held
		}
		mu.Lock()
		holding = false
		mu.Unlock()
		b, err := l.Acquire(ctx, key, req)
		if err != nil {
			t.Fatalf("second Acquire = %v", err)
		}
		ra := <-a
		if !errors.Is(ra.err, ErrQuorum) {
			t.Fatalf("first Acquire = %+v, %v; want ErrQuorum", ra.g, ra.err)
		}
		if b.Fencing != 2 {
			t.Errorf("second try's token = %d; want 2 (after the first try's, unused)", b.Fencing)
		}
		wantCalls(t, iss, "speculate orders 0", "abandon orders")
	})
	// A try that wins the key while a failed try's speculation is still
	// ending (its statement's answer not yet read) does not wait for it:
	// the speculative token stays unused either way, and the winner's
	// token comes after it or makes it a no-op, so waiting would only
	// spend the winner's lease (here all of it: a grant refused as
	// lease-expired though it won the quorum).
	t.Run("RaceDoesNotWaitForAbandon", func(t *testing.T) {
		ns, ms := nodes(5)
		iss := &specIssuer{memIssuer: &memIssuer{}, abandoning: make(chan string, 1), gate: make(chan struct{})}
		var gateOnce sync.Once
		open := func() { gateOnce.Do(func() { close(iss.gate) }) }
		t.Cleanup(open)
		l := newLocker(t, ns, iss, Options{IssueTimeout: time.Hour})
		// The first try's SETs fail on every node: it fails, and its
		// speculation is abandoned (held at the gate).
		var mu sync.Mutex
		failing := true
		for _, m := range ms {
			m.hook = func(ctx context.Context, op string) error {
				mu.Lock()
				defer mu.Unlock()
				if op == "acquire" && failing {
					return errors.New("connection refused")
				}
				return nil
			}
		}
		a := make(chan error, 1)
		go func() {
			_, err := l.Acquire(ctx, key, req)
			a <- err
		}()
		<-iss.abandoning
		mu.Lock()
		failing = false
		mu.Unlock()
		b, err := l.Acquire(ctx, key, req)
		open()
		if err != nil {
			t.Fatalf("second Acquire = %v; want a grant (it won the quorum while the first try's speculation was ending)", err)
		}
		if aerr := <-a; !errors.Is(aerr, ErrQuorum) {
			t.Fatalf("first Acquire = %v; want ErrQuorum", aerr)
		}
		if b.Fencing != 2 {
			t.Errorf("second try's token = %d; want 2 (after the first try's, unused)", b.Fencing)
		}
	})
}
