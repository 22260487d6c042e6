package service

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
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

// BenchmarkLocker_RealRedis measures acquire+release cycles on 5 real
// redis-server processes (memory issuer): the cost of the node round trips,
// which the per-node pipelines batch (unpipelined: one round trip per
// command, the peer to compare with). parallel: 64 callers; serial: one, the
// latency of a cycle when nothing else is queued.
func BenchmarkLocker_RealRedis(b *testing.B) {
	rs := clustertest.Redis(b, 5, cluster.RedisOptions{})
	for _, parallel := range []bool{true, false} {
		for _, opts := range []RedisOptions{{Unpipelined: true}, {}} {
			name := map[bool]string{true: "parallel", false: "serial"}[parallel] + "/" +
				map[bool]string{true: "unpipelined", false: "pipelined"}[opts.Unpipelined]
			b.Run(name, func(b *testing.B) {
				var ns []Node
				for _, r := range rs {
					n := NewRedisNode(r.Addr(), opts)
					b.Cleanup(func() { _ = n.Close() })
					ns = append(ns, n)
				}
				l, err := New(ns, &memIssuer{}, Options{NodeTimeout: time.Second})
				if err != nil {
					b.Fatal(err)
				}
				var seq atomic.Int64
				cycle := func() {
					key := fmt.Sprintf("bench-%d", seq.Add(1))
					g, err := l.Acquire(context.Background(), key, Request{TTL: 10 * time.Second})
					if err == nil {
						err = l.Release(context.Background(), key, g.Token)
					}
					if err != nil {
						b.Fatal(err)
					}
				}
				b.ReportAllocs()
				if !parallel {
					for b.Loop() {
						cycle()
					}
					return
				}
				b.SetParallelism(32) // 64 callers on 2 CPUs
				b.ResetTimer()
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						cycle()
					}
				})
			})
		}
	}
}
