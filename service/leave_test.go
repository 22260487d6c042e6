package service_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/service"
)

// TestAcquire_CallerLeavesAfterQuorum: a caller that leaves after its try
// won the quorum, before its token is confirmed, gets nothing. Without
// speculation nothing is issued, and the next grant gets the next token;
// with it, the speculative token stays unused (never withdrawn: a name's
// token never goes back), and the next grant gets the one after it.
func TestAcquire_CallerLeavesAfterQuorum(t *testing.T) {
	for _, spec := range []bool{false, true} {
		t.Run(map[bool]string{false: "NoSpeculation", true: "Speculation"}[spec], func(t *testing.T) {
			e := newRestartEnv(t, false)
			var leave context.CancelFunc // set while the leaving acquire runs
			l := e.lockerWith(t, nil, service.Options{
				Registry: e.db, MaxTTL: time.Minute, NoSpeculation: !spec,
				AfterQuorum: func(context.Context, string) {
					if leave != nil {
						leave() // the client goes away here
					}
				},
			})
			ctx := t.Context()
			const key = "caller-leaves-after-quorum"
			g, err := l.Acquire(ctx, key, service.Request{TTL: 10 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			if err := l.Release(ctx, key, g.Token); err != nil {
				t.Fatal(err)
			}
			actx, cancel := context.WithCancel(ctx)
			leave = cancel
			_, err = l.Acquire(actx, key, service.Request{TTL: 10 * time.Second})
			leave = nil
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("acquire whose caller left = %v; want context.Canceled", err)
			}
			rec, err := e.db.Last(ctx, key)
			if err != nil {
				t.Fatal(err)
			}
			burned := map[bool]fencing.Token{false: 0, true: 1}[spec]
			if rec.Token != g.Fencing+burned || !spec && rec.Holder != service.HolderID(g.Token) {
				t.Errorf("the abandoned acquire left token %d (holder %s); want %d", rec.Token, rec.Holder, g.Fencing+burned)
			}
			g2, err := l.Acquire(ctx, key, service.Request{TTL: 10 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			if g2.Fencing != rec.Token+1 {
				t.Errorf("next grant got token %d; want %d", g2.Fencing, rec.Token+1)
			}
		})
	}
}

// releaseOps signals each release a node answered.
type releaseOps struct{ n chan struct{} }

func (r releaseOps) NodeOp(_, op string, _ service.Outcome, _ time.Duration) {
	if op == "release" {
		r.n <- struct{}{}
	}
}
func (releaseOps) Waiting(int)                  {}
func (releaseOps) Quarantine(string, time.Time) {}

// TestRelease_OtherNameLeavesStraggler: a release naming another lock with
// a grant's token (its holder mixed up the names) is refused (not-holder)
// and changes nothing: in particular the grant's slower node, answering
// after it, keeps the key it set (only a release of the grant's own name
// tells the round to delete what its stragglers set).
func TestRelease_OtherNameLeavesStraggler(t *testing.T) {
	for _, wrong := range []bool{false, true} {
		t.Run(map[bool]string{false: "Control", true: "WrongName"}[wrong], func(t *testing.T) {
			e := newRestartEnv(t, false)
			obs := releaseOps{make(chan struct{}, 64)}
			l := e.lockerWith(t, nil, service.Options{Registry: e.db, MaxTTL: time.Minute, NodeTimeout: 3 * time.Second,
				Observer: obs, NoSpeculation: true})
			ctx := t.Context()
			if err := e.nodes[4].Pause(); err != nil {
				t.Fatal(err)
			}
			g, err := l.Acquire(ctx, "A", service.Request{TTL: 30 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			if wrong {
				go func() { done <- l.Release(ctx, "B", g.Token) }()
				for range 4 { // nodes 0-3 answered B's release
					<-obs.n
				}
			} else {
				done <- service.ErrNotHolder
			}
			if err := e.nodes[4].Resume(); err != nil {
				t.Fatal(err)
			}
			if err := <-done; !errors.Is(err, service.ErrNotHolder) {
				t.Fatalf("Release(B, A's token) = %v; want ErrNotHolder", err)
			}
			// A round through node 4's pipeline, behind A's SET and anything
			// its answer queued.
			if _, err := l.Status(ctx, "A"); err != nil {
				t.Fatal(err)
			}
			n, err := e.raw[4].Exists(ctx, "redfence:lock:A").Result()
			if err != nil {
				t.Fatal(err)
			}
			if n != 1 {
				t.Errorf("A's key on its slower node is gone; want A's lease there untouched")
			}
		})
	}
}
