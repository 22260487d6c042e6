package chaos

import (
	"fmt"
	"hash/fnv"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	// porcupine checks histories for linearizability against a sequential
	// model (the checker Jepsen's Knossos popularised, in Go): it is what
	// tells a history with a stale write or a regressed token from a merely
	// concurrent one, and draws the offending partition when it fails.
	"github.com/anishathalye/porcupine"
)

// CheckOptions tunes Check.
type CheckOptions struct {
	// Exclusive states that the run's faults keep Redlock's timing
	// assumptions, so no two grants of one name may overlap at all. Without
	// it only overlaps outside every fault window of their name are
	// violations.
	Exclusive bool
	// Windows are the fault windows of the run.
	Windows []Window
	// Out is the directory porcupine's visualisation is written to when the
	// history is not linearizable; "" is $CHAOS_OUT, else none is written
	// (the negative controls fail that check on every run).
	Out string
	// Label names the visualisation file.
	Label string
	// Timeout bounds the linearizability check. The default is 2 minutes;
	// a check that times out is reported as unknown, which is a failure.
	Timeout time.Duration
}

// Result is the checker's verdict on a history, with the figures of the
// chaos report.
type Result struct {
	Ops    int
	Grants int
	// Refusals counts the operations that did not succeed, by problem type
	// (no-response: no answer, outcome unknown). Reads of a document not
	// yet written are not refusals.
	Refusals map[string]int
	// StaleAttempted counts writes sent with a token below one already
	// granted or applied when they were sent; StaleAccepted those of them
	// the store accepted.
	StaleAttempted, StaleAccepted int
	// BadRefusals counts stale-token refusals that name no newer token:
	// current_fencing_token absent, equal to the write's token, or below a
	// token granted before the write was sent.
	BadRefusals int
	// Tokens counts distinct tokens granted; Regressions the grants whose
	// token was not above every token granted before it was asked for
	// (including reuse).
	Tokens, Regressions int
	// ElemsAcked counts elements whose write was acknowledged; ElemsLost
	// those missing from the final document. ElemsStray counts elements of
	// final documents that no write appended, or only writes refused.
	ElemsAcked, ElemsLost, ElemsStray int
	// Overlaps counts pairs of grants of one name that were live at once;
	// FaultFreeOverlaps those of them outside every fault window of the name.
	Overlaps, FaultFreeOverlaps int
	// Linearizable is porcupine's verdict.
	Linearizable porcupine.CheckResult
	// Visualization is the file porcupine's visualisation was written to.
	Visualization string
	// Violations describes what went wrong (the first few of each kind).
	Violations []string

	exclusive bool
}

// OK reports whether the history kept every promise checked.
func (r *Result) OK() bool {
	return r.StaleAccepted == 0 && r.BadRefusals == 0 && r.Regressions == 0 &&
		r.ElemsLost == 0 && r.ElemsStray == 0 &&
		r.FaultFreeOverlaps == 0 && (!r.exclusive || r.Overlaps == 0) &&
		r.Linearizable == porcupine.Ok
}

// Verdict is OK, or VIOLATION with what was violated.
func (r *Result) Verdict() string {
	if r.OK() {
		return "OK"
	}
	var what []string
	if r.StaleAccepted > 0 {
		what = append(what, "stale write")
	}
	if r.BadRefusals > 0 {
		what = append(what, "wrong refusal")
	}
	if r.Regressions > 0 {
		what = append(what, "token regression")
	}
	if r.ElemsLost > 0 {
		what = append(what, "lost element")
	}
	if r.ElemsStray > 0 {
		what = append(what, "stray element")
	}
	if r.FaultFreeOverlaps > 0 || (r.exclusive && r.Overlaps > 0) {
		what = append(what, "overlap")
	}
	switch r.Linearizable {
	case porcupine.Illegal:
		what = append(what, "not linearizable")
	case porcupine.Unknown:
		what = append(what, "linearizability unknown (timeout)")
	}
	return "VIOLATION: " + strings.Join(what, ", ")
}

// Refusal returns the refusal reason of op, or "" if op succeeded.
func Refusal(op Op) string {
	switch {
	case op.Status == 0:
		return "no-response"
	case op.Kind == Read && op.Status == 404:
		return ""
	case op.Status < 300:
		return ""
	case op.Problem != "":
		return op.Problem
	}
	return fmt.Sprintf("http-%d", op.Status)
}

// writeOutcome classifies a write: applied, refused (a definite answer that
// nothing changed), or unknown (no answer, or a 5xx: the statement may have
// committed before the connection broke).
func writeOutcome(op Op) string {
	switch {
	case op.Status == 200:
		return "ok"
	case op.Status == 0 || op.Status >= 500:
		return "unknown"
	}
	return "refused"
}

// Check judges ops. finals holds the final document of every name written
// (nil for a document that does not exist).
func Check(ops []Op, finals map[string][]string, o CheckOptions) *Result {
	r := &Result{Ops: len(ops), Refusals: make(map[string]int), exclusive: o.Exclusive}
	byName := make(map[string][]Op)
	for _, op := range ops {
		if why := Refusal(op); why != "" {
			r.Refusals[why]++
		}
		byName[op.Name] = append(byName[op.Name], op)
	}
	names := make([]string, 0, len(byName))
	for n := range byName {
		names = append(names, n)
	}
	sort.Strings(names)
	var viol violations
	for _, name := range names {
		r.checkName(name, byName[name], finals, o, &viol)
	}
	r.linearizable(ops, o, &viol)
	r.Violations = viol.list()
	return r
}

// violations keeps the first few descriptions of each kind and counts the rest.
type violations struct {
	shown   map[string]int
	lines   []string
	dropped map[string]int
}

func (v *violations) add(kind, format string, args ...any) {
	if v.shown == nil {
		v.shown, v.dropped = make(map[string]int), make(map[string]int)
	}
	if v.shown[kind] >= 5 {
		v.dropped[kind]++
		return
	}
	v.shown[kind]++
	v.lines = append(v.lines, kind+": "+fmt.Sprintf(format, args...))
}

func (v *violations) list() []string {
	out := v.lines
	kinds := make([]string, 0, len(v.dropped))
	for k := range v.dropped {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	for _, k := range kinds {
		out = append(out, fmt.Sprintf("%s: %d more", k, v.dropped[k]))
	}
	return out
}

// maxBefore answers "the largest token among these events that returned
// before t".
type maxBefore struct {
	ret []int64 // sorted return times
	max []int64 // max[i]: largest token among the first i+1
}

func newMaxBefore(evs []Op) maxBefore {
	s := slices.Clone(evs)
	slices.SortFunc(s, func(a, b Op) int { return cmp64(a.Return, b.Return) })
	m := maxBefore{ret: make([]int64, len(s)), max: make([]int64, len(s))}
	var hi int64
	for i, e := range s {
		hi = max(hi, e.Token)
		m.ret[i], m.max[i] = e.Return, hi
	}
	return m
}

func (m maxBefore) at(t int64) int64 {
	i := sort.Search(len(m.ret), func(i int) bool { return m.ret[i] >= t })
	if i == 0 {
		return 0
	}
	return m.max[i-1]
}

func cmp64(a, b int64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func (r *Result) checkName(name string, ops []Op, finals map[string][]string, o CheckOptions, v *violations) {
	var grants, applied []Op
	for _, op := range ops {
		switch {
		case op.Granted():
			grants = append(grants, op)
		case op.Kind == Write && op.Status == 200:
			applied = append(applied, op)
		}
	}
	r.Grants += len(grants)

	// A grant regresses when its token was granted before (to anyone, at any
	// time) or is not above every token granted before it was asked for.
	granted, written := newMaxBefore(grants), newMaxBefore(applied)
	seen := make(map[int64]Op)
	for _, g := range grants {
		prev, dup := seen[g.Token]
		switch {
		case dup:
			r.Regressions++
			v.add("token reused", "%q token %d granted to %s and to %s", name, g.Token, prev.Client, g.Client)
		case granted.at(g.Call) >= g.Token:
			r.Regressions++
			v.add("token regression", "%q granted token %d to %s after token %d had been granted", name, g.Token, g.Client, granted.at(g.Call))
		}
		seen[g.Token] = g
	}
	r.Tokens += len(seen)
	for _, op := range ops {
		if op.Kind != Write {
			continue
		}
		if op.Status == 409 && op.Problem == "stale-token" {
			r.checkRefusal(name, op, granted.at(op.Call), v)
		}
		newest := max(granted.at(op.Call), written.at(op.Call))
		if op.Token >= newest {
			continue
		}
		r.StaleAttempted++
		if op.Status == 200 {
			r.StaleAccepted++
			v.add("stale write accepted", "%q write by %s with token %d accepted after token %d was granted or applied", name, op.Client, op.Token, newest)
		}
	}

	final := make(map[string]bool)
	for _, e := range finals[name] {
		final[e] = true
	}
	for _, w := range applied {
		r.ElemsAcked++
		if !final[w.Elem] {
			r.ElemsLost++
			v.add("element lost", "%q element %s written by %s with token %d (acknowledged) is not in the final document", name, w.Elem, w.Client, w.Token)
		}
	}
	// Each element of the final document was appended by a write that was
	// applied or may have been, never only by refused ones.
	appendedBy := make(map[string]bool) // element: a write of it was not refused
	for _, op := range ops {
		if op.Kind == Write {
			appendedBy[op.Elem] = appendedBy[op.Elem] || writeOutcome(op) != "refused"
		}
	}
	for _, e := range finals[name] {
		ok, sent := appendedBy[e]
		switch {
		case !sent:
			r.ElemsStray++
			v.add("stray element", "%q final document holds %s, which no write appended", name, e)
		case !ok:
			r.ElemsStray++
			v.add("stray element", "%q final document holds %s, whose every write was refused", name, e)
		}
	}
	r.overlaps(name, ops, grants, o, v)
}

// checkRefusal checks a write refused stale-token. Its current token is the
// newest issued, so it is not the write's own (a write carrying the newest
// token is applied) nor below floor, the newest token granted before the
// write was sent (granted tokens are never withdrawn). It may be below the
// write's token only when that token was never issued (a probe's).
func (r *Result) checkRefusal(name string, op Op, floor int64, v *violations) {
	switch {
	case op.Current == nil:
		r.BadRefusals++
		v.add("wrong refusal", "%q write by %s with token %d refused stale-token without current_fencing_token", name, op.Client, op.Token)
	case *op.Current == op.Token || *op.Current < floor:
		r.BadRefusals++
		v.add("wrong refusal", "%q write by %s with token %d refused stale-token naming %d as the newest token (newest granted before it was sent: %d)",
			name, op.Client, op.Token, *op.Current, floor)
	}
}

type lease struct {
	op         Op
	start, end int64
}

// overlaps counts pairs of grants of name live at once. A grant is live from
// its response until the first of: its release was sent (the holder gave
// it up), the answer to an extend of it refused as lost (409) arrived (the
// holder learned of the loss no earlier), its deadline (acquire or last
// successful extend sent + validity).
func (r *Result) overlaps(name string, ops, grants []Op, o CheckOptions, v *violations) {
	type key struct {
		client string
		token  int64
	}
	ls := make(map[key]*lease)
	var order []*lease
	for _, g := range grants {
		l := &lease{op: g, start: g.Return, end: g.Call + g.ValidityMS*int64(time.Millisecond)}
		ls[key{g.Client, g.Token}] = l
		order = append(order, l)
	}
	for _, op := range ops {
		l := ls[key{op.Client, op.Token}]
		if l == nil {
			continue
		}
		switch {
		case op.Kind == Extend && op.Status == 200:
			l.end = max(l.end, op.Call+op.ValidityMS*int64(time.Millisecond))
		}
	}
	for _, op := range ops {
		l := ls[key{op.Client, op.Token}]
		if l == nil {
			continue
		}
		switch {
		case op.Kind == Release:
			l.end = min(l.end, op.Call)
		case op.Kind == Extend && op.Status == 409:
			l.end = min(l.end, op.Return)
		}
	}
	slices.SortFunc(order, func(a, b *lease) int { return cmp64(a.start, b.start) })
	for i, a := range order {
		if a.end <= a.start {
			continue
		}
		for _, b := range order[i+1:] {
			if b.start >= a.end {
				break
			}
			if b.end <= b.start {
				continue
			}
			r.Overlaps++
			free := !inWindow(o.Windows, name, a.start, a.end) && !inWindow(o.Windows, name, b.start, b.end)
			if free {
				r.FaultFreeOverlaps++
			}
			if free || o.Exclusive {
				v.add("overlapping grants", "%q token %d (%s) was live until %s when token %d (%s) was granted",
					name, a.op.Token, a.op.Client, time.Unix(0, a.end).Format("15:04:05.000"), b.op.Token, b.op.Client)
			}
		}
	}
}

// inWindow reports whether [from, to] meets a window of a fault that hit
// name.
func inWindow(ws []Window, name string, from, to int64) bool {
	for _, w := range ws {
		if (w.Name == "" || w.Name == name) && from <= w.To && w.From <= to {
			return true
		}
	}
	return false
}

// The porcupine model: one partition per name; its state is the newest
// token granted and the document.

type docState struct {
	Last     int64 // newest token granted that the model knows of
	DocToken int64 // token of the last applied write
	Hash     uint64
	Len      int
}

type modelIn struct {
	Kind  Kind
	Name  string
	Token int64
	Hash  uint64
	Len   int
	Elem  string
}

type modelOut struct {
	Outcome string // write: ok, refused, unknown
	Token   int64  // acquire: granted token; read: the document's token
	Found   bool
	Hash    uint64
	Len     int
	Tail    string // read: last element, for the visualisation
}

func hashElems(elems []string) uint64 {
	h := fnv.New64a()
	for _, e := range elems {
		h.Write([]byte(e))
		h.Write([]byte{0})
	}
	return h.Sum64()
}

var emptyHash = hashElems(nil)

func stepModel(s, in, out any) []any {
	st, i, o := s.(docState), in.(modelIn), out.(modelOut)
	switch i.Kind {
	case Acquire:
		// A granted token is above every token granted before; tokens
		// burned by refused grants are invisible, so it need not be Last+1.
		if o.Token > st.Last {
			st.Last = o.Token
			return []any{st}
		}
		return nil
	case Read:
		if o.Found == (st.DocToken > 0) && o.Hash == st.Hash && o.Len == st.Len && (!o.Found || o.Token == st.DocToken) {
			return []any{st}
		}
		return nil
	case Write:
		applied := st
		applied.DocToken, applied.Hash, applied.Len = i.Token, i.Hash, i.Len
		switch o.Outcome {
		case "ok":
			// The fenced store applies a write only with the newest token.
			if i.Token == st.Last {
				return []any{applied}
			}
			return nil
		case "refused":
			// A refusal changes nothing; it is always allowed because a
			// token burned after this grant is invisible to the model.
			return []any{st}
		default:
			if i.Token == st.Last {
				return []any{st, applied}
			}
			return []any{st}
		}
	}
	return nil
}

func model() porcupine.Model {
	nm := porcupine.NondeterministicModel{
		Partition: func(h []porcupine.Operation) [][]porcupine.Operation {
			by := make(map[string][]porcupine.Operation)
			var names []string
			for _, op := range h {
				n := op.Input.(modelIn).Name
				if _, ok := by[n]; !ok {
					names = append(names, n)
				}
				by[n] = append(by[n], op)
			}
			out := make([][]porcupine.Operation, 0, len(names))
			for _, n := range names {
				out = append(out, by[n])
			}
			return out
		},
		Init: func() []any { return []any{docState{Hash: emptyHash}} },
		Step: stepModel,
		Hash: func(s any) uint64 {
			st := s.(docState)
			return st.Hash ^ uint64(st.Last)*0x9e3779b97f4a7c15 ^ uint64(st.DocToken)<<32
		},
		DescribeOperation: func(in, out any) string {
			i, o := in.(modelIn), out.(modelOut)
			switch i.Kind {
			case Acquire:
				return fmt.Sprintf("acquire(%s) → token %d", i.Name, o.Token)
			case Read:
				if !o.Found {
					return fmt.Sprintf("read(%s) → none", i.Name)
				}
				return fmt.Sprintf("read(%s) → %d elems …%s @token %d", i.Name, o.Len, o.Tail, o.Token)
			}
			return fmt.Sprintf("write(%s, token %d, +%s → %d elems) → %s", i.Name, i.Token, i.Elem, i.Len, o.Outcome)
		},
		DescribeState: func(s any) string {
			st := s.(docState)
			return fmt.Sprintf("newest token %d; document: %d elems @token %d", st.Last, st.Len, st.DocToken)
		},
	}
	return nm.ToModel()
}

func (r *Result) linearizable(ops []Op, o CheckOptions, v *violations) {
	var end int64
	for _, op := range ops {
		end = max(end, op.Return)
	}
	clients := make(map[string]int)
	var hist []porcupine.Operation
	for _, op := range ops {
		in := modelIn{Kind: op.Kind, Name: op.Name, Token: op.Token}
		var out modelOut
		ret := op.Return
		switch {
		case op.Granted():
			out.Token = op.Token
		case op.Kind == Read && (op.Status == 200 || op.Status == 404):
			out = modelOut{Found: op.Found, Token: op.Token, Hash: hashElems(op.Elems), Len: len(op.Elems)}
			if n := len(op.Elems); n > 0 {
				out.Tail = op.Elems[n-1]
			}
		case op.Kind == Write:
			in.Hash, in.Len, in.Elem = hashElems(op.Elems), len(op.Elems), op.Elem
			out.Outcome = writeOutcome(op)
			if out.Outcome == "unknown" {
				// It may take effect at any time after it was sent.
				ret = end + 1
			}
		default:
			continue
		}
		id, ok := clients[op.Client]
		if !ok {
			id = len(clients)
			clients[op.Client] = id
		}
		hist = append(hist, porcupine.Operation{ClientId: id, Input: in, Output: out, Call: op.Call, Return: ret})
	}
	timeout := o.Timeout
	if timeout <= 0 {
		timeout = 2 * time.Minute
	}
	m := model()
	r.Linearizable = porcupine.CheckOperationsTimeout(m, hist, timeout)
	if r.Linearizable == porcupine.Ok {
		return
	}
	if r.Linearizable == porcupine.Unknown {
		v.add("linearizability", "porcupine did not decide within %v", timeout)
		return
	}
	dir := o.Out
	if dir == "" {
		dir = os.Getenv("CHAOS_OUT")
	}
	if dir == "" {
		v.add("linearizability", "the history is not linearizable against the fenced-store model; set CHAOS_OUT=dir to keep porcupine's visualisation")
		return
	}
	_, info := porcupine.CheckOperationsVerbose(m, hist, timeout)
	label := o.Label
	if label == "" {
		label = "history"
	}
	label = strings.NewReplacer("/", "_", " ", "_").Replace(label)
	path := filepath.Join(dir, fmt.Sprintf("redfence-chaos-%s-%d.html", label, time.Now().UnixNano()))
	if err := os.MkdirAll(dir, 0o755); err == nil {
		if err := porcupine.VisualizePath(m, info, path); err == nil {
			r.Visualization = path
		}
	}
	v.add("linearizability", "the history is not linearizable against the fenced-store model; visualisation: %s", orNone(r.Visualization))
}

func orNone(s string) string {
	if s == "" {
		return "(could not be written)"
	}
	return s
}
