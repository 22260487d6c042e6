package chaos

import (
	"os"
	"strings"
	"testing"

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
			write("a", 43, 44, 1, 409, "a-1", "a-2").
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
	})
	t.Run("LostElement", func(t *testing.T) {
		b := new(h).grant("a", 0, 10, 1).read("a", 11, 12, 0).write("a", 13, 20, 1, 200, "a-1").release("a", 21, 22, 1)
		if res := Check(b.ops, map[string][]string{"n": nil}, opts); res.ElemsLost != 1 || res.OK() {
			t.Fatalf("Check = %s, lost %d; want 1", res.Verdict(), res.ElemsLost)
		}
	})
}
