package store

import (
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/redfence/redfence/fencing"
)

// BenchmarkDB_Issue measures durable token issuance on a real Postgres from
// parallel callers spread over 64 keys. claims/stmt is the mean batch size
// (concurrent claims share one statement and one commit).
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
	reportBatching(b, db)
}

// BenchmarkDB_IssueDistinctKeys measures issuance from 16 callers per CPU,
// each on a key of its own, so concurrent claims never share a key.
func BenchmarkDB_IssueDistinctKeys(b *testing.B) {
	db, _ := newDB(b, Options{})
	var seq atomic.Int64
	b.ReportAllocs()
	b.SetParallelism(16)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		claim := fencing.Claim{Key: fmt.Sprintf("bench-%d", seq.Add(1)), Owner: "bench", Holder: "h"}
		for pb.Next() {
			if _, err := db.Issue(b.Context(), claim); err != nil {
				b.Fatal(err)
			}
		}
	})
	reportBatching(b, db)
}

// BenchmarkDB_IssueSerial measures the latency of a lone caller, which
// batching must not add to.
func BenchmarkDB_IssueSerial(b *testing.B) {
	db, _ := newDB(b, Options{})
	b.ReportAllocs()
	for b.Loop() {
		if _, err := db.Issue(b.Context(), fencing.Claim{Key: "serial", Owner: "bench", Holder: "h"}); err != nil {
			b.Fatal(err)
		}
	}
	reportBatching(b, db)
}

// reportBatching reports the mean number of claims per issuance statement.
func reportBatching(b *testing.B, db *DB) {
	b.Helper()
	if st := db.issuer.statements.Load(); st > 0 {
		b.ReportMetric(float64(db.issuer.claims.Load())/float64(st), "claims/stmt")
	}
}

// BenchmarkDB_SpeculateSerial measures a lone speculative issuance: the
// conditional statement, then its confirmation (a read pipelined behind the
// commit), on one connection. Against BenchmarkDB_IssueSerial it shows what
// the confirmation adds when nothing overlaps the commit; in an acquire the
// commit overlaps the Redis round.
func BenchmarkDB_SpeculateSerial(b *testing.B) {
	db, _ := newDB(b, Options{})
	b.ReportAllocs()
	var last fencing.Token
	for b.Loop() {
		s, err := db.Speculate(b.Context(), fencing.Claim{Key: "serial", Owner: "bench", Holder: "h"}, last)
		if err != nil {
			b.Fatal(err)
		}
		if last, err = s.Confirm(b.Context()); err != nil {
			b.Fatal(err)
		}
	}
}
