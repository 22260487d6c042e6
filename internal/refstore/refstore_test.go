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
// halfway is (2^54-1)·2^970, halfway between the largest double and 2^1024:
// it rounds to infinity (to even), anything below it to the largest double.
const halfway = "179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497792"

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
		// Halfway between the largest double and 2^1024 rounds to
		// infinity; the digits past the 40th decide either side of it.
		{"1.7976931348623158079372897140530341507999e308", false},
		{"1.79769313486231580793728971405303415079933e308", true},
		{halfway, false},
		{halfway[:len(halfway)-1] + "1", true},
		{"-" + halfway, false},
		{halfway + ".0000000000000000000000000000000000000000000001", false},
		{"0.0" + halfway + "e310", false},
		{"0.0" + halfway[:len(halfway)-1] + "1e310", true},
		// Nesting: MaxDepth levels, not one more; brackets in strings
		// and keys are text.
		{strings.Repeat("[", MaxDepth) + strings.Repeat("]", MaxDepth), true},
		{strings.Repeat("[", MaxDepth+1) + strings.Repeat("]", MaxDepth+1), false},
		{strings.Repeat(`{"a":`, MaxDepth) + "1" + strings.Repeat("}", MaxDepth), true},
		{strings.Repeat(`{"a":`, MaxDepth+1) + "1" + strings.Repeat("}", MaxDepth+1), false},
		{strings.Repeat("[[],", MaxDepth-1) + "1" + strings.Repeat("]", MaxDepth-1), true},
		{`{"[[[[": "` + strings.Repeat("[{", 200) + `"}`, true},
		{strings.Repeat("[", MaxDepth) + `"]]]\"]]"` + strings.Repeat("]", MaxDepth), true},
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
