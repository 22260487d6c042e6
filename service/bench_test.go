package service

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"
)

// BenchmarkLocker_AcquireRelease measures the quorum round and its
// bookkeeping on in-memory nodes (no network): the algorithm's own cost.
func BenchmarkLocker_AcquireRelease(b *testing.B) {
	for _, n := range []int{1, 3, 5} {
		b.Run(fmt.Sprintf("nodes=%d", n), func(b *testing.B) {
			ns, ms := nodes(n)
			for _, m := range ms {
				m.acquired = nil // nobody waits for stragglers here
			}
			l, err := New(ns, &memIssuer{}, Options{})
			if err != nil {
				b.Fatal(err)
			}
			ctx := context.Background()
			var seq atomic.Int64
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					key := fmt.Sprintf("k%d", seq.Add(1))
					g, err := l.Acquire(ctx, key, Request{TTL: time.Second})
					if err != nil {
						b.Fatal(err)
					}
					if err := l.Release(ctx, key, g.Token); err != nil {
						b.Fatal(err)
					}
				}
			})
		})
	}
}
