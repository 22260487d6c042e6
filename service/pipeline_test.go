package service

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
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
	sizes   []int
	hold    chan struct{} // closed to let the held pipeline go
	holding chan struct{} // closed once the first pipeline is held
}

func (h *pipeHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *pipeHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return next
}

func (h *pipeHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.mu.Lock()
		h.sizes = append(h.sizes, len(cmds))
		first := len(h.sizes) == 1
		h.mu.Unlock()
		if first && h.hold != nil {
			close(h.holding)
			<-h.hold
		}
		return next(ctx, cmds)
	}
}

func (h *pipeHook) batches() []int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]int(nil), h.sizes...)
}

func realNode(t *testing.T, opts RedisOptions) (*RedisNode, *pipeHook, *redis.Client) {
	t.Helper()
	r := clustertest.Redis(t, 1, cluster.RedisOptions{})[0]
	n := NewRedisNode(r.Addr(), opts)
	t.Cleanup(func() { _ = n.Close() })
	// Connected, and the node knows the acquire script (a first EVALSHA
	// would be answered NOSCRIPT and resent as EVAL).
	if _, _, err := n.Acquire(t.Context(), "warm-up", "w", time.Second, ""); err != nil {
		t.Fatal(err)
	}
	h := &pipeHook{}
	n.client.AddHook(h)
	admin := redis.NewClient(&redis.Options{Addr: r.Addr()})
	t.Cleanup(func() { _ = admin.Close() })
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
