package chaos_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	mathrand "math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/redfence/redfence/chaos"
	"github.com/redfence/redfence/internal/testutil"
)

// Every scenario below runs a workload against real redis-server and
// Postgres processes and real or in-process Redfence servers, injects its
// faults, and then states its assertions in its doc comment; "the checker
// finds no violation" includes a grant and, where the scenario writes, an
// acknowledged write (requireOK), so that no scenario passes vacuously. The
// default (make test) run is short; `make chaos` runs the long one (-long)
// and prints the report.

func parallel(n int, f func(i int)) {
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { f(i) })
	}
	wg.Wait()
}

// sleepUntil sleeps for d (an injected fault's duration or a phase of the
// fault schedule, never a stand-in for synchronisation) unless stop closes.
func sleepUntil(d time.Duration, stop <-chan struct{}) {
	select {
	case <-time.After(d):
	case <-stop:
	}
}

func constant(o chaos.CycleOptions) func(int, int) chaos.CycleOptions {
	return func(int, int) chaos.CycleOptions { return o }
}

// overtaken reports whether a grant of w's name with a newer token had
// returned before w was sent.
func overtaken(ops []chaos.Op, w chaos.Op) bool {
	for _, g := range ops {
		if g.Granted() && g.Name == w.Name && g.Token > w.Token && g.Return < w.Call {
			return true
		}
	}
	return false
}

// TestChaos_ClientPause is scenario 1: three client processes contend for
// two names; at random pause points (a grant whose document was read, the
// write not yet sent) the test stops the process with SIGSTOP and keeps it
// stopped until a newer holder has written the document (so its lease is
// long over), then continues it. Asserted: every late write of an
// overtaken, paused client is refused 409 stale-token; 0 stale writes
// accepted; 0 acknowledged elements lost; no token regression; the history
// is linearizable; no two grants overlap.
func TestChaos_ClientPause(t *testing.T) {
	t.Parallel()
	clientPause(t, false)
}

// TestChaos_ClientPauseUnfenced is negative control (a): scenario 1 with the
// reference store's fencing switched off (store.Options.Unfenced). Asserted:
// the checker reports the violation fencing prevents: stale writes
// accepted, acknowledged elements lost, and a non-linearizable history.
func TestChaos_ClientPauseUnfenced(t *testing.T) {
	t.Parallel()
	clientPause(t, true)
}

func clientPause(t *testing.T, unfenced bool) {
	id, title := "01", "client SIGSTOPped past its TTL"
	if unfenced {
		id, title = "01n", "control: client SIGSTOP, store fencing OFF"
	}
	e := newEnv(t, id, title, envOptions{})
	e.control = unfenced
	_, clientBin := build(t)
	cfg := serverConfig{Unfenced: unfenced}
	s1, s2 := e.startInproc(cfg), e.startInproc(cfg)
	const ttl = 300 * time.Millisecond
	names := []string{"p-0", "p-1"}
	procs, cycles, maxPauses := 3, size(25, 250), size(4, 50)
	watcher := e.client("watcher", e.httpClient(5*time.Second))
	watcher.Record = nil
	ctx := t.Context()

	var (
		pausing    sync.Mutex // one client stopped at a time, so the others make progress
		mu         sync.Mutex
		rng        = mathrand.New(mathrand.NewPCG(1, 1))
		pauses     int
		stoppedFor []time.Duration
		wg         sync.WaitGroup
	)
	for i := range procs {
		cmd := exec.CommandContext(ctx, clientBin,
			"-servers", s1.URL()+","+s2.URL(), "-names", strings.Join(names, ","), "-id", fmt.Sprintf("c%d", i),
			"-ttl", ttl.String(), "-wait", "1s", "-cycles", strconv.Itoa(cycles), "-seed", strconv.Itoa(i+1))
		cmd.SysProcAttr = testutil.KillWithParent(nil)
		stdin, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		pid := cmd.Process.Pid
		wg.Go(func() {
			copyLines(stdout, func(line []byte) {
				var l chaos.ClientLine
				if err := json.Unmarshal(line, &l); err != nil {
					t.Errorf("client %d printed %q: %v", i, line, err)
					return
				}
				if l.Op != nil {
					e.hist.Add(*l.Op)
					return
				}
				p := l.Pause
				mu.Lock()
				want := pauses < maxPauses && rng.IntN(3) == 0
				mu.Unlock()
				if !want || !pausing.TryLock() {
					_, _ = io.WriteString(stdin, "go\n")
					return
				}
				defer pausing.Unlock()
				end := e.faults.Begin("client SIGSTOP", 0)
				stoppedAt := time.Now()
				if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
					t.Errorf("SIGSTOP client %d: %v", i, err)
				}
				// Delivery is asynchronous: only once every thread has
				// stopped may it find its go-ahead, read when it runs again.
				waitFor(t, 10*time.Second, "the client to stop", func() bool { return stopped(pid) })
				_, _ = io.WriteString(stdin, "paused\n")
				// Keep it stopped until a newer holder has written the
				// document, or 20 TTLs, and in any case past its lease.
				for deadline := time.Now().Add(20 * ttl); time.Now().Before(deadline); {
					if r := watcher.Read(ctx, link(s2), p.Name); r.Found && r.Token > p.Token {
						break
					}
					time.Sleep(10 * time.Millisecond) // polling an observable condition
				}
				for chaos.Now() < p.Call+p.ValidityMS*int64(time.Millisecond) {
					time.Sleep(10 * time.Millisecond) // polling the lease's end
				}
				if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
					t.Errorf("SIGCONT client %d: %v", i, err)
				}
				end()
				mu.Lock()
				pauses++
				stoppedFor = append(stoppedFor, time.Since(stoppedAt))
				mu.Unlock()
			})
			if err := cmd.Wait(); err != nil {
				t.Errorf("client %d: %v\n%s", i, err, stderr.String())
			}
		})
	}
	wg.Wait()

	res := e.check(link(s1), true)
	all := e.hist.Ops()
	late, overtakenN, refused := 0, 0, 0
	for _, w := range e.ops(chaos.Write, func(op chaos.Op) bool { return op.Paused }) {
		late++
		if !overtaken(all, w) {
			continue
		}
		overtakenN++
		if w.Status == http.StatusConflict && w.Problem == "stale-token" {
			refused++
		} else if !unfenced {
			t.Errorf("late write of paused client %s (token %d) on %q: %d %s; want 409 stale-token", w.Client, w.Token, w.Name, w.Status, w.Problem)
		}
	}
	var longest time.Duration
	for _, d := range stoppedFor {
		longest = max(longest, d)
	}
	e.note("%d client processes, %d SIGSTOPs (longest %s, TTL %s); late writes: %d, of which %d after a newer grant, %d refused 409 stale-token",
		procs, pauses, ms(longest), ttl, late, overtakenN, refused)
	if unfenced {
		if res.OK() {
			t.Errorf("negative control: with store fencing off the checker found no violation (stale writes attempted %d); the faults prove nothing", res.StaleAttempted)
		}
		if res.StaleAccepted == 0 || res.ElemsLost == 0 {
			t.Errorf("negative control: stale writes accepted %d, elements lost %d; want both > 0", res.StaleAccepted, res.ElemsLost)
		}
		return
	}
	requireOK(t, res, 1)
	if want := size(2, 25); overtakenN < want {
		t.Errorf("only %d paused clients were overtaken by a newer grant before writing; want at least %d", overtakenN, want)
	}
}

// stopped reports whether every thread of process pid is stopped (state T
// in /proc/pid/task/*/stat).
func stopped(pid int) bool {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil || len(tasks) == 0 {
		return false
	}
	for _, task := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, task.Name()))
		if err != nil {
			return false
		}
		// pid (comm) state ...: comm may hold spaces, so read after the last ')'.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 || i+2 >= len(b) || (b[i+2] != 'T' && b[i+2] != 't') {
			return false
		}
	}
	return true
}

// TestChaos_DelayedWrite is scenario 2: clients contend for two names while
// one more client, after its read, sends its write through a toxiproxy link
// whose latency toxic holds the request until its lease has ended and a
// newer grant exists (so the delay is longer than the TTL). Asserted: every
// delayed write is refused 409 stale-token; the checker finds no violation.
func TestChaos_DelayedWrite(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "02", "write delayed past the TTL (client↔server latency)", envOptions{})
	s1, s2 := e.startProc(serverConfig{}), e.startProc(serverConfig{})
	slowProxy := e.proxy("slow-link", s1.Addr())
	slow := &chaos.Link{Base: "http://" + slowProxy.Listen, HTTP: e.httpClient(time.Minute)}
	const ttl = 300 * time.Millisecond
	names := []string{"d-0", "d-1"}
	hc := e.httpClient(10 * time.Second)
	ctx := t.Context()
	stop := make(chan struct{})
	wait := runBackground(ctx, &chaos.Workload{Clients: 3, Prefix: "w", Names: names, Until: stop,
		Options: constant(chaos.CycleOptions{TTL: ttl, Wait: time.Second}), Links: links(s1, s2), HTTP: hc, Record: e.hist.Add, Seed: 2})
	// The delayed write is recorded as sent when the link let it through:
	// the server cannot have seen it earlier, so that is its invocation for
	// the checker (the client sent it while its lease was still live).
	var delivered atomic.Int64
	d := e.client("delayed", hc)
	d.Record = func(op chaos.Op) {
		if op.Kind == chaos.Write && op.Paused {
			op.Call = max(op.Call, delivered.Load())
		}
		e.hist.Add(op)
	}
	watcher := e.client("watcher", hc)
	watcher.Record = nil
	trials, done := size(3, 40), 0
	var delays []time.Duration
	for n := 0; done < trials && n < 5*trials; n++ {
		name := names[n%len(names)]
		var healed chan struct{}
		g := d.Cycle(ctx, link(s1), name, chaos.CycleOptions{TTL: ttl, Wait: 2 * time.Second,
			Pause: func(ctx context.Context, g *chaos.Grant) (*chaos.Link, bool) {
				e.addToxic(slowProxy, "delay", "latency", "upstream", map[string]any{"latency": time.Hour.Milliseconds()})
				end := e.faults.Begin("client→server latency > TTL", 0)
				healed = make(chan struct{})
				sent := time.Now()
				go func() {
					defer close(healed)
					for ctx.Err() == nil {
						_, _, _, last := watcher.Status(ctx, link(s2), name)
						if last > g.Token && chaos.Now() > g.Call+g.ValidityMS*int64(time.Millisecond) {
							break
						}
						time.Sleep(10 * time.Millisecond) // polling an observable condition
					}
					delivered.Store(chaos.Now())
					e.removeToxic(slowProxy, "delay") // delivers the held write
					end()
					delays = append(delays, time.Since(sent))
				}()
				return slow, true
			}})
		if healed != nil {
			<-healed
			if g != nil {
				done++
			}
		}
	}
	close(stop)
	wait()

	res := e.check(link(s2), true)
	requireOK(t, res, 1)
	delayed := e.ops(chaos.Write, func(op chaos.Op) bool { return op.Paused })
	ok := 0
	for _, w := range delayed {
		if w.Status == http.StatusConflict && w.Problem == "stale-token" {
			ok++
		} else {
			t.Errorf("delayed write (token %d) on %q: %d %s %s; want 409 stale-token", w.Token, w.Name, w.Status, w.Problem, w.Err)
		}
	}
	if done < trials || len(delayed) < trials {
		t.Errorf("%d delayed writes in %d trials; want %d", len(delayed), done, trials)
	}
	var shortest, longest time.Duration
	for i, d := range delays {
		if i == 0 || d < shortest {
			shortest = d
		}
		longest = max(longest, d)
	}
	e.note("%d writes held on the link until their lease had ended and a newer grant existed (TTL %s; held %s to %s): %d refused 409 stale-token",
		len(delayed), ttl, ms(shortest), ms(longest), ok)
}

// TestChaos_NodePause is scenario 3: four clients, each on its own name (no
// contention), cycle against two `redfence serve` processes while one of
// the five Redis nodes is SIGSTOPped for 400ms and continued for 200ms, on
// and off. Per-node timeout: 200ms. Asserted: acquires are granted, and
// none is refused unless 2 more nodes failed besides the paused one; no
// acquire takes more than 10 per-node timeouts (a generous
// bound for a loaded 2-core machine; p50/p99/max are reported); the checker
// finds no violation.
func TestChaos_NodePause(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "03", "1 of 5 nodes SIGSTOPped on and off", envOptions{})
	const nodeTimeout = 200 * time.Millisecond
	cfg := serverConfig{NodeTimeout: nodeTimeout}
	s1, s2 := e.startProc(cfg), e.startProc(cfg)
	ctx := t.Context()
	stop := make(chan struct{})
	pauser := make(chan struct{})
	go func() {
		defer close(pauser)
		for !isClosed(stop) {
			end := e.faults.Begin("redis SIGSTOP", 0)
			if err := e.nodes[0].Pause(); err != nil {
				t.Error(err)
				end()
				return
			}
			sleepUntil(400*time.Millisecond, stop)
			if err := e.nodes[0].Resume(); err != nil {
				t.Error(err)
			}
			end()
			sleepUntil(200*time.Millisecond, stop)
		}
	}()
	wait := runBackground(ctx, &chaos.Workload{Clients: 4, Prefix: "u", Names: []string{"u-0", "u-1", "u-2", "u-3"}, PerClient: true,
		Until: stop, Options: constant(chaos.CycleOptions{TTL: time.Second}), Links: links(s1, s2),
		HTTP: e.httpClient(10 * time.Second), Record: e.hist.Add, Seed: 3})
	sleepUntil(size(4*time.Second, 40*time.Second), nil) // the run's length
	close(stop)
	wait()
	<-pauser

	acq := e.ops(chaos.Acquire, nil)
	granted := len(e.ops(chaos.Acquire, chaos.Op.Granted))
	p50, p99, worst := latencies(acq)
	_, rp99, rworst := latencies(e.ops(chaos.Release, nil))
	ratio := float64(granted) / float64(max(len(acq), 1))
	unexplained := 0
	for _, op := range acq {
		if !op.Granted() && !healthyFailed(op, 0) {
			unexplained++
			e.note("  refused after %s, unexplained: %d %s, nodes %s %s", ms(op.Latency()), op.Status, op.Problem, op.Nodes, op.Err)
		}
	}
	e.note("uncontended acquires granted: %d of %d (%.2f%%); %d refused with a majority of yes or only the paused node failing (want 0)", granted, len(acq), 100*ratio, unexplained)
	e.note("acquire latency p50 %s, p99 %s, max %s (per-node timeout %s; bound 10x); release p99 %s, max %s",
		ms(p50), ms(p99), ms(worst), nodeTimeout, ms(rp99), ms(rworst))
	// Refused only when 2 more nodes than the paused one failed (a loaded
	// machine can make them miss the per-node timeout): never with a
	// majority of yes, nor with only the paused node failing.
	if unexplained > 0 || granted == 0 {
		t.Errorf("%d of %d uncontended acquires granted, %d refused with a majority of yes or only the paused node failing; want none refused so", granted, len(acq), unexplained)
	}
	if worst > 10*nodeTimeout {
		t.Errorf("slowest acquire took %v; want at most 10 per-node timeouts (%v)", worst, 10*nodeTimeout)
	}
	requireOK(t, e.check(link(s1), true), 1)
}

// healthyFailed reports whether a refused acquire was 503
// quorum-unavailable with fewer yes answers than a majority of its nodes,
// a node outside faulted (indexes into the servers' node list) among those
// that did not say yes: the faults alone cannot explain a refusal while
// every other node said yes, and nothing explains one with a majority of
// yes.
func healthyFailed(op chaos.Op, faulted ...int) bool {
	if op.Status != http.StatusServiceUnavailable || op.Problem != "quorum-unavailable" {
		return false
	}
	outcomes := strings.Split(op.Nodes, ",")
	if yes := count(outcomes, func(o string) bool { return o == "yes" }); yes >= len(outcomes)/2+1 {
		return false
	}
	for i, o := range outcomes {
		if o != "yes" && !slices.Contains(faulted, i) {
			return true
		}
	}
	return false
}

// mayBeHeld reports whether, when op (a refused acquire) was sent, an
// earlier lease of its name might still have run: a grant of it within ttl
// before whose release had not been acknowledged (204), or an acquire or
// release of it within ttl before that failed with a node not answering
// (a key the node set may have outlived the try's clean-up).
func mayBeHeld(ops []chaos.Op, op chaos.Op, ttl time.Duration) bool {
	for _, g := range ops {
		if g.Name != op.Name || g.Call >= op.Call || g.Call < op.Call-int64(ttl) {
			continue
		}
		if g.Kind == chaos.Acquire && g.Granted() && !slices.ContainsFunc(ops, func(r chaos.Op) bool {
			return r.Kind == chaos.Release && r.Name == g.Name && r.Token == g.Token && r.Status == http.StatusNoContent && r.Return < op.Call
		}) {
			return true
		}
		if (g.Kind == chaos.Acquire || g.Kind == chaos.Release) && (g.Status == 0 || strings.Contains(g.Nodes, "timeout") || strings.Contains(g.Nodes, "error")) {
			return true
		}
	}
	return false
}

func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// TestChaos_Blackhole is scenario 4: the servers reach each Redis node
// through a toxiproxy proxy. Phases: 2 nodes slow (latency of 2 per-node
// timeouts), 2 blackholed, 3 blackholed, healed. Asserted: with 2 slow or 2
// blackholed, acquires are granted, and each one refused is 503
// quorum-unavailable with a healthy node failing too (on a loaded machine
// one can miss its timeout), or 409 lock-held while an earlier lease of the
// name may still run; those two phases last until an acquire was granted
// in them (up to 30 s more on a busy host); with 3 blackholed, every
// acquire is refused 503 quorum-unavailable with Retry-After within 10
// per-node timeouts (never a hang; the HTTP client would give up after 10s)
// and none is granted; after healing, acquires are granted again; no lock
// key on any node ever lacks an expiry or outlives its TTL; the checker finds
// no violation.
func TestChaos_Blackhole(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "04", "2 nodes slow, 2 then 3 of 5 blackholed, healed", envOptions{proxies: true})
	const nodeTimeout, ttl = 200 * time.Millisecond, time.Second
	cfg := serverConfig{NodeTimeout: nodeTimeout}
	s1, s2 := e.startProc(cfg), e.startProc(cfg)
	ctx := t.Context()
	phase := size(1500*time.Millisecond, 8*time.Second)
	stop := make(chan struct{})
	wait := runBackground(ctx, &chaos.Workload{Clients: 4, Prefix: "b", Names: []string{"b-0", "b-1", "b-2", "b-3"}, PerClient: true,
		Until: stop, Options: constant(chaos.CycleOptions{TTL: ttl}), Links: links(s1, s2),
		HTTP: e.httpClient(10 * time.Second), Record: e.hist.Add, Seed: 4})

	type span struct{ from, to int64 }
	// An acquire belongs to a phase when it ran entirely inside it.
	in := func(s span) func(chaos.Op) bool {
		return func(op chaos.Op) bool { return op.Call >= s.from && op.Return <= s.to }
	}
	run := func() span {
		from := chaos.Now()
		sleepUntil(phase, nil) // the phase's length
		return span{from, chaos.Now()}
	}
	// runGranting is run for a phase that must grant: on a host so busy
	// that healthy nodes miss their timeouts too, it goes on (up to 30 s
	// more) until an acquire ran and was granted inside it.
	runGranting := func() span {
		s := run()
		for limit := time.Now().Add(30 * time.Second); time.Now().Before(limit); {
			if slices.ContainsFunc(e.ops(chaos.Acquire, in(s)), chaos.Op.Granted) {
				break
			}
			sleepUntil(100*time.Millisecond, nil)
			s.to = chaos.Now()
		}
		return s
	}
	blackhole := func(i int) {
		e.addToxic(e.proxies[i], "bh-up", "timeout", "upstream", map[string]any{"timeout": 0})
		e.addToxic(e.proxies[i], "bh-down", "timeout", "downstream", map[string]any{"timeout": 0})
	}
	checkKeys := func(when string) {
		for k, d := range e.lockKeys() {
			if d <= 0 || d > ttl {
				t.Errorf("%s: stray lock key %s with PTTL %v; want 0 < PTTL <= TTL %v", when, k, d, ttl)
			}
		}
	}

	end := e.faults.Begin("redis latency 2x node timeout", 0)
	for _, i := range []int{3, 4} {
		e.addToxic(e.proxies[i], "slow", "latency", "downstream", map[string]any{"latency": (2 * nodeTimeout).Milliseconds()})
	}
	slow := runGranting()
	for _, i := range []int{3, 4} {
		e.removeToxic(e.proxies[i], "slow")
	}
	end()

	var ends []func()
	for _, i := range []int{3, 4} {
		ends = append(ends, e.faults.Begin("redis blackhole", 0))
		blackhole(i)
	}
	two := runGranting()
	ends = append(ends, e.faults.Begin("redis blackhole", 0))
	blackhole(2)
	three := run()
	checkKeys("with 3 of 5 nodes blackholed")
	for _, i := range []int{2, 3, 4} {
		e.removeToxic(e.proxies[i], "bh-up")
		e.removeToxic(e.proxies[i], "bh-down")
	}
	for _, end := range ends {
		end()
	}
	healed := run()
	close(stop)
	wait()
	checkKeys("after the workload")
	waitFor(t, ttl+5*time.Second, "every lock key to expire or be released", func() bool { return len(e.lockKeys()) == 0 })

	ratio := func(ops []chaos.Op) (int, float64) {
		g := 0
		for _, op := range ops {
			if op.Granted() {
				g++
			}
		}
		return g, float64(g) / float64(max(len(ops), 1))
	}
	for _, p := range []struct {
		what string
		s    span
	}{{"2 nodes slow", slow}, {"2 nodes blackholed", two}} {
		ops := e.ops(chaos.Acquire, in(p.s))
		g, r := ratio(ops)
		unexplained := 0
		for _, op := range ops {
			if op.Granted() {
				continue
			}
			why := "a healthy node failed too"
			if op.Problem == "lock-held" && mayBeHeld(e.hist.Ops(), op, ttl) {
				why = "an earlier lease of the name may still run"
			} else if !healthyFailed(op, 3, 4) {
				why = "UNEXPLAINED: a majority said yes, or only the faulted nodes failed"
				unexplained++
			}
			e.note("  refused after %s: %d %s, nodes %s %s (%s)", ms(op.Latency()), op.Status, op.Problem, op.Nodes, op.Err, why)
		}
		e.note("%s: %d of %d acquires granted (%.1f%%); %d refused with a majority of yes or only the faulted nodes failing (want 0)", p.what, g, len(ops), 100*r, unexplained)
		// A loaded machine can make a healthy node miss its per-node
		// timeout too, and then the quorum is truly gone: such a refusal
		// is right. One the 3 healthy nodes' yes should have won is not.
		if unexplained > 0 || g == 0 {
			t.Errorf("%s: %d of %d acquires granted, %d refused with a majority of yes or only the faulted nodes failing; want none refused so", p.what, g, len(ops), unexplained)
		}
	}
	ops := e.ops(chaos.Acquire, in(three))
	_, _, worst := latencies(ops)
	bad := 0
	for _, op := range ops {
		if op.Status != http.StatusServiceUnavailable || op.Problem != "quorum-unavailable" || op.RetryAfter == "" {
			bad++
			if bad <= 5 {
				t.Errorf("3 of 5 blackholed: acquire answered %d %q (Retry-After %q, err %s) after %v; want 503 quorum-unavailable with Retry-After",
					op.Status, op.Problem, op.RetryAfter, op.Err, op.Latency())
			}
		}
	}
	e.note("3 nodes blackholed: %d acquires, %d answered 503 quorum-unavailable with Retry-After, slowest in %s (bound 10x node timeout %s)",
		len(ops), len(ops)-bad, ms(worst), nodeTimeout)
	if len(ops) == 0 || worst > 10*nodeTimeout {
		t.Errorf("3 of 5 blackholed: %d acquires, slowest %v; want some, each within %v", len(ops), worst, 10*nodeTimeout)
	}
	after := e.ops(chaos.Acquire, in(healed))
	g, _ := ratio(after)
	late := e.ops(chaos.Acquire, in(span{healed.from + int64(phase/2), healed.to}))
	lg, lr := ratio(late)
	e.note("healed: %d of %d acquires granted; in the second half of the phase %d of %d", g, len(after), lg, len(late))
	if g == 0 || lr < 0.99 {
		t.Errorf("after healing: %d of %d acquires granted, %d of %d in the phase's second half; want grants to resume", g, len(after), lg, len(late))
	}
	requireOK(t, e.check(link(s1), true), 1)
}

// TestChaos_NodeRestart is scenario 5: in each round, client A holds many
// names on nodes 0-2 only (nodes 3 and 4 are held by someone else while A
// acquires, then freed); node 0 is killed with SIGKILL and restarted at
// once without its data, so a majority (0, 3, 4) no longer knows A's locks;
// client B then tries every name, half through each of two servers. The
// long run makes 1,000 such trials (short: 40). Asserted: no trial grants B
// while A's lease is live (0 overlapping grants), and most trials are
// effective (B tried while A's lease was live).
func TestChaos_NodeRestart(t *testing.T) {
	t.Parallel()
	nodeRestart(t, false)
}

// TestChaos_NodeRestartNoQuarantine is negative control (b): scenario 5
// with restart detection off (no service.Registry). Asserted: the checker
// reports overlapping grants.
func TestChaos_NodeRestartNoQuarantine(t *testing.T) {
	t.Parallel()
	nodeRestart(t, true)
}

func nodeRestart(t *testing.T, noQuarantine bool) {
	id, title := "05", "node kill -9 + empty restart under a held lock"
	if noQuarantine {
		id, title = "05n", "control: node restart, quarantine OFF"
	}
	e := newEnv(t, id, title, envOptions{})
	e.control = noQuarantine
	// A's lease is MaxTTL long: the quarantine after each restart lasts as
	// long, so it sets the pace of the rounds.
	const maxTTL = 2 * time.Second
	// A generous per-node timeout: A must win nodes 0-2 exactly, and the
	// in-process servers share the loaded test process.
	cfg := serverConfig{MaxTTL: maxTTL, NodeTimeout: 250 * time.Millisecond, NoQuarantine: noQuarantine}
	sa, sb := e.startInproc(cfg), e.startInproc(cfg)
	want, per := size(40, 1000), size(20, 50)
	if noQuarantine {
		want = size(20, 100)
	}
	ctx := t.Context()
	hc := e.httpClient(10 * time.Second)
	ca, cb := e.client("A", hc), e.client("B", hc)
	trials, effective, bGranted, skipped, rounds := 0, 0, 0, 0, 0
	for r := 0; trials < want && r < 2*want/per+2; r++ {
		rounds++
		waitFor(t, 10*maxTTL, "node quarantine to end", func() bool {
			for _, s := range []*inproc{sa, sb} {
				for _, st := range s.locker.Nodes(ctx) {
					if !st.QuarantinedUntil.IsZero() {
						return false
					}
				}
			}
			return true
		})
		names := make([]string, per)
		for i := range names {
			names[i] = fmt.Sprintf("r%d-%d", r, i)
		}
		for _, c := range e.raw[3:] {
			pipe := c.Pipeline()
			for _, n := range names {
				pipe.Set(ctx, lockKey(n), "someone-else", time.Minute)
			}
			if _, err := pipe.Exec(ctx); err != nil {
				t.Fatal(err)
			}
		}
		// A name whose set-up fails (A not granted, or its lease lost before
		// the extend, on a machine stalled past the TTL) is left out of the
		// round: it would not test anything.
		grants := make([]*chaos.Grant, per)
		parallel(per, func(i int) {
			op, g := ca.Acquire(ctx, link(sa), names[i], maxTTL, 2*time.Second, false)
			if g == nil {
				t.Logf("set-up: A could not acquire %q: %d %s nodes %s %s", names[i], op.Status, op.Problem, op.Nodes, op.Err)
				return
			}
			// Extend waits for the granting round's stragglers, so A's refused
			// SETs on nodes 3 and 4 are over before those keys are removed.
			// (503: a slow node on a loaded machine; try again.)
			for try := 0; ; try++ {
				op := ca.Extend(ctx, link(sa), g, maxTTL)
				if op.Status == http.StatusOK {
					break
				}
				if op.Status != http.StatusServiceUnavailable || try == 4 {
					t.Logf("set-up: A could not extend %q: %d %s nodes %s %s", names[i], op.Status, op.Problem, op.Nodes, op.Err)
					ca.Release(ctx, link(sa), g)
					return
				}
			}
			grants[i] = g
		})
		for _, c := range e.raw[3:] {
			if err := c.Del(ctx, func() []string {
				ks := make([]string, len(names))
				for i, n := range names {
					ks[i] = lockKey(n)
				}
				return ks
			}()...).Err(); err != nil {
				t.Fatal(err)
			}
		}
		end := e.faults.Begin("redis kill -9 + restart without data", maxTTL)
		if err := e.nodes[0].Kill(); err != nil {
			t.Fatal(err)
		}
		if err := e.nodes[0].Start(ctx); err != nil {
			t.Fatal(err)
		}
		bOps := make([]chaos.Op, per)
		bGrants := make([]*chaos.Grant, per)
		parallel(per, func(i int) {
			if grants[i] == nil {
				return
			}
			s := sa
			if i%2 == 1 {
				s = sb
			}
			bOps[i], bGrants[i] = cb.Acquire(ctx, link(s), names[i], maxTTL, 0, false)
		})
		end()
		for i, a := range grants {
			if a == nil {
				skipped++
				continue
			}
			trials++
			if bOps[i].Call < a.Call+a.ValidityMS*int64(time.Millisecond) {
				effective++
			}
			_ = ca.Release(ctx, link(sa), a)
			if g := bGrants[i]; g != nil {
				bGranted++
				_ = cb.Release(ctx, link(sa), g)
			}
		}
	}
	res := e.check(link(sa), true)
	e.note("%d trials (%d rounds x %d names, %d left out because their set-up failed; %d effective: B tried while A's lease was live); B granted in %d, overlapping grants %d",
		trials, rounds, per, skipped, effective, bGranted, res.Overlaps)
	if trials < want {
		t.Errorf("%d trials; want %d", trials, want)
	}
	if skipped > rounds*per/20 {
		t.Errorf("%d of %d names left out because A's set-up failed; want at most 5%%", skipped, rounds*per)
	}
	if noQuarantine {
		if res.Overlaps == 0 {
			t.Errorf("negative control: with quarantine off no overlap in %d trials (%d effective); the fault proves nothing", trials, effective)
		}
		return
	}
	requireOK(t, res, 0) // A and B only acquire, extend and release: no writes
	if res.Overlaps != 0 {
		t.Errorf("%d overlapping grants in %d trials; want 0", res.Overlaps, trials)
	}
	if effective < trials/2 {
		t.Errorf("only %d of %d trials effective (B tried while A's lease was live); the trial design failed on this machine", effective, trials)
	}
}

// TestChaos_IssueStall is scenario 6: clients contend for two names through
// an in-process server (with the AfterQuorum hook) and a `redfence serve`
// process; every third cycle sent to the in-process server asks the hook to
// stall that acquire between quorum and token issuance for twice the TTL.
// Asserted: no stalled acquire is granted; every stall the hook ran ends
// in 503 lease-expired; the checker finds no violation; no lock key
// outlives its TTL.
func TestChaos_IssueStall(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "06", "stall between quorum and issuance > TTL", envOptions{})
	const ttl = 300 * time.Millisecond
	var stalls atomic.Int32
	in := e.startInproc(serverConfig{Hook: func(ctx context.Context, key, _ string) {
		stalls.Add(1)
		end := e.faults.Begin("stall before issuance", 0)
		time.Sleep(2 * ttl) // the injected stall
		end()
	}})
	p := e.startProc(serverConfig{})
	ctx := t.Context()
	(&chaos.Workload{Clients: 3, Prefix: "s", Names: []string{"s-0", "s-1"}, Cycles: size(20, 150),
		Options: func(i, n int) chaos.CycleOptions {
			// Cycle n of client i goes to links[(i+n)%2]: 0 is the in-process server.
			if (i+n)%2 == 0 && n%3 == 0 {
				return chaos.CycleOptions{TTL: ttl, Stall: true} // one attempt: wait 0
			}
			return chaos.CycleOptions{TTL: ttl, Wait: time.Second}
		},
		Links: links(in, p), HTTP: e.httpClient(10 * time.Second), Record: e.hist.Add, Seed: 6}).Run(ctx)

	stalled := e.ops(chaos.Acquire, func(op chaos.Op) bool { return op.Stall })
	expired := 0
	for _, op := range stalled {
		if op.Granted() {
			t.Errorf("stalled acquire of %q granted token %d; want refused", op.Name, op.Token)
		}
		if op.Status == http.StatusServiceUnavailable && op.Problem == "lease-expired" {
			expired++
		}
	}
	overtakenDuring := 0
	for _, op := range stalled {
		if op.Problem == "lease-expired" && len(e.ops(chaos.Acquire, func(g chaos.Op) bool {
			return g.Granted() && g.Name == op.Name && g.Return > op.Call && g.Return < op.Return
		})) > 0 {
			overtakenDuring++
		}
	}
	e.note("%d acquires asked to stall; %d reached the stall (2x TTL %s) and %d were refused 503 lease-expired; %d of them while another client was granted the name",
		len(stalled), stalls.Load(), ttl, expired, overtakenDuring)
	if n := int(stalls.Load()); n == 0 || expired != n {
		t.Errorf("%d stalls ran, %d acquires refused lease-expired; want as many, and at least one", n, expired)
	}
	for k, d := range e.lockKeys() {
		if d <= 0 || d > ttl {
			t.Errorf("lock key %s with PTTL %v; want 0 < PTTL <= %v", k, d, ttl)
		}
	}
	requireOK(t, e.check(link(p), true), 1)
}

// TestChaos_EarlyExpiry is scenario 7. Targeted trials: A holds a lock; its
// key is deleted on 3 of 5 nodes (an early expiry, as a clock jump on those
// nodes would cause); A's extend must answer 409 lock-lost and leave the
// nodes as they were: it neither recreates the expired keys nor renews the
// others, nor deletes them (the majority's "no" may be wrong: a node that
// lost the key unnoticed); A's release then deletes them; B is granted; a
// release with a wrong lock token answers 409 not-holder and B's key stays
// on all 5 nodes. Then a workload that
// extends between read and write runs while random held keys expire early
// on 3 nodes. Asserted: as above for every trial; in the workload, no stale
// write accepted, no element lost, no token regression, linearizable, and
// no overlap outside the fault windows of its name. Inside them the jump
// breaks Redlock's timing assumption, and overlaps there are reported, not
// failed: a waiting client wins the majority the jump freed while the
// holder's lease is still valid, and the holder learns of the loss only when
// its next extend answers lock-lost.
func TestChaos_EarlyExpiry(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "07", "early expiry on 3 of 5 nodes (clock jump)", envOptions{})
	// No node is slow here: a generous node timeout keeps a busy host from
	// timing a node out, whose renewal a refused extend then leaves as it
	// is (it cannot know the lease the node had), which the trials'
	// lease checks would take for a renewal left in place.
	cfg := serverConfig{MaxTTL: 3 * time.Second, NodeTimeout: time.Second}
	s1, s2 := e.startProc(cfg), e.startProc(cfg)
	ctx := t.Context()
	hc := e.httpClient(10 * time.Second)
	ca, cb, cc := e.client("A", hc), e.client("B", hc), e.client("C", hc)
	trials := size(5, 100)
	wrong := strings.Repeat("A", 27) // well-formed, held by nobody
	for i := range trials {
		name := fmt.Sprintf("x-%d", i)
		_, a := ca.Acquire(ctx, link(s1), name, 2*time.Second, 0, false)
		if a == nil {
			t.Fatalf("trial %d: A not granted", i)
		}
		waitFor(t, 5*time.Second, "A's key on all 5 nodes", func() bool {
			return count(e.holders(name), func(v string) bool { return v == a.LockToken }) == 5
		})
		end := e.faults.BeginOn("early expiry on 3 of 5 nodes", name, 0)
		for _, c := range e.raw[:3] {
			if err := c.Del(ctx, lockKey(name)).Err(); err != nil {
				t.Fatal(err)
			}
		}
		var before [5]time.Duration
		for j, c := range e.raw[3:] {
			d, err := c.PTTL(ctx, lockKey(name)).Result()
			if err != nil {
				t.Fatal(err)
			}
			before[3+j] = d
		}
		ext := decided(func() chaos.Op { return ca.Extend(ctx, link([]*proc{s1, s2}[i%2]), a, 2*time.Second) })
		if ext.Status != http.StatusConflict || ext.Problem != "lock-lost" {
			t.Errorf("trial %d: extend after early expiry = %d %q; want 409 lock-lost", i, ext.Status, ext.Problem)
		}
		if h := e.holders(name); count(h[:3], func(v string) bool { return v != "" }) != 0 || count(h[3:], func(v string) bool { return v == a.LockToken }) != 2 {
			t.Errorf("trial %d: after the refused extend the nodes hold %q; want A's key on the last two only, as before", i, h)
		}
		for j, c := range e.raw[3:] {
			// Put back as it was (the extend script reports a lease
			// rounded up to 4 ms).
			if d, err := c.PTTL(ctx, lockKey(name)).Result(); err != nil || d > before[3+j]+4*time.Millisecond {
				t.Errorf("trial %d: node %d's lease after the refused extend = %v, %v; want at most the %v it had", i, 3+j, d, err, before[3+j])
			}
		}
		end()
		decided(func() chaos.Op { return ca.Release(ctx, link(s1), a) })
		if h := e.holders(name); count(h, func(v string) bool { return v != "" }) != 0 {
			t.Errorf("trial %d: after A's release the nodes hold %q; want no key anywhere", i, h)
		}
		_, b := cb.Acquire(ctx, link(s2), name, 2*time.Second, 0, false)
		if b == nil {
			t.Fatalf("trial %d: B not granted after A lost the lock", i)
		}
		waitFor(t, 5*time.Second, "B's key on all 5 nodes", func() bool {
			return count(e.holders(name), func(v string) bool { return v == b.LockToken }) == 5
		})
		if op := decided(func() chaos.Op { return cc.Release(ctx, link(s1), &chaos.Grant{Name: name, LockToken: wrong}) }); op.Status != http.StatusConflict || op.Problem != "not-holder" {
			t.Errorf("trial %d: release with a wrong token = %d %q; want 409 not-holder", i, op.Status, op.Problem)
		}
		if n := count(e.holders(name), func(v string) bool { return v == b.LockToken }); n != 5 {
			t.Errorf("trial %d: after a wrong-token release B's key is on %d nodes; want 5", i, n)
		}
		if op := decided(func() chaos.Op { return cb.Release(ctx, link(s2), b) }); op.Status != http.StatusNoContent {
			t.Errorf("trial %d: B's release = %d %q", i, op.Status, op.Problem)
		}
	}

	const ttl = 500 * time.Millisecond
	names := []string{"j-0", "j-1"}
	stop := make(chan struct{})
	wait := runBackground(ctx, &chaos.Workload{Clients: 3, Prefix: "w", Names: names, Until: stop,
		Options: constant(chaos.CycleOptions{TTL: ttl, Wait: time.Second, Extend: true}), Links: links(s1, s2),
		HTTP: hc, Record: e.hist.Add, Seed: 7})
	rng := mathrand.New(mathrand.NewPCG(7, 7))
	jumps := 0
	for deadline := time.Now().Add(size(3*time.Second, 20*time.Second)); time.Now().Before(deadline); {
		sleepUntil(150*time.Millisecond, nil) // the fault schedule
		name := names[rng.IntN(len(names))]
		if count(e.holders(name), func(v string) bool { return v != "" }) < 3 {
			continue
		}
		e.faults.BeginOn("early expiry on 3 of 5 nodes", name, ttl)()
		jumps++
		for _, i := range rng.Perm(5)[:3] {
			_ = e.raw[i].Del(ctx, lockKey(name)).Err()
		}
	}
	close(stop)
	wait()
	res := e.check(link(s1), false)
	requireOK(t, res, 1)
	lost := len(e.ops(chaos.Extend, func(op chaos.Op) bool { return op.Problem == "lock-lost" && strings.HasPrefix(op.Client, "w") }))
	e.note("%d targeted trials (extend 409 lock-lost, no key recreated; wrong-token release 409 not-holder, nothing deleted)", trials)
	e.note("workload: %d early expiries of held keys; %d extends answered lock-lost; %d overlaps inside fault windows (expected: a clock jump breaks Redlock's timing)",
		jumps, lost, res.Overlaps-res.FaultFreeOverlaps)
}

// TestChaos_PostgresKill is scenario 8: clients contend for two names
// through an in-process server and a `redfence serve` process sharing a
// Postgres of their own; in each round two acquires are held by the
// AfterQuorum hook after winning their quorum, Postgres is stopped with
// SIGQUIT (pg_ctl -m immediate), the held acquires continue into issuance,
// and Postgres is restarted after a short outage. Asserted: every held
// acquire answers 503 fencing-unavailable and leaves no key on any node;
// every token granted after a restart is above every token any client
// received before the kill (and the checker finds no regression, stale
// write, lost element or overlap).
func TestChaos_PostgresKill(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "08", "Postgres killed (immediate) during issuance", envOptions{ownPostgres: true})
	var gate struct {
		sync.Mutex
		reached chan string
		release chan struct{}
	}
	// The held acquires must win their quorum: a node timeout no loaded
	// machine reaches (Redis is not what this scenario faults).
	const nodeTimeout = 2 * time.Second
	in := e.startInproc(serverConfig{NodeTimeout: nodeTimeout, Hook: func(ctx context.Context, key, _ string) {
		gate.Lock()
		reached, release := gate.reached, gate.release
		gate.Unlock()
		reached <- key
		<-release
	}})
	p := e.startProc(serverConfig{NodeTimeout: nodeTimeout})
	ctx := t.Context()
	hc := e.httpClient(10 * time.Second)
	ready := func() {
		for _, s := range []server{in, p} {
			waitFor(t, 20*time.Second, "the server to be ready", func() bool {
				resp, err := hc.Get(s.URL() + "/readyz")
				if err != nil {
					return false
				}
				resp.Body.Close()
				return resp.StatusCode == http.StatusOK
			})
		}
	}
	ready() // a node quarantined as the servers start would refuse the held acquires
	stop := make(chan struct{})
	wait := runBackground(ctx, &chaos.Workload{Clients: 3, Prefix: "g", Names: []string{"g-0", "g-1"}, Until: stop,
		Options: constant(chaos.CycleOptions{TTL: 300 * time.Millisecond, Wait: 500 * time.Millisecond}), Links: links(in, p),
		HTTP: hc, Record: e.hist.Add, Seed: 8})
	held := e.client("held", hc)
	type outage struct{ kill, restart int64 }
	var outages []outage
	for k := range size(1, 8) {
		sleepUntil(size(500*time.Millisecond, 2*time.Second), nil) // fault schedule
		const k2 = 2
		gate.Lock()
		gate.reached, gate.release = make(chan string, k2), make(chan struct{})
		gate.Unlock()
		names := []string{fmt.Sprintf("h%d-a", k), fmt.Sprintf("h%d-b", k)}
		results := make([]chaos.Op, k2)
		var wg sync.WaitGroup
		for i, n := range names {
			wg.Go(func() { results[i], _ = held.Acquire(ctx, link(in), n, 2*time.Second, 0, true) })
		}
		returned := make(chan struct{})
		go func() { wg.Wait(); close(returned) }()
		for n := 0; n < k2; {
			select {
			case <-gate.reached:
				n++
			case <-returned:
				t.Fatalf("round %d: the held acquires returned before reaching issuance: %+v", k, results)
			case <-time.After(30 * time.Second):
				close(gate.release)
				t.Fatalf("round %d: the held acquires did not reach issuance within 30s", k)
			}
		}
		end := e.faults.Begin("postgres kill (immediate) + restart", 0)
		o := outage{kill: chaos.Now()}
		if err := e.pg.Stop(ctx, true); err != nil {
			t.Fatal(err)
		}
		close(gate.release)
		wg.Wait()
		for i, op := range results {
			// A busy host can take longer than the lease to stop Postgres:
			// a stall that outlasted the TTL is refused lease-expired
			// before issuance is tried, which is as right (the lease is the
			// TTL less its drift allowance, 42 ms).
			outlasted := op.Problem == "lease-expired" && op.Latency() >= 2*time.Second-42*time.Millisecond
			if op.Status != http.StatusServiceUnavailable || op.Problem != "fencing-unavailable" && !outlasted {
				t.Errorf("round %d: acquire in flight during the kill = %d %q %s after %v; want 503 fencing-unavailable (or lease-expired after the 2s TTL)", k, op.Status, op.Problem, op.Err, op.Latency())
			}
			if h := e.holders(names[i]); count(h, func(v string) bool { return v != "" }) != 0 {
				t.Errorf("round %d: refused acquire of %q left keys %q (TTL 2s); want none", k, names[i], h)
			}
		}
		sleepUntil(300*time.Millisecond, nil) // the outage
		if err := e.pg.Start(ctx); err != nil {
			t.Fatal(err)
		}
		o.restart = chaos.Now()
		end()
		outages = append(outages, o)
		ready()
	}
	sleepUntil(size(500*time.Millisecond, 2*time.Second), nil) // run on after the last restart
	close(stop)
	wait()

	res := e.check(link(p), true)
	requireOK(t, res, 1)
	grants := e.ops(chaos.Acquire, chaos.Op.Granted)
	for _, o := range outages {
		before, after := map[string]int64{}, map[string]int64{}
		for _, g := range grants {
			if g.Return < o.kill {
				before[g.Name] = max(before[g.Name], g.Token)
			}
			if g.Call > o.restart && (after[g.Name] == 0 || g.Token < after[g.Name]) {
				after[g.Name] = g.Token
			}
		}
		for name, lo := range after {
			if lo <= before[name] {
				t.Errorf("%q: token %d granted after the restart is not above token %d received before the kill", name, lo, before[name])
			}
		}
	}
	e.note("%d Postgres kills during issuance; held acquires all refused 503 fencing-unavailable without keys; tokens after each restart above all before", len(outages))
}

// TestChaos_PoolExhaustion is scenario 9: an in-process server whose
// reference store has a pool of 4 Postgres connections; four writers hold
// all of them, blocked on token rows the test locks (FOR UPDATE) in an open
// transaction, while clients keep cycling. Probes during the exhaustion: an
// acquire, a status and a release of an unrelated name, and a write.
// Asserted: the lock probes are served (the locks have a pool of their own:
// document traffic cannot take it), the write answers (503
// store-unavailable or, once the rows are free, its own answer); after the
// rows are released the writers complete; the process's goroutines return
// to their number before the scenario (no leak); the checker finds no
// violation. Not parallel: it counts the process's goroutines.
func TestChaos_PoolExhaustion(t *testing.T) {
	e := newEnv(t, "09", "documents' Postgres pool exhausted", envOptions{})
	const issueTimeout, stmtTimeout, pool = time.Second, 5 * time.Second, 4
	// The writers' own store timeout must not free a connection while the
	// probes run: only the statement timeout or the rollback ends their
	// wait. DBMaxConns sizes both pools (the documents' follows the locks').
	// No node is slow here: a generous node timeout keeps a busy host from
	// timing the nodes out, which would refuse the probes 503
	// quorum-unavailable for a reason that is not the one under test.
	s := e.startInproc(serverConfig{MaxTTL: 10 * time.Second, NodeTimeout: time.Second, IssueTimeout: issueTimeout, StatementTimeout: stmtTimeout, DBMaxConns: pool,
		StoreTimeout: 2 * stmtTimeout})
	ctx := t.Context()
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	hc := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	warm := e.client("warm", hc)
	hot := make([]string, pool)
	for i := range hot {
		hot[i] = fmt.Sprintf("hot-%d", i)
		if g := warm.Cycle(ctx, link(s), hot[i], chaos.CycleOptions{TTL: time.Second}); g == nil {
			t.Fatalf("warm-up cycle on %q not granted", hot[i])
		}
	}
	tr.CloseIdleConnections()
	baseline := settledGoroutines()

	admin, err := pgx.Connect(ctx, e.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	monitor, err := pgx.Connect(ctx, e.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer monitor.Close(context.Background())

	stop := make(chan struct{})
	wait := runBackground(ctx, &chaos.Workload{Clients: 2, Prefix: "e", Names: []string{"e-0", "e-1"}, Until: stop,
		Options: constant(chaos.CycleOptions{TTL: 300 * time.Millisecond, Wait: 500 * time.Millisecond}), Links: links(s),
		HTTP: hc, Record: e.hist.Add, Seed: 9})
	probe := e.client("probe", e.httpClient(30*time.Second))
	var probeLat, putLat []time.Duration
	for r := range size(1, 5) {
		var readAll, writers sync.WaitGroup
		var ungranted atomic.Int32
		readAll.Add(pool)
		locked := make(chan struct{})
		for i, name := range hot {
			c := e.client(fmt.Sprintf("writer%d-%d", r, i), hc)
			writers.Go(func() {
				paused := false
				c.Cycle(ctx, link(s), name, chaos.CycleOptions{TTL: 10 * time.Second, Pause: func(context.Context, *chaos.Grant) (*chaos.Link, bool) {
					paused = true
					readAll.Done()
					<-locked
					return nil, false
				}})
				if !paused { // not granted: no writer holds its row
					ungranted.Add(1)
					readAll.Done()
				}
			})
		}
		readAll.Wait()
		if n := ungranted.Load(); n > 0 {
			close(locked)
			writers.Wait()
			t.Fatalf("round %d: %d of %d writers were not granted their name, so the pool is not held", r, n, pool)
		}
		tx, err := admin.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SELECT token FROM redfence_fencing WHERE key = ANY($1) FOR UPDATE", hot); err != nil {
			t.Fatal(err)
		}
		end := e.faults.Begin("postgres pool exhausted", 0)
		close(locked)
		waitFor(t, 10*time.Second, "every pooled connection to wait on the locked rows", func() bool {
			var n int
			err := monitor.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
				WHERE datname = current_database() AND application_name = 'redfence' AND wait_event_type = 'Lock'`).Scan(&n)
			return err == nil && n >= pool
		})
		exhausted := time.Now()
		name := fmt.Sprintf("cold-%d", r)
		// A write needs a connection of the documents' pool; the store
		// waits for one up to its timeout. Observed, not asserted beyond
		// "it answers". (A name nobody locks: its token is never issued.)
		putDone := make(chan chaos.Op, 1)
		go func() {
			putDone <- probe.Write(ctx, link(s), fmt.Sprintf("cold-put-%d", r), 1, []string{"probe"}, "probe", false)
		}()
		op, g := probe.Acquire(ctx, link(s), name, time.Second, 0, false)
		if op.Status != http.StatusCreated || g == nil {
			t.Errorf("round %d: acquire while the documents' pool is exhausted = %d %q %s after %v; want 201: the locks have a pool of their own",
				r, op.Status, op.Problem, op.Err, op.Latency())
		}
		probeLat = append(probeLat, op.Latency())
		t0 := time.Now()
		status, problem, held, _ := probe.Status(ctx, link(s), name)
		if status != http.StatusOK || g != nil && !held {
			t.Errorf("round %d: status while the documents' pool is exhausted = %d %q held %v; want 200 held", r, status, problem, held)
		}
		probeLat = append(probeLat, time.Since(t0))
		if g != nil {
			if op := probe.Release(ctx, link(s), g); op.Status != http.StatusNoContent {
				t.Errorf("round %d: release while the documents' pool is exhausted = %d %q %s; want 204", r, op.Status, op.Problem, op.Err)
			}
		}
		if time.Since(exhausted) > stmtTimeout {
			t.Logf("round %d: probes ended %v after exhaustion; the writers' statement timeout (%v) may have freed connections", r, time.Since(exhausted), stmtTimeout)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		end()
		writers.Wait()
		put := <-putDone
		putLat = append(putLat, put.Latency())
		if put.Status == 0 || put.Status >= 500 && put.Problem != "store-unavailable" {
			t.Errorf("round %d: write during the exhaustion = %d %q %s", r, put.Status, put.Problem, put.Err)
		}
	}
	close(stop)
	wait()
	closeIdle := func() {
		tr.CloseIdleConnections()
		probe.HTTP.CloseIdleConnections()
	}
	closeIdle()
	after := baseline
	deadline := time.Now().Add(20 * time.Second)
	for after = runtime.NumGoroutine(); after > baseline+5 && time.Now().Before(deadline); after = runtime.NumGoroutine() {
		closeIdle()
		time.Sleep(50 * time.Millisecond) // polling the goroutine count
	}
	if after > baseline+5 {
		var buf bytes.Buffer
		_ = pprof.Lookup("goroutine").WriteTo(&buf, 1)
		t.Errorf("goroutines: %d before the scenario, %d after; want at most %d (leak?)\n%s", baseline, after, baseline+5, buf.String())
	}
	var worst time.Duration
	for _, d := range probeLat {
		worst = max(worst, d)
	}
	writes := e.ops(chaos.Write, func(op chaos.Op) bool { return strings.HasPrefix(op.Client, "writer") })
	okW := len(e.ops(chaos.Write, func(op chaos.Op) bool { return strings.HasPrefix(op.Client, "writer") && op.Status == 200 }))
	var putWorst time.Duration
	for _, d := range putLat {
		putWorst = max(putWorst, d)
	}
	e.note("documents' pool of %d held by writers blocked on locked rows; %d lock probes (acquire, status) served from the locks' own pool, slowest %s; blocked writers completed: %d of %d; goroutines %d before, %d after",
		pool, len(probeLat), ms(worst), okW, len(writes), baseline, after)
	e.note("a write sent during the exhaustion waited for a free connection of the documents' pool and answered when the rows were released: slowest %s", ms(putWorst))
	requireOK(t, e.check(link(s), true), 1)
}

// settledGoroutines returns the goroutine count once it stops falling.
func settledGoroutines() int {
	n := runtime.NumGoroutine()
	for range 20 {
		time.Sleep(50 * time.Millisecond) // polling the goroutine count
		m := runtime.NumGoroutine()
		if m >= n {
			return min(n, m)
		}
		n = m
	}
	return n
}

// TestChaos_ServerKill is scenario 10: three `redfence serve` processes
// share the nodes and Postgres while clients cycle through all of them. In
// each round the test holds the token row of a victim name locked, sends an
// acquire of it to one server, waits until a majority of nodes hold its key
// (the quorum is won; issuance is blocked), kills that server with SIGKILL,
// releases the row, and restarts the server. Asserted: the killed request
// gets no response; its keys carry an expiry of at most the TTL; another
// server grants the victim name within 3 TTLs of the kill with a larger
// token; the other servers grant locks while it is down; the checker finds
// no violation.
func TestChaos_ServerKill(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "10", "redfence kill -9 between quorum and response", envOptions{})
	srv := []*proc{e.startProc(serverConfig{}), e.startProc(serverConfig{}), e.startProc(serverConfig{})}
	ctx := t.Context()
	hc := e.httpClient(5 * time.Second)
	stop := make(chan struct{})
	wait := runBackground(ctx, &chaos.Workload{Clients: 3, Prefix: "k", Names: []string{"k-0", "k-1"}, Until: stop,
		Options: constant(chaos.CycleOptions{TTL: 300 * time.Millisecond, Wait: time.Second}), Links: links(srv[0], srv[1], srv[2]),
		HTTP: hc, Record: e.hist.Add, Seed: 10})
	admin, err := pgx.Connect(ctx, e.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	const ttl = time.Second
	victimC, other := e.client("victim", hc), e.client("B", hc)
	type outage struct {
		server     string
		kill, back int64
	}
	var outages []outage
	var freeAfter []time.Duration
	for k := range size(1, 8) {
		sleepUntil(size(300*time.Millisecond, time.Second), nil) // fault schedule
		victim, peer := srv[k%3], srv[(k+1)%3]
		name := fmt.Sprintf("v-%d", k)
		if g := other.Cycle(ctx, link(peer), name, chaos.CycleOptions{TTL: ttl}); g == nil {
			t.Fatalf("round %d: could not create %q's token row", k, name)
		}
		tx, err := admin.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SELECT token FROM redfence_fencing WHERE key = $1 FOR UPDATE", name); err != nil {
			t.Fatal(err)
		}
		res := make(chan chaos.Op, 1)
		go func() {
			op, _ := victimC.Acquire(ctx, link(victim), name, ttl, 0, false)
			res <- op
		}()
		waitFor(t, 10*time.Second, "the victim's quorum", func() bool {
			select {
			case op := <-res: // it cannot answer while its token row is locked
				t.Fatalf("round %d: the victim's acquire answered %d %q %s (nodes %s) before its quorum was seen", k, op.Status, op.Problem, op.Err, op.Nodes)
			default:
			}
			return count(e.holders(name), func(v string) bool { return v != "" }) >= 3
		})
		quorum := time.Now()
		for key, d := range e.lockKeys() {
			if strings.HasSuffix(key, lockKey(name)) && (d <= 0 || d > ttl) {
				t.Errorf("round %d: %s has PTTL %v; want 0 < PTTL <= %v", k, key, d, ttl)
			}
		}
		end := e.faults.Begin("redfence kill -9 mid-request", ttl)
		o := outage{server: victim.URL(), kill: chaos.Now()}
		victim.Kill()
		if op := <-res; op.Status != 0 {
			t.Errorf("round %d: the killed server's request answered %d %q; want no response", k, op.Status, op.Problem)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		op, g := other.Acquire(ctx, link(peer), name, ttl, 3*ttl, false)
		if g == nil {
			t.Errorf("round %d: %q not granted by another server within 3 TTLs of the kill: %d %q", k, name, op.Status, op.Problem)
		} else {
			freeAfter = append(freeAfter, time.Unix(0, op.Return).Sub(quorum))
			if d := time.Unix(0, op.Return).Sub(quorum); d > 3*ttl {
				t.Errorf("round %d: %q free again %v after the killed grant's quorum; want within 3 TTLs (%v)", k, name, d, 3*ttl)
			}
			other.Release(ctx, link(peer), g)
		}
		victim.Restart()
		o.back = chaos.Now()
		end()
		outages = append(outages, o)
	}
	sleepUntil(size(300*time.Millisecond, time.Second), nil)
	close(stop)
	wait()
	res := e.check(link(srv[0]), true)
	requireOK(t, res, 1)
	during := 0
	for _, o := range outages {
		n := len(e.ops(chaos.Acquire, func(op chaos.Op) bool {
			return op.Granted() && op.Server != o.server && op.Call >= o.kill && op.Return <= o.back && strings.HasPrefix(op.Client, "k")
		}))
		if n == 0 {
			t.Errorf("no grant by the other servers while %s was down", o.server)
		}
		during += n
	}
	var longest time.Duration
	for _, d := range freeAfter {
		longest = max(longest, d)
	}
	e.note("%d servers killed between quorum and response; lock free again after at most %s (TTL %s); %d grants by the other servers while one was down",
		len(outages), ms(longest), ttl, during)
}

// decided runs do again while it answers 503 quorum-unavailable (at most 20
// times): on a loaded machine too few nodes may answer within the node
// timeout, and the call is then undecided, not refused. The calls it wraps
// are safe to repeat (an extend never recreates a key, a release only
// deletes its own).
func decided(do func() chaos.Op) chaos.Op {
	for i := 0; ; i++ {
		op := do()
		if op.Status != http.StatusServiceUnavailable || op.Problem != "quorum-unavailable" || i == 20 {
			return op
		}
	}
}
