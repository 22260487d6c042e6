package service

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/redfence/redfence/internal/testutil"
)

// TestLocker_ReachLog: the log says once when a node stops answering and
// when it answers again, and once when a majority stops answering and when
// it answers again; a node flapping within reachLogEvery is not logged
// again, nor its recovery.
func TestLocker_ReachLog(t *testing.T) {
	clk := &clock{t: time.Unix(1e9, 0)}
	var logs testutil.Buffer
	ns, _ := nodes(5)
	l := newLocker(t, ns, &memIssuer{}, Options{Now: clk.Now, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	down := errors.New("connection refused")
	lines := func() []string {
		s := strings.TrimSpace(logs.String())
		logs.Reset()
		if s == "" {
			return nil
		}
		return strings.Split(s, "\n")
	}
	want := func(step string, got []string, subs ...string) {
		t.Helper()
		if len(got) != len(subs) {
			t.Fatalf("%s: %d lines; want %d:\n%s", step, len(got), len(subs), strings.Join(got, "\n"))
		}
		for i, sub := range subs {
			if !strings.Contains(got[i], sub) {
				t.Errorf("%s: line %d = %s; want it to say %q", step, i, got[i], sub)
			}
		}
	}

	for i := range 5 {
		l.noteReach(i, Yes, nil)
	}
	want("all answer", lines())
	l.noteReach(0, Timeout, context.DeadlineExceeded)
	l.noteReach(0, Timeout, context.DeadlineExceeded) // no change
	l.noteReach(1, Failed, down)
	want("two down", lines(), `msg="node not answering" node=node0 outcome=timeout`, `msg="node not answering" node=node1 outcome=error error="connection refused"`)
	l.noteReach(2, Failed, down)
	want("three down", lines(), `node=node2`, `level=ERROR msg="fewer Redis nodes answer than a majority`)
	l.noteReach(3, No, nil) // an answer: no change
	want("a refusal", lines())
	l.noteReach(2, Yes, nil)
	want("a majority back", lines(), `msg="node answering again" node=node2 answering=3`, `msg="a majority of Redis nodes answers again"`)
	// Flapping within reachLogEvery: not logged again, nor its recovery.
	clk.Advance(reachLogEvery - time.Millisecond)
	l.noteReach(2, Timeout, context.DeadlineExceeded)
	want("node 2 flaps", lines())
	l.noteReach(2, Yes, nil)
	want("node 2 back", lines())
	clk.Advance(time.Millisecond)
	l.noteReach(2, Timeout, context.DeadlineExceeded)
	want("node 2 down once more", lines(), `node=node2`, `fewer Redis nodes answer than a majority`)
	for i := range 3 {
		l.noteReach(i, Yes, nil)
	}
	want("all back", lines(), `node=node0`, `a majority of Redis nodes answers again`, `node=node1`, `node=node2`)
}

// TestLocker_ReachLogFromRounds: requests' outcomes feed it.
func TestLocker_ReachLogFromRounds(t *testing.T) {
	var logs testutil.Buffer
	ns, ms := nodes(5)
	l := newLocker(t, ns, &memIssuer{}, Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	ms[4].hook = func(context.Context, string) error { return errors.New("connection refused") }
	if _, err := l.Acquire(t.Context(), key, Request{TTL: time.Second}); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "node 4's failure logged", func() (bool, error) {
		return strings.Contains(logs.String(), `msg="node not answering" node=node4`), nil
	})
}

// TestLocker_ReachLogCallerGone: a caller that goes away (an HTTP
// client that gave up on GET /v1/locks/x or /readyz) is no news of the
// nodes: it must not log them as not answering, nor a lost majority.
func TestLocker_ReachLogCallerGone(t *testing.T) {
	var logs testutil.Buffer
	ns, _ := nodes(5)
	l := newLocker(t, ns, &memIssuer{}, Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, _ = l.Status(ctx, key)
	_ = l.Nodes(ctx)
	if s := logs.String(); strings.Contains(s, "not answering") || strings.Contains(s, "fewer Redis nodes answer") {
		t.Errorf("a cancelled caller was logged as the nodes' failure:\n%s", s)
	}
}
