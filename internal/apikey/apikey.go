// Package apikey is the API key model shared by the store package, which
// keeps keys in Postgres, and the api package, which authenticates requests
// with them: the key format, scopes, tenants and the stored form of a key.
// Both import this leaf so neither imports the other.
//
// An API key reads "rf_<id>_<secret>": the id is 16 hex digits (8 random
// bytes), public and safe to log; the secret is 32 random bytes in unpadded
// base64url (43 characters). Only the SHA-256 of the whole key is stored.
package apikey

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/redfence/redfence/internal/keyspace"
)

// Scopes: what a key may do.
const (
	// ScopeLocks allows acquiring, extending, releasing and reading locks.
	ScopeLocks = "locks"
	// ScopeResources allows reading and writing the reference store.
	ScopeResources = "resources"
	// ScopeAdmin allows the node view (/v1/nodes) and /metrics.
	ScopeAdmin = "admin"
)

// AllScopes returns every scope, in canonical order.
func AllScopes() []string { return []string{ScopeLocks, ScopeResources, ScopeAdmin} }

// DefaultScopes returns the scopes of a key created without any: locks and
// resources.
func DefaultScopes() []string { return []string{ScopeLocks, ScopeResources} }

const (
	// Prefix starts every API key, so secret scanners can find leaked ones.
	Prefix    = "rf_"
	idLen     = 16
	secretLen = 43
	// Len is the length of every API key.
	Len = len(Prefix) + idLen + 1 + secretLen
)

// ErrNotFound is returned when no API key has the given id.
var ErrNotFound = errors.New("apikey: no such key")

// Key is an API key as stored: never its secret, only the hash of the whole
// key.
type Key struct {
	// ID is the public part of the key.
	ID string
	// Tenant is the namespace of every lock and resource the key touches.
	Tenant string
	// Scopes are what the key may do, in canonical order.
	Scopes []string
	// CreatedAt is when the key was created.
	CreatedAt time.Time
	// RevokedAt is when the key was revoked; zero while it is active.
	RevokedAt time.Time
	// Hash is the SHA-256 of the whole key.
	Hash []byte
}

// Revoked reports whether the key was revoked.
func (k *Key) Revoked() bool { return !k.RevokedAt.IsZero() }

// HasScope reports whether the key carries scope.
func (k *Key) HasScope(scope string) bool { return slices.Contains(k.Scopes, scope) }

// Verify reports whether key is this API key, comparing hashes in constant
// time so that the time taken reveals nothing about the stored hash.
func (k *Key) Verify(key string) bool {
	return subtle.ConstantTimeCompare(Hash(key), k.Hash) == 1
}

// Change tells a watcher that an API key may have changed.
type Change struct {
	// ID is the key that changed; "" means any key may have changed (the
	// watch connection was (re)established, so notifications may have been
	// missed, or the table was truncated): drop everything cached.
	ID string
}

// Hash returns the SHA-256 of key.
//
// A fast hash is the right choice here, unlike for passwords: the secret is
// 256 bits from crypto/rand, so there is no dictionary or low-entropy space
// that a slow KDF (bcrypt, argon2) would protect; reversing SHA-256 of such a
// key is a 2^256 search either way. A fast hash lets every cache miss be
// checked in microseconds instead of costing tens of milliseconds of CPU that
// an unauthenticated client could make the server spend.
func Hash(key string) []byte {
	h := sha256.Sum256([]byte(key))
	return h[:]
}

// New returns a fresh API key and its id.
func New() (key, id string) {
	var b [8 + 32]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand, Go 1.24+)
	id = hex.EncodeToString(b[:8])
	return Prefix + id + "_" + base64.RawURLEncoding.EncodeToString(b[8:]), id
}

// ParseID returns the id of a well-formed API key, and false for anything
// that cannot be one. It looks at the form only: the key may still be
// unknown.
func ParseID(key string) (string, bool) {
	if len(key) != Len || !strings.HasPrefix(key, Prefix) || key[len(Prefix)+idLen] != '_' {
		return "", false
	}
	id := key[len(Prefix) : len(Prefix)+idLen]
	if !ValidID(id) {
		return "", false
	}
	for i := len(Prefix) + idLen + 1; i < len(key); i++ {
		if !secretChar(key[i]) {
			return "", false
		}
	}
	return id, true
}

// Redact returns s with the secret of every API key in it, whole or cut
// short, replaced by "[redacted]" (the id, which is not secret, stays to name
// the key), for text a client sent that is logged or echoed: a key pasted
// into a path or a field name by mistake. A key is cut short when its prefix
// and id are followed by "_" and fewer base64url characters than a secret
// has: what is left of the secret still gives most of it away. A key without
// its prefix, a key id, "_" and a whole secret (see HoldsBare), is the key
// too, the id being public: its secret is redacted as well. s is returned as
// is if it holds none.
func Redact(s string) string {
	return redactBare(redactPrefixed(s))
}

// redactPrefixed is Redact for the keys with their prefix.
func redactPrefixed(s string) string {
	if !strings.Contains(s, Prefix) {
		return s
	}
	var b strings.Builder
	found := false
	rest := s
	for {
		i := strings.Index(rest, Prefix)
		if i < 0 {
			break
		}
		head := i + len(Prefix) + idLen + 1 // past "rf_<id>_"
		if head < len(rest) && rest[head-1] == '_' && ValidID(rest[i+len(Prefix):head-1]) && secretChar(rest[head]) {
			n := 1
			for n < secretLen && head+n < len(rest) && secretChar(rest[head+n]) {
				n++
			}
			found = true
			b.WriteString(rest[:head])
			b.WriteString("[redacted]")
			rest = rest[head+n:]
			continue
		}
		b.WriteString(rest[:i+len(Prefix)])
		rest = rest[i+len(Prefix):]
	}
	if !found {
		return s
	}
	b.WriteString(rest)
	return b.String()
}

// redactBare is Redact for the keys without their prefix: a key id, "_"
// and a whole secret, of which the secret's length is redacted.
func redactBare(s string) string {
	if len(s) < idLen+1+secretLen || strings.IndexByte(s, '_') < 0 {
		return s
	}
	var b strings.Builder
	done := 0 // s[:done] is in b
	for i := 0; i+idLen+1+secretLen <= len(s); i++ {
		head := i + idLen + 1 // past "<id>_"
		if s[head-1] != '_' || !ValidID(s[i:head-1]) || !secretLike(s[head:]) {
			continue
		}
		b.WriteString(s[done:head])
		b.WriteString("[redacted]")
		done = head + secretLen
		i = done - 1
	}
	if done == 0 {
		return s
	}
	b.WriteString(s[done:])
	return b.String()
}

// secretChar reports whether c can be in a key's secret (base64url).
func secretChar(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_'
}

// HoldsBare reports whether s holds an API key without its prefix: a key
// id, "_" and a whole secret anywhere in s (the key with its constant
// "rf_" cut off), or s is a secret alone (43 characters of base64url). With
// the id, which is public (logged with every action), a secret alone is
// the key.
func HoldsBare(s string) bool {
	if len(s) == secretLen && secretRun(s) == secretLen {
		return true
	}
	for i := 0; i+idLen+1+secretLen <= len(s); i++ {
		if s[i+idLen] == '_' && ValidID(s[i:i+idLen]) && secretLike(s[i+idLen+1:]) {
			return true
		}
	}
	return false
}

// secretLike reports whether s starts with what a whole secret may be:
// secretLen characters a secret may hold, of which one at least is an
// upper-case letter. A real secret lacks one with odds of about 2e-10,
// while a lock name or owner such as "5f2b8c9d1e3a4b6c_invoice-job-..."
// (a hex id, "_" and a long lower-case run) is no key.
func secretLike(s string) bool {
	if secretRun(s) < secretLen {
		return false
	}
	return strings.ContainsFunc(s[:secretLen], func(r rune) bool { return r >= 'A' && r <= 'Z' })
}

// secretRun is the number of characters a secret may hold at the start of
// s.
func secretRun(s string) int {
	n := 0
	for n < len(s) && secretChar(s[n]) {
		n++
	}
	return n
}

// FindID returns the id of the first API key in s, whole or cut short: the
// first key prefix in s followed by a key id. ok is false if s holds none.
func FindID(s string) (id string, ok bool) {
	for rest := s; ; {
		i := strings.Index(rest, Prefix)
		if i < 0 {
			return "", false
		}
		rest = rest[i+len(Prefix):]
		if len(rest) >= idLen && ValidID(rest[:idLen]) {
			return rest[:idLen], true
		}
	}
}

// ValidID reports whether id can be the id of an API key: 16 lower-case hex
// digits.
func ValidID(id string) bool {
	if len(id) != idLen {
		return false
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// ParseScopes parses a comma-separated list of scopes ("locks,resources").
// It ignores spaces and repeats and returns the scopes in canonical order;
// an unknown or missing scope is an error.
func ParseScopes(list string) ([]string, error) {
	var out []string
	for s := range strings.SplitSeq(list, ",") {
		s = strings.TrimSpace(s)
		if err := checkScope(s); err != nil {
			return nil, err
		}
		if !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	return CanonicalScopes(out)
}

// CanonicalScopes returns scopes without repeats, in canonical order. An
// unknown scope, or none at all, is an error.
func CanonicalScopes(scopes []string) ([]string, error) {
	for _, s := range scopes {
		if err := checkScope(s); err != nil {
			return nil, err
		}
	}
	var out []string
	for _, s := range AllScopes() {
		if slices.Contains(scopes, s) {
			out = append(out, s)
		}
	}
	if len(out) == 0 {
		return nil, errors.New("apikey: an API key needs at least one scope")
	}
	return out, nil
}

func checkScope(s string) error {
	if !slices.Contains(AllScopes(), s) {
		return fmt.Errorf("apikey: unknown scope %q (want %s)", s, strings.Join(AllScopes(), ", "))
	}
	return nil
}

// ValidTenant reports why tenant cannot name a tenant, or "" when it can: 1
// to 200 characters of A-Z a-z 0-9 . _ - : (a keyspace namespace) that hold
// no API key, whole or cut short (an API key pasted into --tenant by
// mistake): the tenant is logged with every request of its keys and listed
// by redfence keys list.
func ValidTenant(tenant string) string {
	if tenant == "" {
		return "must not be empty"
	}
	if !keyspace.ValidNamespace(tenant) {
		return keyspace.ValidName(tenant)
	}
	if Redact(tenant) != tenant {
		return "must not hold an API key, whole or cut short (rf_, a key id, _ and part of the secret: the tenant is logged with every request)"
	}
	return ""
}
