package chaos

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

// h builds histories: times are small integers (nanoseconds), validity in ms.
type h struct{ ops []Op }

func (b *h) grant(client string, call, ret, token int64) *h {
	b.ops = append(b.ops, Op{Client: client, Kind: Acquire, Name: "n", Call: call, Return: ret, Status: 201, Token: token, ValidityMS: 1000})
	return b
}

func (b *h) read(client string, call, ret, token int64, elems ...string) *h {
	op := Op{Client: client, Kind: Read, Name: "n", Call: call, Return: ret, Status: 404}
	if len(elems) > 0 {
		op.Status, op.Found, op.Elems, op.Token = 200, true, elems, token
	}
	b.ops = append(b.ops, op)
	return b
}

func (b *h) write(client string, call, ret, token int64, status int, elems ...string) *h {
	op := Op{Client: client, Kind: Write, Name: "n", Call: call, Return: ret, Status: status, Token: token, Elems: elems, Elem: elems[len(elems)-1]}
	if status == 409 {
		op.Problem = "stale-token"
	}
	b.ops = append(b.ops, op)
	return b
}

// stale is a write refused 409 stale-token naming current as the newest
// token.
func (b *h) stale(client string, call, ret, token, current int64, elems ...string) *h {
	b.write(client, call, ret, token, 409, elems...)
	b.ops[len(b.ops)-1].Current = &current
	return b
}

func (b *h) release(client string, call, ret, token int64) *h {
	b.ops = append(b.ops, Op{Client: client, Kind: Release, Name: "n", Call: call, Return: ret, Status: 204, Token: token})
	return b
}

func TestCheck(t *testing.T) {
	out := t.TempDir()
	opts := CheckOptions{Exclusive: true, Out: out, Label: "unit"}
	t.Run("Good", func(t *testing.T) {
		b := new(h).
			grant("a", 0, 10, 1).read("a", 11, 12, 0).write("a", 13, 20, 1, 200, "a-1").release("a", 21, 22, 1).
			grant("b", 23, 30, 2).read("b", 31, 32, 1, "a-1").write("b", 33, 40, 2, 200, "a-1", "b-1").release("b", 41, 42, 2).
			// A paused holder's late write, refused: fine.
			stale("a", 43, 44, 1, 2, "a-1", "a-2").
			// A write whose outcome is unknown: either way is fine.
			grant("c", 50, 51, 4).read("c", 52, 53, 2, "a-1", "b-1").write("c", 54, 55, 4, 0, "a-1", "b-1", "c-1")
		res := Check(b.ops, map[string][]string{"n": {"a-1", "b-1", "c-1"}}, opts)
		if !res.OK() {
			t.Fatalf("Check = %s %v; want OK", res.Verdict(), res.Violations)
		}
		if res.Grants != 3 || res.StaleAttempted != 1 || res.ElemsAcked != 2 || res.Refusals["stale-token"] != 1 || res.Refusals["no-response"] != 1 {
			t.Errorf("figures = %+v", res)
		}
	})
	t.Run("StaleWriteAccepted", func(t *testing.T) {
		// a holds 1 and pauses; b is granted 2, writes; a's late write lands.
		b := new(h).
			grant("a", 0, 10, 1).read("a", 11, 12, 0).
			grant("b", 2000, 2010, 2).read("b", 2011, 2012, 0).write("b", 2013, 2020, 2, 200, "b-1").release("b", 2021, 2022, 2).
			write("a", 3000, 3010, 1, 200, "a-1")
		res := Check(b.ops, map[string][]string{"n": {"a-1"}}, opts)
		if res.OK() || res.StaleAccepted != 1 || res.ElemsLost != 1 || res.Linearizable != porcupine.Illegal {
			t.Fatalf("Check = %s, stale accepted %d, lost %d, %v; want all three violations", res.Verdict(), res.StaleAccepted, res.ElemsLost, res.Linearizable)
		}
		if res.Visualization == "" || !strings.HasPrefix(res.Visualization, out) {
			t.Errorf("visualisation at %q; want a file under %s", res.Visualization, out)
		} else if _, err := os.Stat(res.Visualization); err != nil {
			t.Error(err)
		}
	})
	t.Run("TokenRegression", func(t *testing.T) {
		b := new(h).grant("a", 0, 10, 5).release("a", 11, 12, 5).grant("b", 20, 30, 3).release("b", 31, 32, 3).grant("c", 40, 50, 3)
		res := Check(b.ops, nil, opts)
		if res.Regressions != 2 || res.OK() {
			t.Fatalf("Check = %s, regressions %d; want 2 (a lower token, a reused one)", res.Verdict(), res.Regressions)
		}
	})
	t.Run("Overlap", func(t *testing.T) {
		// b is granted while a's lease (validity 1s from its call) is live.
		b := new(h).grant("a", 0, 10, 1).grant("b", 20, 30, 2).release("a", 40, 50, 1).release("b", 60, 70, 2)
		res := Check(b.ops, nil, opts)
		if res.Overlaps != 1 || res.OK() {
			t.Fatalf("Check = %s, overlaps %d; want 1", res.Verdict(), res.Overlaps)
		}
		// Inside a fault window it is excused unless the run is exclusive.
		o := opts
		o.Exclusive, o.Windows = false, []Window{{Kind: "f", From: 15, To: 25}}
		if res := Check(b.ops, nil, o); !res.OK() || res.FaultFreeOverlaps != 0 {
			t.Errorf("in a fault window: Check = %s, fault-free overlaps %d; want OK", res.Verdict(), res.FaultFreeOverlaps)
		}
		// A fault that hit another name excuses nothing.
		o.Windows = []Window{{Kind: "f", Name: "other", From: 15, To: 25}}
		if res := Check(b.ops, nil, o); res.OK() || res.FaultFreeOverlaps != 1 {
			t.Errorf("in a fault window of another name: Check = %s, fault-free overlaps %d; want 1", res.Verdict(), res.FaultFreeOverlaps)
		}
		o.Windows[0].Name = "n"
		if res := Check(b.ops, nil, o); !res.OK() {
			t.Errorf("in a fault window of the name: Check = %s; want OK", res.Verdict())
		}
	})
	t.Run("LostElement", func(t *testing.T) {
		b := new(h).grant("a", 0, 10, 1).read("a", 11, 12, 0).write("a", 13, 20, 1, 200, "a-1").release("a", 21, 22, 1)
		if res := Check(b.ops, map[string][]string{"n": nil}, opts); res.ElemsLost != 1 || res.OK() {
			t.Fatalf("Check = %s, lost %d; want 1", res.Verdict(), res.ElemsLost)
		}
	})
}

func TestCheck_Extend(t *testing.T) {
	ms := int64(time.Millisecond)
	t.Run("OverlapUntilLostExtendAnswered", func(t *testing.T) {
		// In an exclusive (fault-free) run, B is granted while A's lease is
		// still valid (deadline = call + 1s). A's extend, sent just before
		// B's grant, answers 409 lock-lost only after B was granted: A
		// learned of the loss only then, so the two overlapped (a Redlock
		// violation, e.g. a restart quarantine that failed).
		ops := []Op{
			{Client: "a", Kind: Acquire, Name: "n", Call: 0, Return: 10 * ms, Status: 201, Token: 1, ValidityMS: 1000},
			{Client: "a", Kind: Extend, Name: "n", Call: 100 * ms, Return: 300 * ms, Status: 409, Problem: "lock-lost", Token: 1},
			{Client: "b", Kind: Acquire, Name: "n", Call: 150 * ms, Return: 200 * ms, Status: 201, Token: 2, ValidityMS: 1000},
			{Client: "b", Kind: Release, Name: "n", Call: 400 * ms, Return: 410 * ms, Status: 204, Token: 2},
		}
		res := Check(ops, nil, CheckOptions{Exclusive: true})
		if res.OK() || res.Overlaps != 1 {
			t.Errorf("Check = %s, overlaps %d; want 1: B was granted at 200ms while A's lease ran to 1000ms and A learned of the loss only at 300ms",
				res.Verdict(), res.Overlaps)
		}
	})
	t.Run("GrantAfterLostExtendAnswered", func(t *testing.T) {
		ops := []Op{
			{Client: "a", Kind: Acquire, Name: "n", Call: 0, Return: 10 * ms, Status: 201, Token: 1, ValidityMS: 1000},
			{Client: "a", Kind: Extend, Name: "n", Call: 100 * ms, Return: 150 * ms, Status: 409, Problem: "lock-lost", Token: 1},
			{Client: "b", Kind: Acquire, Name: "n", Call: 120 * ms, Return: 200 * ms, Status: 201, Token: 2, ValidityMS: 1000},
		}
		if res := Check(ops, nil, CheckOptions{Exclusive: true}); !res.OK() {
			t.Errorf("Check = %s %v; want OK: A learned of the loss at 150ms, before B's grant returned", res.Verdict(), res.Violations)
		}
	})
	t.Run("ReleaseEndsLeaseWhenSent", func(t *testing.T) {
		// A release is voluntary: the holder stops relying on the lease
		// when it sends it, so a grant answered before the release's
		// answer does not overlap.
		ops := []Op{
			{Client: "a", Kind: Acquire, Name: "n", Call: 0, Return: 10 * ms, Status: 201, Token: 1, ValidityMS: 1000},
			{Client: "a", Kind: Release, Name: "n", Call: 100 * ms, Return: 300 * ms, Status: 204, Token: 1},
			{Client: "b", Kind: Acquire, Name: "n", Call: 150 * ms, Return: 200 * ms, Status: 201, Token: 2, ValidityMS: 1000},
		}
		if res := Check(ops, nil, CheckOptions{Exclusive: true}); !res.OK() {
			t.Errorf("Check = %s %v; want OK", res.Verdict(), res.Violations)
		}
	})
}

func TestCheck_Refusal(t *testing.T) {
	opts := CheckOptions{Exclusive: true}
	t.Run("NewestTokenRefused", func(t *testing.T) {
		// A store that answers 409 stale-token to every write (naming the
		// write's own token as the newest): no element is acknowledged, so
		// none can be lost, and the model allows any refusal.
		b := new(h).
			grant("a", 0, 10, 1).read("a", 11, 12, 0).stale("a", 13, 20, 1, 1, "a-1").release("a", 21, 22, 1).
			grant("b", 30, 40, 2).read("b", 41, 42, 0).stale("b", 43, 50, 2, 2, "b-1").release("b", 51, 52, 2)
		res := Check(b.ops, map[string][]string{"n": nil}, opts)
		if res.OK() || res.BadRefusals != 2 {
			t.Errorf("Check = %s, wrong refusals %d; want 2: each write carried the newest token", res.Verdict(), res.BadRefusals)
		}
	})
	t.Run("CurrentBelowGranted", func(t *testing.T) {
		// a's late write is refused naming token 1, but token 2 had been
		// granted before it was sent.
		b := new(h).
			grant("a", 0, 10, 1).read("a", 11, 12, 0).
			grant("b", 2000, 2010, 2).release("b", 2011, 2012, 2).
			stale("a", 3000, 3010, 1, 1, "a-1")
		res := Check(b.ops, map[string][]string{"n": nil}, opts)
		if res.OK() || res.BadRefusals != 1 {
			t.Errorf("Check = %s, wrong refusals %d; want 1", res.Verdict(), res.BadRefusals)
		}
	})
	t.Run("CurrentMissing", func(t *testing.T) {
		b := new(h).grant("a", 0, 10, 1).read("a", 11, 12, 0).write("a", 13, 20, 1, 409, "a-1")
		res := Check(b.ops, map[string][]string{"n": nil}, opts)
		if res.OK() || res.BadRefusals != 1 {
			t.Errorf("Check = %s, wrong refusals %d; want 1: a stale-token refusal names the current token", res.Verdict(), res.BadRefusals)
		}
	})
	t.Run("TokenNeverIssued", func(t *testing.T) {
		// A write with a token nobody was granted (a probe): the newest
		// token may be below it.
		b := new(h).stale("p", 0, 10, 1, 0, "probe")
		if res := Check(b.ops, map[string][]string{"n": nil}, opts); !res.OK() {
			t.Errorf("Check = %s %v; want OK", res.Verdict(), res.Violations)
		}
	})
}

func TestCheck_Final(t *testing.T) {
	opts := CheckOptions{Exclusive: true}
	t.Run("RefusedWriteInFinalDocument", func(t *testing.T) {
		// The store answered 409 to b's write but applied it anyway; no
		// read followed, so only the final document shows it.
		b := new(h).
			grant("a", 0, 10, 1).read("a", 11, 12, 0).write("a", 13, 20, 1, 200, "a-1").release("a", 21, 22, 1).
			stale("b", 30, 40, 1, 2, "a-1", "b-1")
		res := Check(b.ops, map[string][]string{"n": {"a-1", "b-1"}}, opts)
		if res.OK() || res.ElemsStray != 1 {
			t.Errorf("Check = %s, stray elements %d; want 1: the final document holds b-1, whose only write was refused", res.Verdict(), res.ElemsStray)
		}
	})
	t.Run("ElementNeverWritten", func(t *testing.T) {
		b := new(h).grant("a", 0, 10, 1).read("a", 11, 12, 0).write("a", 13, 20, 1, 200, "a-1").release("a", 21, 22, 1)
		res := Check(b.ops, map[string][]string{"n": {"a-1", "x-1"}}, opts)
		if res.OK() || res.ElemsStray != 1 {
			t.Errorf("Check = %s, stray elements %d; want 1", res.Verdict(), res.ElemsStray)
		}
	})
	t.Run("UnknownWriteInFinalDocument", func(t *testing.T) {
		// A write without an answer may have been applied.
		b := new(h).grant("a", 0, 10, 1).read("a", 11, 12, 0).write("a", 13, 20, 1, 0, "a-1")
		if res := Check(b.ops, map[string][]string{"n": {"a-1"}}, opts); !res.OK() {
			t.Errorf("Check = %s %v; want OK", res.Verdict(), res.Violations)
		}
	})
}
