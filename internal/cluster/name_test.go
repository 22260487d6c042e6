package cluster

import (
	"strings"
	"testing"
)

func TestDatabaseName(t *testing.T) {
	long := strings.Repeat("TestVeryLong/Sub-Test_", 10)
	for _, tc := range []struct {
		name string
		seq  uint64
		want string
	}{
		{"TestFoo/Bar_baz", 1, "testfoo_bar_baz_1"},
		{"", 7, "db__7"},
		{"9lives", 2, "db_9lives_2"},
		{"Ünïcode", 3, "_n_code_3"},
	} {
		if got := databaseName(tc.name, tc.seq); got != tc.want {
			t.Errorf("databaseName(%q, %d) = %q; want %q", tc.name, tc.seq, got, tc.want)
		}
	}
	a, b := databaseName(long, 1), databaseName(long+"x", 1)
	if len(a) > 63 || len(b) > 63 {
		t.Errorf("len = %d, %d; want <= 63", len(a), len(b))
	}
	if a == b {
		t.Errorf("long names differing after the cut both map to %q", a)
	}
	if !strings.HasSuffix(a, "_1") {
		t.Errorf("databaseName(long, 1) = %q; want suffix _1", a)
	}
}
