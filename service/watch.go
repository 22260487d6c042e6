package service

import (
	"context"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/redfence/redfence/internal/keyspace"
)

// ReleaseWatcher is implemented by nodes that announce releases (RedisNode
// does, through Redis Pub/Sub). A Locker watches the locks it has waiters
// for, so a release made by another server wakes them at once instead of at
// their next retry.
type ReleaseWatcher interface {
	// WatchReleases starts (on) or stops (off) announcing releases of the
	// lock with Redis key rkey. It must not block: the subscription is made
	// in the background, and announcements made before it is in place are
	// missed (waiters still retry on their own).
	WatchReleases(rkey string, on bool)
	// OnRelease sets the function called with the Redis key and the token
	// digest of every release announced on a watched lock. It is set once,
	// before the first WatchReleases.
	OnRelease(fn func(rkey, digest string))
}

var _ ReleaseWatcher = (*RedisNode)(nil)

// releasedChannel is the channel the release script announces rkey's
// releases on.
func releasedChannel(rkey string) string {
	return keyspace.ReleasedPrefix + strings.TrimPrefix(rkey, keyspace.RedisPrefix)
}

// watcher keeps a Pub/Sub connection to one node subscribed to the channels
// of the locks watched. One goroutine applies the changes in order and
// delivers the messages; it runs (and holds the connection) only while
// something is watched.
type watcher struct {
	client  *redis.Client
	timeout time.Duration

	mu      sync.Mutex
	fn      func(rkey, digest string)
	want    map[string]bool // channel -> subscribe (true) or unsubscribe
	kick    chan struct{}
	running chan struct{} // closed when the running goroutine ends; nil if none
	closed  bool
	stop    chan struct{}
	once    sync.Once
}

func newWatcher(client *redis.Client, timeout time.Duration) *watcher {
	return &watcher{client: client, timeout: timeout, want: map[string]bool{}, kick: make(chan struct{}, 1), stop: make(chan struct{})}
}

// OnRelease implements ReleaseWatcher.
func (n *RedisNode) OnRelease(fn func(rkey, digest string)) {
	n.watch.mu.Lock()
	n.watch.fn = fn
	n.watch.mu.Unlock()
}

// WatchReleases implements ReleaseWatcher.
func (n *RedisNode) WatchReleases(rkey string, on bool) {
	w := n.watch
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return
	}
	w.want[releasedChannel(rkey)] = on
	if w.running == nil {
		if !on {
			delete(w.want, releasedChannel(rkey)) // nothing is subscribed
			w.mu.Unlock()
			return
		}
		done := make(chan struct{})
		w.running = done
		go w.run(done)
	}
	w.mu.Unlock()
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

func (w *watcher) close() {
	w.once.Do(func() {
		w.mu.Lock()
		w.closed = true
		done := w.running
		w.mu.Unlock()
		close(w.stop)
		if done != nil {
			<-done
		}
	})
}

// run applies the wanted subscriptions and delivers messages until nothing
// is subscribed or the node is closed. go-redis reconnects a broken Pub/Sub
// connection and subscribes again to every channel it had.
func (w *watcher) run(done chan struct{}) {
	defer close(done)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ps := w.client.Subscribe(ctx)
	defer ps.Close()
	msgs := ps.Channel(redis.WithChannelSize(1024))
	subscribed := map[string]bool{}
	for {
		select {
		case <-w.stop:
			return
		case m := <-msgs:
			w.mu.Lock()
			fn := w.fn
			w.mu.Unlock()
			if fn != nil && strings.HasPrefix(m.Channel, keyspace.ReleasedPrefix) {
				fn(keyspace.RedisPrefix+strings.TrimPrefix(m.Channel, keyspace.ReleasedPrefix), m.Payload)
			}
		case <-w.kick:
			w.mu.Lock()
			var sub, unsub []string
			for ch, on := range w.want {
				if on && !subscribed[ch] {
					sub = append(sub, ch)
					subscribed[ch] = true
				} else if !on && subscribed[ch] {
					unsub = append(unsub, ch)
					delete(subscribed, ch)
				}
			}
			clear(w.want)
			if len(subscribed) == 0 {
				// Nothing left to watch: end, and let the next watch
				// start afresh.
				w.running = nil
				w.mu.Unlock()
				return
			}
			w.mu.Unlock()
			w.apply(ctx, ps, sub, unsub)
		}
	}
}
func (w *watcher) apply(ctx context.Context, ps *redis.PubSub, sub, unsub []string) {
	ctx, cancel := context.WithTimeout(ctx, w.timeout)
	defer cancel()
	if len(unsub) > 0 {
		_ = ps.Unsubscribe(ctx, unsub...)
	}
	if len(sub) > 0 {
		// On failure the waiters fall back to their retries; go-redis
		// subscribes again on reconnect to the channels it recorded.
		_ = ps.Subscribe(ctx, sub...)
	}
}
