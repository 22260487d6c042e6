package api

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/service"
)

func TestObserver(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	o := NewObserver(reg)
	now := time.Unix(1_000_000, 0)
	o.nodes.now = func() time.Time { return now }
	if o2 := NewObserver(reg); o2.issued != o.issued || o2.nodes != o.nodes {
		t.Fatal("a second Observer on the same registry does not share its metrics")
	}

	o.NodeOp("a:1", "acquire", service.Yes, time.Millisecond)
	o.NodeOp("b:1", "acquire", service.Timeout, 50*time.Millisecond)
	o.Waiting(1)
	o.Waiting(1)
	o.Waiting(-1)
	o.Quarantine("b:1", now.Add(time.Minute))
	o.Quarantine("b:1", now.Add(2*time.Minute)) // extended, not a new quarantine

	want := `
# HELP redfence_node_quarantined 1 while a Redis node's votes are not counted: it lost its memory (restart quarantine) or may evict keys (maxmemory-policy), else 0.
# TYPE redfence_node_quarantined gauge
redfence_node_quarantined{node="a:1"} 0
redfence_node_quarantined{node="b:1"} 1
# HELP redfence_node_quarantines_total Quarantines begun, per Redis node: it lost its memory (a restart without its data) or may evict keys (maxmemory-policy).
# TYPE redfence_node_quarantines_total counter
redfence_node_quarantines_total{node="a:1"} 0
redfence_node_quarantines_total{node="b:1"} 1
# HELP redfence_blocked_waiters Blocking acquires currently waiting between attempts for a held lock.
# TYPE redfence_blocked_waiters gauge
redfence_blocked_waiters 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), MetricNodeQuarantined, MetricNodeQuarantines, MetricBlockedWaiters); err != nil {
		t.Error(err)
	}
	if got := testutil.ToFloat64(o.nodeRequests.WithLabelValues("b:1", "acquire", "timeout")); got != 1 {
		t.Errorf("timeouts of b:1 = %v; want 1", got)
	}

	// The quarantine runs out without another event; a later one counts again.
	now = now.Add(3 * time.Minute)
	o.Quarantine("b:1", now.Add(time.Minute))
	now = now.Add(2 * time.Minute)
	want = `
# HELP redfence_node_quarantined 1 while a Redis node's votes are not counted: it lost its memory (restart quarantine) or may evict keys (maxmemory-policy), else 0.
# TYPE redfence_node_quarantined gauge
redfence_node_quarantined{node="a:1"} 0
redfence_node_quarantined{node="b:1"} 0
# HELP redfence_node_quarantines_total Quarantines begun, per Redis node: it lost its memory (a restart without its data) or may evict keys (maxmemory-policy).
# TYPE redfence_node_quarantines_total counter
redfence_node_quarantines_total{node="a:1"} 0
redfence_node_quarantines_total{node="b:1"} 2
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), MetricNodeQuarantined, MetricNodeQuarantines); err != nil {
		t.Error(err)
	}
	o.Quarantine("b:1", time.Time{}) // counted again
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), MetricNodeQuarantined, MetricNodeQuarantines); err != nil {
		t.Error(err)
	}
}

// fakeSpeculator speculates without Postgres: each speculation issues (or
// not, as told) and reports it as store.DB's does (Issued).
type fakeSpeculator struct {
	service.Issuer
	issue bool
}

func (f *fakeSpeculator) Speculate(ctx context.Context, c fencing.Claim, last fencing.Token) (fencing.Speculation, error) {
	s := &fakeSpeculation{}
	if f.issue {
		s.issued = last + 1
	}
	return s, nil
}

type fakeSpeculation struct{ issued fencing.Token }

func (s *fakeSpeculation) Confirm(context.Context) (fencing.Token, error) {
	return 0, fencing.ErrNotConfirmed
}
func (s *fakeSpeculation) Abandon(context.Context) error { return nil }
func (s *fakeSpeculation) Issued() fencing.Token         { return s.issued }

// TestObserver_BurnedSpeculations: a speculative token left unused (its try
// failed, or a newer token superseded it) was issued and never granted: it
// counts in redfence_tokens_issued_total, whose excess over grants is the
// burned tokens (README, dashboard); one whose condition did not hold issued
// nothing and does not.
func TestObserver_BurnedSpeculations(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, issue := range []bool{false, true} {
		o := NewObserver(prometheus.NewRegistry())
		spec := o.Issuer(&fakeSpeculator{issue: issue}).(fencing.Speculator)
		s, err := spec.Speculate(ctx, fencing.Claim{Key: "k"}, 1)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Abandon(ctx); err != nil {
			t.Fatal(err)
		}
		if s, err = spec.Speculate(ctx, fencing.Claim{Key: "k"}, 1); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Confirm(ctx); !errors.Is(err, fencing.ErrNotConfirmed) {
			t.Fatal(err)
		}
		want := map[bool]float64{false: 0, true: 2}[issue]
		if got := testutil.ToFloat64(o.issued); got != want {
			t.Errorf("issued: %v: tokens issued = %v after an abandoned and a superseded speculation; want %v", issue, got, want)
		}
	}
}
