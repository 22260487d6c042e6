package keyspace

import (
	"strings"
	"testing"
)

func TestValidName(t *testing.T) {
	tests := []struct {
		name string
		ok   bool
	}{
		{"a", true},
		{"orders:42", true},
		{"A-Z_a.z:0-9", true},
		{strings.Repeat("x", 200), true},
		{"", false},
		{strings.Repeat("x", 201), false},
		{"a/b", false},
		{"a b", false},
		{"é", false},
		{"a\x00", false},
		{"%2F", false},
		{".", false},
		{"..", false},
		{"...", true},
	}
	for _, tt := range tests {
		if got := ValidName(tt.name) == ""; got != tt.ok {
			t.Errorf("ValidName(%q) ok = %v; want %v", tt.name, got, tt.ok)
		}
	}
}

// TestValidName_Reason: the reason names the offending character as the
// client wrote it (a whole UTF-8 character, not its first byte), before any
// length (in characters).
func TestValidName_Reason(t *testing.T) {
	for _, tt := range []struct{ name, want string }{
		{"order!", `character '!' at offset 5 is not allowed`},
		{"café", `character 'é' at offset 3 is not allowed`},
		{"a\xffb", "character '\ufffd' at offset 1 is not allowed"}, // not UTF-8
		// 150 characters, 300 bytes: the character, not a length in bytes
		// called characters.
		{strings.Repeat("é", 150), `character 'é' at offset 0 is not allowed`},
		{strings.Repeat("x", 201), "must be at most 200 characters, got 201"},
	} {
		if got := ValidName(tt.name); !strings.HasPrefix(got, tt.want) {
			t.Errorf("ValidName(%q) = %q; want it to start with %q", tt.name, got, tt.want)
		}
	}
}

func TestKey(t *testing.T) {
	if got := RedisKey(Key("", "orders")); got != "redfence:lock:orders" {
		t.Errorf("RedisKey(Key(\"\", orders)) = %q; want redfence:lock:orders", got)
	}
	if got := Key("team-a", "orders"); got != "team-a/orders" {
		t.Errorf("Key(team-a, orders) = %q; want team-a/orders", got)
	}
}

// FuzzKey checks that distinct valid (namespace, name) pairs never share a key.
func FuzzKey(f *testing.F) {
	f.Add("", "a", "a", "")
	f.Add("a", "b", "", "a/b")
	f.Add("x:y", "z", "x", "y:z")
	f.Fuzz(func(t *testing.T, ns1, n1, ns2, n2 string) {
		if !ValidNamespace(ns1) || !ValidNamespace(ns2) || ValidName(n1) != "" || ValidName(n2) != "" {
			return
		}
		if ns1 == ns2 && n1 == n2 {
			return
		}
		if Key(ns1, n1) == Key(ns2, n2) {
			t.Fatalf("Key(%q,%q) == Key(%q,%q) == %q", ns1, n1, ns2, n2, Key(ns1, n1))
		}
	})
}

// FuzzValidName checks that accepted names are exactly 1-200 bytes of the
// documented alphabet, and that accepted names and their keys round-trip.
func FuzzValidName(f *testing.F) {
	for _, s := range []string{"a", "orders:42", "", ".", "..", "a/b", "é", strings.Repeat("x", 201), "A-Z_a.z:0-9"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		if ValidName(name) != "" {
			return
		}
		if len(name) < 1 || len(name) > MaxNameLen || name == "." || name == ".." {
			t.Fatalf("ValidName accepted %q (length %d)", name, len(name))
		}
		for i := 0; i < len(name); i++ {
			if !nameByte(name[i]) {
				t.Fatalf("ValidName accepted %q with byte %q", name, name[i])
			}
		}
		if got := RedisKey(Key("", name)); got != RedisPrefix+name {
			t.Fatalf("RedisKey(Key(%q)) = %q", name, got)
		}
	})
}
