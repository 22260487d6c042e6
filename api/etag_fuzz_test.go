package api

import (
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// FuzzParseEntityTags: any If-Match value is either refused as
// invalid-request or parsed; a list made of tags for versions is parsed back
// to exactly those versions, strong and weak apart.
func FuzzParseEntityTags(f *testing.F) {
	for _, s := range []string{`"1"`, `W/"2"`, `"1", W/"2" ,"x"`, `*`, ` * `, `,"3",,`, `"`, `W/`, `"a b"`, `"1" "2"`, `1`, ``, "\"\x7f\""} {
		f.Add(s, uint64(3), uint64(7), true)
	}
	f.Fuzz(func(t *testing.T, value string, a, b uint64, weak bool) {
		h := http.Header{}
		h.Set("If-Match", value)
		et, err := parseEntityTags(h, "If-Match")
		if err != nil {
			if !strings.Contains(err.Error(), "If-Match") {
				t.Fatalf("refusal of %q does not name the field: %v", value, err)
			}
		} else if !et.present {
			t.Fatalf("%q parsed as absent", value)
		}
		for _, v := range append(et.strong, et.weak...) {
			if v <= 0 {
				t.Fatalf("%q parsed to version %d", value, v)
			}
		}
		// A list built from versions parses back to them.
		va, vb := int64(a%1e12)+1, int64(b%1e12)+1
		tag := strconv.Quote(strconv.FormatInt(vb, 10))
		if weak {
			tag = "W/" + tag
		}
		h.Set("If-Match", strconv.Quote(strconv.FormatInt(va, 10))+" , "+tag)
		et, err = parseEntityTags(h, "If-Match")
		wantStrong, wantWeak := []int64{va, vb}, []int64(nil)
		if weak {
			wantStrong, wantWeak = []int64{va}, []int64{vb}
		}
		if err != nil || !slices.Equal(et.strong, wantStrong) || !slices.Equal(et.weak, wantWeak) {
			t.Fatalf("built list %q = %+v, %v; want strong %v, weak %v", h.Get("If-Match"), et, err, wantStrong, wantWeak)
		}
	})
}
