package api

import (
	"net/http"
	"slices"
	"testing"
)

// TestParseEntityTags: "*" and lists of entity tags are read with only
// spaces and tabs around them (RFC 9110 §5.6.1's OWS); any other character,
// a Unicode space included, makes the field malformed (refused), never "*".
func TestParseEntityTags(t *testing.T) {
	for _, tc := range []struct {
		value        string
		bad, any     bool
		strong, weak []int64
	}{
		{value: "*", any: true},
		{value: " *\t", any: true},
		{value: "\u00a0*", bad: true},
		{value: "*\u00a0", bad: true},
		{value: "*\u2003", bad: true},
		{value: "\u0085*", bad: true},
		{value: `"1", W/"2"`, strong: []int64{1}, weak: []int64{2}},
		{value: "\t\"1\" ,\t\"2\" ", strong: []int64{1, 2}},
		{value: "\"1\",\u00a0\"2\"", bad: true},
		{value: "*, \"1\"", bad: true},
	} {
		h := http.Header{}
		h.Set("If-Match", tc.value)
		et, err := parseEntityTags(h, "If-Match")
		if tc.bad {
			if err == nil {
				t.Errorf("parseEntityTags(%q) = %+v; want it refused", tc.value, et)
			}
			continue
		}
		if err != nil || !et.present || et.any != tc.any || !slices.Equal(et.strong, tc.strong) || !slices.Equal(et.weak, tc.weak) {
			t.Errorf("parseEntityTags(%q) = %+v, %v; want any %v, strong %v, weak %v", tc.value, et, err, tc.any, tc.strong, tc.weak)
		}
	}
}
