package apikey

import (
	"slices"
	"strings"
	"testing"
)

func TestParseID(t *testing.T) {
	t.Parallel()
	const id = "0123456789abcdef"
	secret := strings.Repeat("Ab-_9", 8) + "xyz" // 43 base64url characters
	for _, tc := range []struct {
		name, key string
		ok        bool
	}{
		{"Valid", Prefix + id + "_" + secret, true},
		{"Empty", "", false},
		{"WrongPrefix", "rk_" + id + "_" + secret, false},
		{"UpperCaseID", Prefix + strings.ToUpper(id) + "_" + secret, false},
		{"ShortID", Prefix + id[1:] + "_" + secret + "x", false},
		{"NoSeparator", Prefix + id + "-" + secret, false},
		{"ShortSecret", Prefix + id + "_" + secret[1:], false},
		{"LongSecret", Prefix + id + "_" + secret + "x", false},
		{"PaddedSecret", Prefix + id + "_" + secret[1:] + "=", false},
		{"SpaceInSecret", Prefix + id + "_" + secret[1:] + " ", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := ParseID(tc.key)
			if ok != tc.ok || (ok && got != id) {
				t.Errorf("ParseID(%q) = %q, %v; want %q, %v", tc.key, got, ok, id, tc.ok)
			}
		})
	}
	key, kid := New()
	if got, ok := ParseID(key); !ok || got != kid || len(key) != Len {
		t.Errorf("ParseID(New() = %q) = %q, %v; want %q, true, length %d", key, got, ok, kid, Len)
	}
}

func FuzzParseID(f *testing.F) {
	key, _ := New()
	f.Add(key)
	f.Add("rf_0123456789abcdef_")
	f.Add("")
	f.Fuzz(func(t *testing.T, s string) {
		id, ok := ParseID(s)
		if !ok {
			return
		}
		if len(s) != Len || !strings.HasPrefix(s, Prefix+id+"_") || !ValidID(id) {
			t.Errorf("ParseID(%q) = %q, true for a key not of the form rf_<16 hex>_<43 base64url>", s, id)
		}
	})
}

func TestParseScopes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   string
		want []string // nil: an error
	}{
		{"locks", []string{"locks"}},
		{"admin,locks", []string{"locks", "admin"}},
		{" resources , locks,locks ", []string{"locks", "resources"}},
		{"locks,resources,admin", AllScopes()},
		{"", nil},
		{"locks,", nil},
		{"lock", nil},
		{"LOCKS", nil},
	} {
		got, err := ParseScopes(tc.in)
		checkScopes(t, "ParseScopes", tc.in, got, err, tc.want)
	}
}

func TestCanonicalScopes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   []string
		want []string // nil: an error
	}{
		{[]string{ScopeAdmin, ScopeLocks, ScopeAdmin}, []string{ScopeLocks, ScopeAdmin}},
		{AllScopes(), AllScopes()},
		{nil, nil},
		{[]string{ScopeLocks, "root"}, nil},
	} {
		got, err := CanonicalScopes(tc.in)
		checkScopes(t, "CanonicalScopes", tc.in, got, err, tc.want)
	}
}

// checkScopes checks what fn(in) returned against want (nil: an error).
func checkScopes(t *testing.T, fn string, in any, got []string, err error, want []string) {
	t.Helper()
	switch {
	case want == nil && err == nil:
		t.Errorf("%s(%q) = %v; want an error", fn, in, got)
	case want != nil && (err != nil || !slices.Equal(got, want)):
		t.Errorf("%s(%q) = %v, %v; want %v", fn, in, got, err, want)
	}
}

func TestKey(t *testing.T) {
	t.Parallel()
	key, id := New()
	other, _ := New()
	k := &Key{ID: id, Tenant: "acme", Scopes: DefaultScopes(), Hash: Hash(key)}
	if !k.Verify(key) {
		t.Errorf("Verify(the key) = false")
	}
	for _, bad := range []string{other, "", key[:len(key)-1], key + "x"} {
		if k.Verify(bad) {
			t.Errorf("Verify(%q) = true for another key", bad)
		}
	}
	if !k.HasScope(ScopeLocks) || k.HasScope(ScopeAdmin) {
		t.Errorf("HasScope: locks %v, admin %v; want true, false", k.HasScope(ScopeLocks), k.HasScope(ScopeAdmin))
	}
	if k.Revoked() {
		t.Errorf("Revoked() = true for a key without RevokedAt")
	}
}

func TestValidTenant(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"acme", "a.b-c_d:e", strings.Repeat("t", 200)} {
		if reason := ValidTenant(ok); reason != "" {
			t.Errorf("ValidTenant(%q) = %q; want \"\"", ok, reason)
		}
	}
	key, _ := New()
	for _, bad := range []string{"", "a/b", "..", strings.Repeat("t", 201), "a b", key, key[:Len-10], "t-" + key} {
		if ValidTenant(bad) == "" {
			t.Errorf("ValidTenant(%q) = \"\"; want a reason", bad)
		}
	}
}

func TestRedact(t *testing.T) {
	key, id := New()
	key2, id2 := New()
	for _, tc := range []struct{ in, want string }{
		{"", ""},
		{"/v1/locks/orders", "/v1/locks/orders"},
		{"rf_", "rf_"},
		{"rf_short", "rf_short"},
		{key, Prefix + id + "_[redacted]"},
		{"/v1/locks/" + key, "/v1/locks/" + Prefix + id + "_[redacted]"},
		{`"` + key + `x"`, `"` + Prefix + id + `_[redacted]x"`},
		{"rf_rf_" + key + "/" + key2, "rf_rf_" + Prefix + id + "_[redacted]/" + Prefix + id2 + "_[redacted]"},
		{key[:Len-1], Prefix + id + "_[redacted]"}, // cut short: most of the secret
		{key[:len(Prefix)+idLen+2] + " x", Prefix + id + "_[redacted] x"},
		{key + "tail", Prefix + id + "_[redacted]tail"}, // at most a secret's length
		{Prefix + id, Prefix + id},                      // no secret: the id is public
		{Prefix + id + "_", Prefix + id + "_"},
		{Prefix + id + "_ x", Prefix + id + "_ x"},
		{"rf_0123456789ABCDEF_abc", "rf_0123456789ABCDEF_abc"}, // not a key id
		// Without its prefix: a key id, _ and a whole secret.
		{key[len(Prefix):], id + "_[redacted]"},
		{"/v1/locks/x" + key[len(Prefix):] + "/y", "/v1/locks/x" + id + "_[redacted]/y"},
		{key[len(Prefix) : Len-1], key[len(Prefix) : Len-1]}, // cut short, without the prefix: not told apart
		// A hex id, "_" and a long run without an upper-case letter: a
		// lock name, not a key (nearly every secret holds one).
		{"orders:5f2b8c9d1e3a4b6c_customer-invoice-processing-job-2024-06-01-batch", "orders:5f2b8c9d1e3a4b6c_customer-invoice-processing-job-2024-06-01-batch"},
	} {
		if got := Redact(tc.in); got != tc.want {
			t.Errorf("Redact(%q) = %q; want %q", tc.in, got, tc.want)
		}
	}
}

func TestFindID(t *testing.T) {
	key, id := New()
	for _, tc := range []struct{ in, want string }{
		{"", ""},
		{"perf_1", ""},
		{"rf_", ""},
		{"rf_0123456789abcde", ""}, // 15 hex digits: no key id
		{"rf_0123456789ABCDEF", ""},
		{"rf_0123456789abcdef", "0123456789abcdef"},
		{key, id},
		{"x" + key, id},
		{"req." + key[:Len-10], id},
		{"rf_rf_" + key[3:], id},
	} {
		got, ok := FindID(tc.in)
		if got != tc.want || ok != (tc.want != "") {
			t.Errorf("FindID(%q) = %q, %v; want %q", tc.in, got, ok, tc.want)
		}
	}
}

// TestHoldsBare: a key without its prefix is found anywhere in s; a hex id,
// "_" and a long run without an upper-case letter (a lock name or a
// request ID of some other system) is not a key.
func TestHoldsBare(t *testing.T) {
	key, _ := New()
	bare := key[len(Prefix):]
	for _, s := range []string{bare, "req-" + bare + "-1", bare[len(bare)-secretLen:]} {
		if !HoldsBare(s) {
			t.Errorf("HoldsBare(%q) = false; want true", s)
		}
	}
	for _, s := range []string{"5f2b8c9d1e3a4b6c_customer-invoice-processing-job-2024-06-01-batch", bare[:len(bare)-1], "short"} {
		if HoldsBare(s) {
			t.Errorf("HoldsBare(%q) = true; want false", s)
		}
	}
}
