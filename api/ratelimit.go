package api

import (
	"math"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// limiter keeps one token bucket per API key, so one key's burst never
// takes from another's. The zero rate (a nil *limiter) limits nothing.
type limiter struct {
	rate  rate.Limit
	burst int

	mu      sync.Mutex
	buckets map[string]*rate.Limiter
	swept   time.Time
}

// sweepEvery is how often idle buckets are dropped.
const sweepEvery = time.Minute

// newLimiter returns a limiter allowing r requests per second per key with
// bursts of burst (at least 1; the default is r rounded up), or nil when r
// is not positive.
func newLimiter(r rate.Limit, burst int) *limiter {
	if r <= 0 {
		return nil
	}
	if burst < 1 {
		burst = max(1, int(r+0.999))
	}
	return &limiter{rate: r, burst: burst, buckets: make(map[string]*rate.Limiter)}
}

// reserve takes a token from key's bucket at now. It returns 0 when the
// request may go ahead, or how long until it could (taking nothing).
func (l *limiter) reserve(key string, now time.Time) time.Duration {
	if l == nil {
		return 0
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.Sub(l.swept) >= sweepEvery {
		l.swept = now
		// A full bucket behaves exactly like a new one: dropping it changes
		// nothing but the memory it holds.
		for k, b := range l.buckets {
			if b.TokensAt(now) >= float64(l.burst) {
				delete(l.buckets, k)
			}
		}
	}
	b, ok := l.buckets[key]
	if !ok {
		b = rate.NewLimiter(l.rate, l.burst)
		l.buckets[key] = b
	}
	if b.AllowN(now, 1) {
		return 0
	}
	// What ReserveN(now, 1).DelayFrom(now) would say, without making the
	// reservation (and cancelling it): AllowN took nothing.
	return durationFromTokens(l.rate, 1-b.TokensAt(now))
}

// durationFromTokens is how long it takes to accumulate tokens at rate r,
// as package rate computes it.
func durationFromTokens(r rate.Limit, tokens float64) time.Duration {
	if r <= 0 {
		return rate.InfDuration
	}
	d := (tokens / float64(r)) * float64(time.Second)
	if d > float64(math.MaxInt64) {
		return rate.InfDuration
	}
	return time.Duration(d)
}
