package fencing

import (
	"errors"
	"math"
	"math/rand/v2"
	"net/http"
	"strconv"
	"sync"
	"testing"
)

func TestParse(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		in   string
		want Token
		err  error
	}{
		{"One", "1", 1, nil},
		{"Large", "123456789", 123456789, nil},
		{"Max", strconv.FormatInt(math.MaxInt64, 10), math.MaxInt64, nil},
		{"Spaces", "  42  ", 42, nil},
		{"TabNewline", "\t7\r\n", 7, nil},
		{"Empty", "", 0, ErrInvalid},
		{"OnlySpaces", " \t ", 0, ErrInvalid},
		{"Zero", "0", 0, ErrInvalid},
		{"Negative", "-1", 0, ErrInvalid},
		{"MinInt", strconv.FormatInt(math.MinInt64, 10), 0, ErrInvalid},
		{"Overflow", "9223372036854775808", 0, ErrInvalid},
		{"HugeOverflow", "99999999999999999999999999", 0, ErrInvalid},
		{"Letters", "abc", 0, ErrInvalid},
		{"TrailingJunk", "12abc", 0, ErrInvalid},
		{"InnerSpace", "1 2", 0, ErrInvalid},
		{"Decimal", "1.5", 0, ErrInvalid},
		{"Exponent", "1e3", 0, ErrInvalid},
		{"Hex", "0x10", 0, ErrInvalid},
		{"Plus", "+5", 0, ErrInvalid},
		{"Underscore", "1_000", 0, ErrInvalid},
		{"NonASCIIDigit", "\u0663", 0, ErrInvalid},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := Parse(tc.in)
			if tc.err != nil {
				if !errors.Is(err, tc.err) {
					t.Errorf("Parse(%q) = %d, %v; want error %v", tc.in, got, err, tc.err)
				}
				if got != 0 {
					t.Errorf("Parse(%q) token = %d on error; want 0", tc.in, got)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Errorf("Parse(%q) = %d, %v; want %d, nil", tc.in, got, err, tc.want)
			}
		})
	}
}

func TestToken(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		tok   Token
		str   string
		valid bool
	}{
		{0, "0", false},
		{-5, "-5", false},
		{1, "1", true},
		{math.MaxInt64, "9223372036854775807", true},
	} {
		t.Run(tc.str, func(t *testing.T) {
			t.Parallel()
			if got := tc.tok.String(); got != tc.str {
				t.Errorf("Token(%d).String() = %q; want %q", int64(tc.tok), got, tc.str)
			}
			if got := tc.tok.Valid(); got != tc.valid {
				t.Errorf("Token(%d).Valid() = %v; want %v", int64(tc.tok), got, tc.valid)
			}
		})
	}
}

func TestCheck(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		last, got Token
		err       error
	}{
		{"FirstEver", 0, 1, nil},
		{"Newer", 5, 6, nil},
		{"MuchNewer", 5, MaxToken, nil},
		// Above what Redfence issues: applied, it would refuse every real
		// token after it.
		{"AboveMaxToken", 5, MaxToken + 1, ErrInvalid},
		{"Int64Max", 0, math.MaxInt64, ErrInvalid},
		{"Equal", 5, 5, nil},
		{"Older", 5, 4, ErrStale},
		{"OlderByMuch", math.MaxInt64, 1, ErrStale},
		{"ZeroToken", 0, 0, ErrInvalid},
		{"ZeroTokenAfterApplied", 5, 0, ErrInvalid},
		{"NegativeToken", 0, -1, ErrInvalid},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			err := Check(tc.last, tc.got)
			if tc.err == nil {
				if err != nil {
					t.Errorf("Check(%d, %d) = %v; want nil", tc.last, tc.got, err)
				}
				return
			}
			if !errors.Is(err, tc.err) {
				t.Errorf("Check(%d, %d) = %v; want %v", tc.last, tc.got, err, tc.err)
			}
			other := ErrStale
			if tc.err == ErrStale {
				other = ErrInvalid
			}
			if errors.Is(err, other) {
				t.Errorf("Check(%d, %d) = %v; want it not to match %v", tc.last, tc.got, err, other)
			}
			var se *StaleError
			if isStale := errors.As(err, &se); isStale != (tc.err == ErrStale) {
				t.Errorf("Check(%d, %d) = %v: a *StaleError is %v; want %v", tc.last, tc.got, err, isStale, tc.err == ErrStale)
			} else if isStale && (se.Got != tc.got || se.Current != tc.last) {
				t.Errorf("Check(%d, %d): StaleError{Got: %d, Current: %d}; want Got %d, Current %d", tc.last, tc.got, se.Got, se.Current, tc.got, tc.last)
			}
		})
	}
}

func TestStaleError(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		err  *StaleError
		want string
	}{
		{&StaleError{Key: "orders", Got: 1, Current: 2}, `fencing: write "orders": token 1 is stale (newest is 2)`},
		{&StaleError{Key: "orders", Got: 3, Current: 2}, `fencing: write "orders": token 3 was never issued (newest is 2)`},
		{&StaleError{Got: 4, Current: 5}, `fencing: token 4 is stale (newest is 5)`},
	} {
		if got := tc.err.Error(); got != tc.want {
			t.Errorf("%#v.Error() = %q; want %q", tc.err, got, tc.want)
		}
		if !errors.Is(tc.err, ErrStale) {
			t.Errorf("%#v does not match ErrStale", tc.err)
		}
	}
}

func TestFromRequest(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		values []string
		want   Token
		err    error
	}{
		{"Good", []string{"17"}, 17, nil},
		{"Missing", nil, 0, ErrInvalid},
		{"Two", []string{"17", "18"}, 0, ErrInvalid},
		{"TwoEqual", []string{"17", "17"}, 0, ErrInvalid},
		{"Empty", []string{""}, 0, ErrInvalid},
		{"Junk", []string{"seventeen"}, 0, ErrInvalid},
		{"Zero", []string{"0"}, 0, ErrInvalid},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r, err := http.NewRequest(http.MethodPut, "http://example.com/doc", nil)
			if err != nil {
				t.Fatal(err)
			}
			for _, v := range tc.values {
				r.Header.Add(Header, v)
			}
			got, err := FromRequest(r)
			if tc.err != nil {
				if !errors.Is(err, tc.err) {
					t.Errorf("FromRequest(%s: %q) = %d, %v; want error %v", Header, tc.values, got, err, tc.err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Errorf("FromRequest(%s: %q) = %d, %v; want %d, nil", Header, tc.values, got, err, tc.want)
			}
		})
	}
}

func TestSetHeader(t *testing.T) {
	t.Parallel()
	for _, tok := range []Token{1, 42, math.MaxInt64} {
		t.Run(tok.String(), func(t *testing.T) {
			t.Parallel()
			r, err := http.NewRequest(http.MethodPut, "http://example.com/doc", nil)
			if err != nil {
				t.Fatal(err)
			}
			// SetHeader replaces what was there, so the request carries one value.
			r.Header.Add(Header, "999")
			r.Header.Add(Header, "1000")
			SetHeader(r.Header, tok)
			if got := r.Header.Values(Header); len(got) != 1 || got[0] != tok.String() {
				t.Errorf("%s after SetHeader(%d) = %q; want [%q]", Header, tok, got, tok.String())
			}
			got, err := FromRequest(r)
			if err != nil || got != tok {
				t.Errorf("FromRequest after SetHeader(%d) = %d, %v; want %d, nil", tok, got, err, tok)
			}
		})
	}
}

func TestGuard_Apply(t *testing.T) {
	t.Parallel()

	t.Run("WiderRange", func(t *testing.T) {
		t.Parallel()
		g := Guard{Max: math.MaxInt64} // an Issuer with a wider range
		if err := g.Apply("k", MaxToken+1, nil); err != nil {
			t.Errorf("Apply(MaxToken+1) with Max int64 = %v; want nil", err)
		}
		if err := g.Apply("k", MaxToken, nil); !errors.Is(err, ErrStale) {
			t.Errorf("Apply(MaxToken) after MaxToken+1 = %v; want ErrStale", err)
		}
		if err := CheckMax(0, math.MaxInt64, math.MaxInt64); err != nil {
			t.Errorf("CheckMax(0, max, max) = %v; want nil", err)
		}
		if err := CheckMax(0, 5, 0); err != nil {
			t.Errorf("CheckMax(0, 5, 0) = %v; want nil (0 is MaxToken)", err)
		}
		if err := CheckMax(0, MaxToken+1, 0); !errors.Is(err, ErrInvalid) {
			t.Errorf("CheckMax(0, MaxToken+1, 0) = %v; want ErrInvalid", err)
		}
	})

	t.Run("Sequence", func(t *testing.T) {
		t.Parallel()
		var g Guard // the zero Guard is ready to use
		writeErr := errors.New("disk full")
		ok := func() error { return nil }
		fail := func() error { return writeErr }
		for i, step := range []struct {
			key   string
			tok   Token
			write func() error
			err   error
			last  Token
		}{
			{"a", 3, ok, nil, 3},
			{"a", 3, ok, nil, 3},                   // same holder writes again
			{"a", 2, ok, ErrStale, 3},              // older
			{"a", 0, ok, ErrInvalid, 3},            // invalid
			{"a", MaxToken + 1, ok, ErrInvalid, 3}, // never issued
			{"a", 9, fail, writeErr, 3},            // failed write is not recorded
			{"a", 4, nil, nil, 4},                  // nil write only records
			{"b", 1, ok, nil, 1},                   // keys are independent
			{"a", 1, ok, ErrStale, 4},
		} {
			called := false
			write := step.write
			if write != nil {
				w := write
				write = func() error { called = true; return w() }
			}
			err := g.Apply(step.key, step.tok, write)
			if step.err == nil && err != nil || step.err != nil && !errors.Is(err, step.err) {
				t.Errorf("step %d: Apply(%q, %d) = %v; want %v", i, step.key, step.tok, err, step.err)
			}
			if se := (*StaleError)(nil); errors.As(err, &se) && (se.Key != step.key || se.Got != step.tok || se.Current != step.last) {
				t.Errorf("step %d: Apply(%q, %d) = %#v; want the key, the token and %d", i, step.key, step.tok, se, step.last)
			}
			if wantCalled := step.write != nil && (step.err == nil || step.err == writeErr); called != wantCalled {
				t.Errorf("step %d: Apply(%q, %d) called write = %v; want %v", i, step.key, step.tok, called, wantCalled)
			}
			if got := g.Last(step.key); got != step.last {
				t.Errorf("step %d: Last(%q) = %d; want %d", i, step.key, got, step.last)
			}
		}
		if got := g.Last("unknown"); got != 0 {
			t.Errorf("Last(unknown) = %d; want 0", got)
		}
	})

	t.Run("Concurrent", func(t *testing.T) {
		t.Parallel()
		const (
			workers  = 50
			perWork  = 20
			maxTok   = 100
			failBase = 1000 // tokens of failing writes; never accepted
			key      = "k"
		)
		var g Guard
		writeErr := errors.New("write failed")
		var order []Token // appended inside write, so in apply order
		type result struct {
			tok Token
			err error
		}
		results := make([][]result, workers)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for w := range workers {
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			wg.Go(func() {
				<-start
				for i := range perWork {
					// Tokens drift upwards with i, as a real issuer's do, with
					// overlap between workers so that many applies race.
					tok := Token(i*maxTok/perWork + rng.IntN(3*maxTok/perWork) + 1)
					failing := (w+i)%7 == 0
					if failing {
						tok = failBase + tok
					}
					err := g.Apply(key, tok, func() error {
						if failing {
							return writeErr
						}
						order = append(order, tok)
						return nil
					})
					results[w] = append(results[w], result{tok, err})
				}
			})
		}
		close(start)
		wg.Wait()

		var accepted, failed int
		var maxAccepted Token
		for w, rs := range results {
			for _, r := range rs {
				switch {
				case r.err == nil:
					accepted++
					if r.tok >= failBase {
						t.Errorf("worker %d: Apply(%d) with a failing write = nil; want the write error", w, r.tok)
					}
					maxAccepted = max(maxAccepted, r.tok)
				case errors.Is(r.err, writeErr):
					failed++
				case !errors.Is(r.err, ErrStale):
					t.Errorf("worker %d: Apply(%d) = %v; want nil, ErrStale or the write error", w, r.tok, r.err)
				}
			}
		}
		if accepted != len(order) {
			t.Errorf("accepted applies = %d; want %d, the number of writes recorded", accepted, len(order))
		}
		if accepted == 0 {
			t.Fatal("no apply was accepted; want at least the first")
		}
		for i := 1; i < len(order); i++ {
			if order[i] < order[i-1] {
				t.Fatalf("write #%d had token %d after a write with %d; want non-decreasing tokens in apply order", i, order[i], order[i-1])
			}
		}
		if got := g.Last(key); got != maxAccepted || got != order[len(order)-1] {
			t.Errorf("Last = %d; want %d, the largest accepted token (last written %d)", got, maxAccepted, order[len(order)-1])
		}
		t.Logf("%d accepted, %d failed writes, %d stale", accepted, failed, workers*perWork-accepted-failed)
	})
}

func FuzzParse(f *testing.F) {
	for _, s := range []string{
		"1", "42", " 7 ", "0", "-1", "", "abc", "1.5", "+3", "0x1f", "007",
		"9223372036854775807", "9223372036854775808", "\t\n12\r", "1 2", "\u0663",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		tok, err := Parse(s)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("Parse(%q) error = %v; want it to match ErrInvalid", s, err)
			}
			return
		}
		if !tok.Valid() {
			t.Errorf("Parse(%q) = %d, nil; want a valid token", s, tok)
		}
		again, err := Parse(tok.String())
		if err != nil || again != tok {
			t.Errorf("Parse(%q) = %d; Parse(%q) = %d, %v; want %d, nil", s, tok, tok.String(), again, err, tok)
		}
	})
}
