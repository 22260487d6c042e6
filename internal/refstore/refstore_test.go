package refstore

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

// TestCheckJSON checks what CheckJSON refuses: what Postgres's JSON
// functions, Unicode text or a double cannot hold (store's
// TestDB_PutResource/InvalidData writes to Postgres).
func TestCheckJSON(t *testing.T) {
	for _, tc := range []struct {
		data string
		ok   bool
	}{
		{`{"a":[1,"two",null,true]}`, true},
		{`"\u00e9\ud83d\ude00"`, true},
		{`"\\u0000 is text"`, true},
		{`"\\\ud83d\ude00"`, true},
		{`"\u0001"`, true},
		{`"\u0000"`, false},
		{`["x", "\u0000"]`, false},
		{"\"\xff\"", false},
		{`"\ud800"`, false},
		{`"\ud800x"`, false},
		{`"\ud800\n"`, false},
		{`"\ud800\ud800"`, false},
		{`"\udc00"`, false},
		{`"\ude00\ud83d"`, false},
		{`"\\\ud800"`, false},
		{`[0, -1, 1.5, 1e308, -1.7976931348623157e308, 1e-400, 123456789012345678901234567890]`, true},
		{`{"n": 1e309}`, false},
		{`[-1.8E+308]`, false},
		{`"1e309 in a string"`, true},
		{`{"1e999": "key"}`, true},
		{`"\"1e309"`, true},
		{"1" + strings.Repeat("0", 308), true},
		{"1" + strings.Repeat("0", 309), false},
		{"0." + strings.Repeat("0", 400) + "1", true},
		{"[0." + strings.Repeat("0", 10000) + "1e100000]", false},
		{"0." + strings.Repeat("0", 10000) + "1e10309", true},   // 1e308
		{"0." + strings.Repeat("0", 10000) + "18e10310", false}, // 1.8e308
		{"1.7976931348623157e308", true},
		{"1.7976931348623159e308", false},
		{"17976931348623157" + strings.Repeat("0", 292), true},
		{"-0.0e999999999999999999999", true},
		{"1e-99999999999999999999", true},
		{"12.5E+3", true},
		{"0.001e311", true},
		{"0.001e312", false},
	} {
		if !json.Valid([]byte(tc.data)) { // encoding/json lets invalid UTF-8 through
			t.Fatalf("%q is not valid JSON", tc.data)
		}
		data := []byte(tc.data)
		err := CheckJSON(data)
		if string(data) != tc.data {
			t.Errorf("CheckJSON(%q) changed its input to %q", tc.data, data)
		}
		if (err == nil) != tc.ok {
			t.Errorf("CheckJSON(%q) = %v; want ok %v", tc.data, err, tc.ok)
		}
		var de *DataError
		if err != nil && (!errors.Is(err, ErrInvalidData) || !errors.As(err, &de) || de.Reason == "") {
			t.Errorf("CheckJSON(%q) = %v; want a *DataError matching ErrInvalidData", tc.data, err)
		}
	}
}
