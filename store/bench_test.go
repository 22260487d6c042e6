package store

import (
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/redfence/redfence/fencing"
)

// BenchmarkDB_Issue measures durable token issuance (one statement and one
// synchronous commit per token) on a real Postgres, from parallel callers.
func BenchmarkDB_Issue(b *testing.B) {
	db, _ := newDB(b, Options{})
	var seq atomic.Int64
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			key := fmt.Sprintf("bench-%d", seq.Add(1)%64)
			if _, err := db.Issue(b.Context(), fencing.Claim{Key: key, Owner: "bench", Holder: "h"}); err != nil {
				b.Fatal(err)
			}
		}
	})
}
