package chaos

import (
	"fmt"
	"io"
	"maps"
	"slices"
	"sort"
	"strings"
	"sync"
	"text/tabwriter"
	"time"
)

// Scenario is one scenario's line in the report.
type Scenario struct {
	// ID orders the report ("01", "05n", ...); Title says what ran.
	ID, Title string
	Result    *Result
	Faults    map[string]int
	Duration  time.Duration
	// Control marks a negative control: a violation is what it expects.
	Control bool
	// Notes are the scenario's own figures (success ratios, latencies, trials).
	Notes []string
	// Failed reports that the scenario's test failed.
	Failed bool
}

// Report collects scenarios from concurrent tests and prints them.
type Report struct {
	mu        sync.Mutex
	scenarios []Scenario
}

// Add records s.
func (r *Report) Add(s Scenario) {
	r.mu.Lock()
	r.scenarios = append(r.scenarios, s)
	r.mu.Unlock()
}

// Len returns the number of scenarios recorded.
func (r *Report) Len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.scenarios)
}

func sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

func breakdown(m map[string]int) string {
	if len(m) == 0 {
		return "none"
	}
	keys := slices.Collect(maps.Keys(m))
	sort.Slice(keys, func(i, j int) bool {
		if m[keys[i]] != m[keys[j]] {
			return m[keys[i]] > m[keys[j]]
		}
		return keys[i] < keys[j]
	})
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s %d", k, m[k])
	}
	return strings.Join(parts, ", ")
}

// Write prints the at-a-glance table, then each scenario's breakdown.
func (r *Report) Write(w io.Writer, title string) {
	r.mu.Lock()
	ss := slices.Clone(r.scenarios)
	r.mu.Unlock()
	sort.Slice(ss, func(i, j int) bool { return ss[i].ID < ss[j].ID })

	fmt.Fprintf(w, "\n%s\n%s\n", title, strings.Repeat("=", len(title)))
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "scenario\tops\tgrants\trefused\tfaults\tstale writes\ttokens\telements\toverlapping\tchecker\ttest\t")
	fmt.Fprintln(tw, "\t\t\t\t\tattempted/accepted\tgranted/regressions\tacked/lost\tgrants\tverdict\t\t")
	var tot Result
	tot.Refusals = map[string]int{}
	totFaults := map[string]int{}
	failed := 0
	for _, s := range ss {
		res := s.Result
		if res == nil {
			res = &Result{}
		}
		verdict := "OK"
		switch {
		case s.Result == nil:
			verdict = "not checked"
		case !res.OK():
			verdict = "VIOLATION"
		}
		if s.Control {
			if res.OK() {
				verdict = "OK (control wants a violation)"
			} else {
				verdict += " (expected)"
			}
		}
		test := "PASS"
		if s.Failed {
			test, failed = "FAIL", failed+1
		}
		fmt.Fprintf(tw, "%s %s\t%d\t%d\t%d\t%d\t%d/%d\t%d/%d\t%d/%d\t%d\t%s\t%s\t\n",
			s.ID, s.Title, res.Ops, res.Grants, sum(res.Refusals), sum(s.Faults),
			res.StaleAttempted, res.StaleAccepted, res.Tokens, res.Regressions,
			res.ElemsAcked, res.ElemsLost, res.Overlaps, verdict, test)
		tot.Ops += res.Ops
		tot.Grants += res.Grants
		for k, v := range res.Refusals {
			tot.Refusals[k] += v
		}
		for k, v := range s.Faults {
			totFaults[k] += v
		}
		tot.StaleAttempted += res.StaleAttempted
		tot.StaleAccepted += res.StaleAccepted
		tot.Tokens += res.Tokens
		tot.Regressions += res.Regressions
		tot.ElemsAcked += res.ElemsAcked
		tot.ElemsLost += res.ElemsLost
		tot.Overlaps += res.Overlaps
	}
	verdict := fmt.Sprintf("%d of %d scenarios passed", len(ss)-failed, len(ss))
	fmt.Fprintf(tw, "total\t%d\t%d\t%d\t%d\t%d/%d\t%d/%d\t%d/%d\t%d\t%s\t\t\n",
		tot.Ops, tot.Grants, sum(tot.Refusals), sum(totFaults), tot.StaleAttempted, tot.StaleAccepted,
		tot.Tokens, tot.Regressions, tot.ElemsAcked, tot.ElemsLost, tot.Overlaps, verdict)
	_ = tw.Flush()
	fmt.Fprintln(w, "\nstale writes: sent with a token below one already granted or applied; tokens: distinct fencing tokens clients were")
	fmt.Fprintln(w, "granted (tokens burned by refused grants are invisible to clients); elements: unique elements appended by acknowledged")
	fmt.Fprintln(w, "writes, and those missing from the final document; negative controls (\"(expected)\") run with a safety mechanism")
	fmt.Fprintln(w, "switched off and pass when the checker reports the violation it allows.")

	for _, s := range ss {
		res := s.Result
		if res == nil {
			res = &Result{}
		}
		fmt.Fprintf(w, "\n%s %s (%v)\n", s.ID, s.Title, s.Duration.Round(100*time.Millisecond))
		if s.Result == nil {
			fmt.Fprintf(w, "  checker verdict:    not checked (the test stopped before the check)\n")
		} else {
			fmt.Fprintf(w, "  checker verdict:    %s\n", res.Verdict())
		}
		fmt.Fprintf(w, "  refusals by reason: %s\n", breakdown(res.Refusals))
		fmt.Fprintf(w, "  faults injected:    %s\n", breakdown(s.Faults))
		if res.Overlaps > 0 {
			fmt.Fprintf(w, "  overlapping grants: %d (%d outside fault windows)\n", res.Overlaps, res.FaultFreeOverlaps)
		}
		for _, n := range s.Notes {
			fmt.Fprintf(w, "  %s\n", n)
		}
		for _, v := range res.Violations {
			fmt.Fprintf(w, "  ! %s\n", v)
		}
		if res.Visualization != "" {
			fmt.Fprintf(w, "  porcupine visualisation: %s\n", res.Visualization)
		}
	}
	fmt.Fprintf(w, "\nrefusals by reason, all scenarios: %s\n", breakdown(tot.Refusals))
	fmt.Fprintf(w, "faults injected, all scenarios:    %s\n", breakdown(totFaults))
}
