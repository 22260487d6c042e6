package service

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/internal/testutil"
)

// pipeHook counts the pipelines a node's client sends, and can hold the
// first one until released.
type pipeHook struct {
	mu      sync.Mutex
	sizes   []int         // calls per pipeline (each call of a merged EVALSHA counts)
	cmds    []int         // commands per pipeline
	hold    chan struct{} // closed to let the held pipeline go
	holding chan struct{} // closed once the first pipeline is held
}

func (h *pipeHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *pipeHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return next
}

func (h *pipeHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		calls := 0
		for _, c := range cmds {
			calls += callsIn(c)
		}
		h.mu.Lock()
		h.sizes = append(h.sizes, calls)
		h.cmds = append(h.cmds, len(cmds))
		first := len(h.sizes) == 1
		h.mu.Unlock()
		if first && h.hold != nil {
			close(h.holding)
			<-h.hold
		}
		return next(ctx, cmds)
	}
}

// callsIn is the number of calls cmd carries: n for the EVALSHA (or EVAL)
// of a script's batch form, else 1.
func callsIn(cmd redis.Cmder) int {
	args := cmd.Args()
	if len(args) < 3 {
		return 1
	}
	for _, s := range scripts {
		if args[1] == s.batch.sha || args[1] == s.batch.src {
			return args[3+args[2].(int)].(int)
		}
	}
	return 1
}

// scripts are the node's scripts, for callsIn and loadScripts.
var scripts = []*luaScript{acquireScript, extendScript, adoptScript, markScript, releaseScript}

// loadScripts loads every script and its batch form into the node at
// admin's address, so no EVALSHA is answered NOSCRIPT and resent.
func loadScripts(t *testing.T, admin *redis.Client) {
	t.Helper()
	for _, s := range scripts {
		for _, src := range []string{s.src, s.batch.src} {
			if err := admin.ScriptLoad(t.Context(), src).Err(); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// batches returns the number of calls each pipeline carried.
func (h *pipeHook) batches() []int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]int(nil), h.sizes...)
}

// commands returns the number of commands each pipeline carried.
func (h *pipeHook) commands() []int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]int(nil), h.cmds...)
}

func realNode(t *testing.T, opts RedisOptions) (*RedisNode, *pipeHook, *redis.Client) {
	t.Helper()
	r := clustertest.Redis(t, 1, cluster.RedisOptions{})[0]
	n := NewRedisNode(r.Addr(), opts)
	t.Cleanup(func() { _ = n.Close() })
	// Connected, and the node knows every script (a first EVALSHA would
	// be answered NOSCRIPT and resent as EVAL).
	if _, _, err := n.Acquire(t.Context(), "warm-up", "w", time.Second, ""); err != nil {
		t.Fatal(err)
	}
	admin := redis.NewClient(&redis.Options{Addr: r.Addr()})
	t.Cleanup(func() { _ = admin.Close() })
	loadScripts(t, admin)
	h := &pipeHook{}
	n.client.AddHook(h)
	return n, h, admin
}

// holdFirst sends an Acquire through n and holds its pipeline on the wire
// (before it is written) until h.hold is closed; the returned channel gets
// that Acquire's error.
func holdFirst(n *RedisNode, h *pipeHook) <-chan error {
	h.hold, h.holding = make(chan struct{}), make(chan struct{})
	first := make(chan error, 1)
	go func() { _, _, err := n.Acquire(context.Background(), "held", "t0", time.Minute, ""); first <- err }()
	<-h.holding
	return first
}

// TestPipeline_Batches: commands queued while a pipeline is on the wire go
// out together in the next one, and each caller gets its own answer.
func TestPipeline_Batches(t *testing.T) {
	n, h, _ := realNode(t, RedisOptions{})
	h.hold, h.holding = make(chan struct{}), make(chan struct{})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const callers = 20
	type res struct {
		i  int
		ok bool
	}
	out := make(chan res, callers+1)
	errs := make(chan error, callers+1)
	acquire := func(i int) {
		ok, _, err := n.Acquire(ctx, fmt.Sprintf("k%d", i%10), fmt.Sprintf("t%d", i), time.Minute, "")
		if err != nil {
			errs <- err
			return
		}
		out <- res{i, ok}
	}
	go acquire(0) // its pipeline is held on the way out
	<-h.holding
	for i := 1; i <= callers; i++ {
		go acquire(i)
	}
	testutil.WaitFor(t, time.Minute, "every call queued behind the held pipeline", func() (bool, error) {
		select {
		case err := <-errs:
			return false, err
		default:
			return n.pipe.queued.Load() == callers, nil
		}
	})
	close(h.hold)
	granted := map[int]bool{}
	for range callers + 1 {
		select {
		case err := <-errs:
			t.Fatal(err)
		case r := <-out:
			granted[r.i] = r.ok
		}
	}
	if got := h.batches(); len(got) != 2 || got[0] != 1 || got[1] != callers {
		t.Fatalf("pipeline sizes = %v; want [1 %d]", got, callers)
	}
	if got := h.commands(); len(got) != 2 || got[1] != 1 {
		t.Errorf("commands per pipeline = %v; want [1 1]: the %d acquires merged into one EVALSHA", got, callers)
	}
	// Keys k0..k9: each taken once, by the first of its callers in the queue.
	for k := range 10 {
		var winners int
		for i := k; i <= callers; i += 10 {
			if granted[i] {
				winners++
			}
		}
		if winners != 1 {
			t.Errorf("key k%d granted %d times; want 1", k, winners)
		}
	}
}

// TestPipeline_ScriptFlushed: after the node forgets its scripts (restart,
// SCRIPT FLUSH), calls fall back to EVAL and succeed.
func TestPipeline_ScriptFlushed(t *testing.T) {
	for _, unpipelined := range []bool{false, true} {
		t.Run(fmt.Sprintf("unpipelined=%v", unpipelined), func(t *testing.T) {
			n, _, admin := realNode(t, RedisOptions{Unpipelined: unpipelined})
			ctx := context.Background()
			if ok, _, err := n.Acquire(ctx, "a", "t1", time.Minute, ""); err != nil || !ok {
				t.Fatalf("Acquire = %v, %v", ok, err)
			}
			if err := admin.ScriptFlush(ctx).Err(); err != nil {
				t.Fatal(err)
			}
			if ok, err := n.Release(ctx, "a", "t1"); err != nil || !ok {
				t.Fatalf("Release after SCRIPT FLUSH = %v, %v; want true", ok, err)
			}
			if ok, _, err := n.Acquire(ctx, "a", "t2", time.Minute, ""); err != nil || !ok {
				t.Fatalf("Acquire after SCRIPT FLUSH = %v, %v", ok, err)
			}
		})
	}
}

// TestPipeline_MergedAnswers: the calls merged into one EVALSHA each get
// their own answer, in the order they were queued, and one call's error
// is its own; calls of another script go out as a command of their own in
// the same pipeline.
func TestPipeline_MergedAnswers(t *testing.T) {
	n, h, admin := realNode(t, RedisOptions{})
	bg := context.Background()
	for key, token := range map[string]string{"mine": "t1", "theirs": "t2"} {
		if err := admin.Set(bg, key, token, time.Minute).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if err := admin.HSet(bg, "hash", "f", "v").Err(); err != nil {
		t.Fatal(err)
	}
	first := holdFirst(n, h)
	type answer struct {
		ok  bool
		err error
	}
	released := make([]chan answer, 4)
	for i, key := range []string{"mine", "theirs", "hash", "none"} {
		released[i] = make(chan answer, 1)
		n.releaseAsync(bg, releaseArgs(key, "t1"), func(ok bool, err error) { released[i] <- answer{ok, err} })
	}
	acquired := make(chan answer, 1)
	n.acquireAsync(bg, acquireArgs("fresh", "t3", time.Minute), "", func(ok bool, _ time.Duration, err error) { acquired <- answer{ok, err} })
	close(h.hold)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	for i, want := range []bool{true, false, false, false} {
		a := <-released[i]
		if i == 2 {
			if a.err == nil || !strings.Contains(a.err.Error(), "WRONGTYPE") {
				t.Errorf("release of a hash = %v, %v; want its WRONGTYPE error", a.ok, a.err)
			}
			continue
		}
		if a.err != nil || a.ok != want {
			t.Errorf("release %d = %v, %v; want %v", i, a.ok, a.err, want)
		}
	}
	if a := <-acquired; a.err != nil || !a.ok {
		t.Errorf("acquire in the same pipeline = %v, %v; want granted", a.ok, a.err)
	}
	if got, want := h.batches(), []int{1, 5}; !slices.Equal(got, want) {
		t.Errorf("calls per pipeline = %v; want %v", got, want)
	}
	if got, want := h.commands(), []int{1, 2}; !slices.Equal(got, want) {
		t.Errorf("commands per pipeline = %v; want %v (the releases merged, the acquire on its own)", got, want)
	}
	for key, want := range map[string]int64{"mine": 0, "theirs": 1, "hash": 1, "fresh": 1} {
		if got, err := admin.Exists(bg, key).Result(); err != nil || got != want {
			t.Errorf("EXISTS %s = %d, %v; want %d", key, got, err, want)
		}
	}
}

// TestPipeline_MergedScriptFlushed: merged calls whose batch script the
// node does not know are resent as one EVAL of it, which loads it.
func TestPipeline_MergedScriptFlushed(t *testing.T) {
	n, h, admin := realNode(t, RedisOptions{})
	bg := context.Background()
	first := holdFirst(n, h)
	if err := admin.ScriptFlush(bg).Err(); err != nil {
		t.Fatal(err)
	}
	const calls = 3
	acquireBehind(t, n, h, first, "k", calls)
	// The held acquire was written after the flush: its EVALSHA and then
	// its EVAL; then the merged EVALSHA and its EVAL.
	if got, want := h.batches(), []int{1, 1, calls, calls}; !slices.Equal(got, want) {
		t.Errorf("calls per pipeline = %v; want %v", got, want)
	}
	if got, want := h.commands(), []int{1, 1, 1, 1}; !slices.Equal(got, want) {
		t.Errorf("commands per pipeline = %v; want %v", got, want)
	}
	if got, err := admin.ScriptExists(bg, acquireScript.batch.sha.(string)).Result(); err != nil || !got[0] {
		t.Errorf("SCRIPT EXISTS of the batch script = %v, %v; want true", got, err)
	}
}

// acquireBehind queues asynchronous acquires of calls fresh keys (prefix
// and a number) behind the held pipeline whose acquire answers on first,
// lets it go, and waits until every acquire is granted.
func acquireBehind(t *testing.T, n *RedisNode, h *pipeHook, first <-chan error, prefix string, calls int) {
	t.Helper()
	done := make(chan error, calls)
	for i := range calls {
		n.acquireAsync(context.Background(), acquireArgs(fmt.Sprint(prefix, i), "t", time.Minute), "", func(ok bool, _ time.Duration, err error) {
			if err == nil && !ok {
				err = errors.New("not granted")
			}
			done <- err
		})
	}
	close(h.hold)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	for range calls {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
}

// TestBatchSource: the batch form of a script answers each call in order,
// and turns a call's Lua error or a non-number answer into that call's
// error reply.
func TestBatchSource(t *testing.T) {
	r := clustertest.Redis(t, 1, cluster.RedisOptions{})[0]
	c := redis.NewClient(&redis.Options{Addr: r.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	src := batchSource(`
if ARGV[1] == 'lua' then error('boom') end
if ARGV[1] == 'str' then return 'a string' end
if ARGV[1] == 'redis' then return redis.call('INCR', KEYS[1]) end
return tonumber(ARGV[1]) + #KEYS + 10 * #ARGV`)
	if err := c.Set(t.Context(), "text", "x", 0).Err(); err != nil {
		t.Fatal(err)
	}
	keys := []string{"a", "b", "c", "text", "e"}
	vals, err := c.Eval(t.Context(), src, keys, len(keys), 1, 1, "7", "lua", "str", "redis", "0").Slice()
	if err != nil {
		t.Fatal(err)
	}
	if len(vals) != 5 {
		t.Fatalf("answers = %v; want 5", vals)
	}
	if vals[0] != int64(18) || vals[4] != int64(11) {
		t.Errorf("answers 0 and 4 = %v, %v; want 18 and 11 (each call sees its own 1 key and 1 argument)", vals[0], vals[4])
	}
	for i, want := range map[int]string{1: "boom", 2: "not a number", 3: "not an integer"} {
		if e, ok := vals[i].(error); !ok || !strings.Contains(e.Error(), want) {
			t.Errorf("answer %d = %v; want an error with %q", i, vals[i], want)
		}
	}
}

// TestPipeline_GoneCallerNotSent: a call whose caller gave up while it was
// queued is dropped, not sent: a lock nobody waits for is never set.
func TestPipeline_GoneCallerNotSent(t *testing.T) {
	n, h, admin := realNode(t, RedisOptions{})
	h.hold, h.holding = make(chan struct{}), make(chan struct{})
	bg := context.Background()
	first := make(chan error, 1)
	go func() { _, _, err := n.Acquire(bg, "held", "t0", time.Minute, ""); first <- err }()
	<-h.holding
	ctx, cancel := context.WithCancel(bg)
	gone := make(chan error, 1)
	go func() { _, _, err := n.Acquire(ctx, "never", "t1", time.Minute, ""); gone <- err }()
	testutil.WaitFor(t, time.Minute, "the call queued", func() (bool, error) { return n.pipe.queued.Load() == 1, nil })
	cancel()
	if err := <-gone; !errors.Is(err, context.Canceled) {
		t.Fatalf("gone caller: %v; want context.Canceled", err)
	}
	close(h.hold)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	// A later call goes through the same writer, so the dropped one has been
	// dealt with by the time it answers.
	if _, err := n.TTL(bg, "x"); err != nil {
		t.Fatal(err)
	}
	if n, err := admin.Exists(bg, "never").Result(); err != nil || n != 0 {
		t.Fatalf("EXISTS never = %d, %v; want 0: a call was sent for a caller that had gone", n, err)
	}
	for _, size := range h.batches() {
		if size != 1 {
			t.Errorf("pipeline sizes = %v; want only the live calls, one at a time", h.batches())
			break
		}
	}
}

// TestPipeline_Close: Close answers queued calls with an error and returns;
// later calls fail at once.
func TestPipeline_Close(t *testing.T) {
	n, h, _ := realNode(t, RedisOptions{})
	h.hold, h.holding = make(chan struct{}), make(chan struct{})
	bg := context.Background()
	first := make(chan error, 1)
	go func() { _, _, err := n.Acquire(bg, "a", "t0", time.Minute, ""); first <- err }()
	<-h.holding
	queued := make(chan error, 1)
	go func() { _, _, err := n.Acquire(bg, "b", "t1", time.Minute, ""); queued <- err }()
	testutil.WaitFor(t, time.Minute, "the call queued", func() (bool, error) { return n.pipe.queued.Load() == 1, nil })
	closed := make(chan error, 1)
	go func() { closed <- n.Close() }()
	if err := <-queued; !errors.Is(err, errNodeClosed) {
		t.Fatalf("queued call: %v; want errNodeClosed", err)
	}
	close(h.hold)
	<-first // answered or failed by the closing client: either is fine
	<-closed
	if _, _, err := n.Acquire(bg, "c", "t2", time.Minute, ""); err == nil {
		t.Fatal("Acquire after Close succeeded")
	}
}

// TestPipeline_CloseWithFullQueue: close while the queue is full, callers
// wait for room and the writer's callbacks queue more (as a failed round's
// clean-up does) returns, and answers every call exactly once.
func TestPipeline_CloseWithFullQueue(t *testing.T) {
	n, h, _ := realNode(t, RedisOptions{})
	bg := context.Background()
	first := holdFirst(n, h) // the writer is stuck on the wire
	var blocked atomic.Int64
	n.pipe.blocking = func() { blocked.Add(1) }
	var answers atomic.Int64
	var twice atomic.Bool
	// The writer holds one call, the queue takes cap more, and the
	// enqueues of the rest wait for room, holding the read lock: more of
	// them than one batch takes off the queue.
	overflow := maxBatch + 2
	calls := 1 + cap(n.pipe.queue) + overflow
	for i := range calls {
		var once atomic.Bool
		n.releaseAsync(bg, releaseArgs(fmt.Sprint("k", i), "t"), func(bool, error) {
			if once.Swap(true) {
				twice.Store(true)
			}
			answers.Add(1)
			// On the writer: queue another call, as Locker.undo does.
			n.releaseAsync(bg, releaseArgs(fmt.Sprint("u", i), "t"), func(bool, error) { answers.Add(1) })
		})
	}
	testutil.WaitFor(t, time.Minute, "the enqueues waiting for room", func() (bool, error) {
		return blocked.Load() == int64(overflow), nil
	})
	closed := make(chan struct{})
	go func() { n.pipe.close(); close(closed) }()
	// Let the writer go only once close is under way: p.closed closed, or
	// close waiting for the write lock (new readers are then refused).
	testutil.WaitFor(t, time.Minute, "close under way", func() (bool, error) {
		select {
		case <-n.pipe.closed:
			return true, nil
		default:
		}
		if n.pipe.mu.TryRLock() {
			n.pipe.mu.RUnlock()
			return false, nil
		}
		return true, nil
	})
	close(h.hold)
	<-first
	<-closed // hung here when close took the lock before releasing the waiters
	// A call queued by a callback during close may find the queue full and
	// be answered by its own goroutine, just after close returns.
	testutil.WaitFor(t, time.Minute, "every call answered", func() (bool, error) {
		return answers.Load() == int64(2*calls), nil
	})
	if twice.Load() {
		t.Error("a call was answered twice")
	}
}

// TestPipeline_OverflowCallerGone: an asynchronous call that found the
// queue full waits for room on a goroutine of its own only while its caller
// waits: once its context ends it is answered with the context's error and
// its goroutine returns, even while the writer makes no room. (Found under
// load: 3,000 blocking acquires on distinct names overloaded the nodes, and
// 1.2 million such goroutines, their callers long gone, held 7 GiB.)
func TestPipeline_OverflowCallerGone(t *testing.T) {
	n, h, _ := realNode(t, RedisOptions{})
	bg := context.Background()
	first := holdFirst(n, h) // the writer is stuck on the wire
	var blocked atomic.Int64
	n.pipe.blocking = func() { blocked.Add(1) }
	// The writer holds one call and the queue takes cap more.
	for i := range 1 + cap(n.pipe.queue) {
		n.releaseAsync(bg, releaseArgs(fmt.Sprint("k", i), "t"), func(bool, error) {})
	}
	ctx, cancel := context.WithCancel(bg)
	const overflow = 8
	errs := make(chan error, overflow)
	for i := range overflow {
		n.releaseAsync(ctx, releaseArgs(fmt.Sprint("o", i), "t"), func(_ bool, err error) { errs <- err })
	}
	testutil.WaitFor(t, time.Minute, "the enqueues waiting for room", func() (bool, error) {
		return blocked.Load() >= overflow, nil // one more if a filler call overflowed before the writer took the first
	})
	cancel()
	for range overflow {
		select {
		case err := <-errs:
			if !errors.Is(err, context.Canceled) {
				t.Errorf("overflowing call of a caller gone: %v; want context.Canceled", err)
			}
		case <-time.After(time.Minute):
			// Its goroutine still waits for room that the stuck writer
			// does not make.
			t.Fatal("an overflowing call of a caller gone was not answered")
		}
	}
	if q := len(n.pipe.queue); q != cap(n.pipe.queue) {
		t.Errorf("queue holds %d calls; want %d: a call of a caller gone was queued", q, cap(n.pipe.queue))
	}
	close(h.hold)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
}

// TestPipeline_StoppedNode: calls to a node that stopped answering end at
// their own deadline, blocking or asynchronous (each answered once), and the
// node serves again once it resumes.
func TestPipeline_StoppedNode(t *testing.T) {
	for _, async := range []bool{false, true} {
		t.Run(fmt.Sprintf("async=%v", async), func(t *testing.T) {
			r := clustertest.Redis(t, 1, cluster.RedisOptions{})[0]
			n := NewRedisNode(r.Addr(), RedisOptions{})
			t.Cleanup(func() { _ = n.Close() })
			bg := context.Background()
			if _, err := n.TTL(bg, "x"); err != nil {
				t.Fatal(err)
			}
			if err := r.Pause(); err != nil {
				t.Fatal(err)
			}
			const calls = 10
			errs := make(chan error, 2*calls)
			for i := range calls {
				ctx, cancel := context.WithTimeout(bg, 50*time.Millisecond)
				defer cancel()
				key := fmt.Sprintf("k%d", i)
				if async {
					n.acquireAsync(ctx, acquireArgs(key, "t", time.Second), "", func(_ bool, _ time.Duration, err error) { errs <- err })
					continue
				}
				go func() { _, _, err := n.Acquire(ctx, key, "t", time.Second, ""); errs <- err }()
			}
			for range calls {
				err := <-errs
				var ne net.Error
				if !errors.Is(err, context.DeadlineExceeded) && !(errors.As(err, &ne) && ne.Timeout()) {
					t.Errorf("Acquire on a stopped node: %v; want a timeout", err)
				}
			}
			if err := r.Resume(); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(bg, 10*time.Second)
			defer cancel()
			if ok, _, err := n.Acquire(ctx, "after", "t", time.Second, ""); err != nil || !ok {
				t.Fatalf("Acquire after resume = %v, %v", ok, err)
			}
			if len(errs) != 0 {
				t.Errorf("%d extra answers: a call was answered twice", len(errs))
			}
		})
	}
}
