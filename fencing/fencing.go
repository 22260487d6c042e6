// Package fencing defines fencing tokens and the check a storage layer applies
// to them.
//
// A fencing token is an integer issued with every lock grant. For one lock name
// it strictly increases and is never reused, so a storage layer that remembers
// the newest token it has seen can refuse a write from a holder whose lease
// expired while it was paused (GC, swap, VM migration) and who does not know it.
//
// What this package guarantees: Check and Guard implement the textbook rule
// "accept a token only if it is at least as new as the last one applied".
// What it does not: that rule alone cannot stop a lost update in a
// read-modify-write workload when the storage layer cannot see the issuer. A
// holder with token 33 that pauses, while the holder of 34 reads but has not yet
// written, can still write with 33 (nothing newer was applied yet), and the
// holder of 34 then overwrites it with a change based on its older read. Storage
// layers that need to close that window either compare against the last token
// issued (as Redfence's reference store does, sharing Postgres with the issuer)
// or add a version compare-and-set to their read-modify-write.
package fencing

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Token is a fencing token. Valid tokens start at 1; the zero value means "no
// token" (nothing was ever issued).
type Token int64

// String formats the token in decimal.
func (t Token) String() string { return strconv.FormatInt(int64(t), 10) }

// MaxToken is the largest token Redfence's service issues, 2^53-1: every
// JSON parser holds it exactly, JavaScript's (which reads numbers as
// doubles) included. Check, Guard and Require refuse larger tokens unless
// given a larger maximum (CheckMax, Guard.Max, RequireOptions.Max): an
// Issuer may have a larger range. Valid accepts any positive token.
const MaxToken Token = 1<<53 - 1

// Valid reports whether t could have been issued (t >= 1).
func (t Token) Valid() bool { return t >= 1 }

// Header is the HTTP request header that carries a fencing token to a storage
// layer.
const Header = "Fencing-Token"

// ErrStale is returned when a token is older than one already applied.
var ErrStale = errors.New("fencing: stale token")

// StaleError reports a write refused because its token is older than the
// newest one known for the key (or, for a store that compares against the
// issuer, newer than any issued). It matches ErrStale; Current tells the
// writer which token it lost to.
type StaleError struct {
	// Key is what the write was for; empty when the refusing check does not
	// know it.
	Key string
	// Got is the token the write carried.
	Got Token
	// Current is the newest token applied or issued for Key (0 if none).
	Current Token
}

func (e *StaleError) Error() string {
	var b strings.Builder
	b.WriteString("fencing: ")
	if e.Key != "" {
		fmt.Fprintf(&b, "write %q: ", e.Key)
	}
	if e.Got > e.Current {
		fmt.Fprintf(&b, "token %d was never issued (newest is %d)", e.Got, e.Current)
	} else {
		fmt.Fprintf(&b, "token %d is stale (newest is %d)", e.Got, e.Current)
	}
	return b.String()
}

// Unwrap returns ErrStale.
func (e *StaleError) Unwrap() error { return ErrStale }

// ErrExhausted is returned (wrapped) by an issuer asked for a token past
// MaxToken: the name has been issued the last token there is, and can be
// granted no more.
var ErrExhausted = errors.New("fencing: the name's fencing tokens are exhausted (2^53-1 issued)")

// ErrInvalid is returned when a token is missing or malformed.
var ErrInvalid = errors.New("fencing: invalid token")

// Claim describes the grant a token is issued for.
type Claim struct {
	// Key identifies the lock (see internal/keyspace); tokens increase per Key.
	Key string
	// Owner is the free-form owner label the client supplied; may be empty.
	Owner string
	// Holder is an opaque, non-secret digest of the holder's lock token, recorded
	// so that the grant can later be recognised (for example on extend).
	Holder string
}

// Issuer issues fencing tokens.
type Issuer interface {
	// Issue returns a token larger than every token issued before for c.Key.
	// The token is durably recorded before Issue returns; on error no token
	// may be assumed issued or not issued, and the caller must not grant.
	Issue(ctx context.Context, c Claim) (Token, error)
}

// ErrNotConfirmed is returned (wrapped) by Speculation.Confirm when the
// speculative token cannot be granted: it was not issued (the newest token
// was not the one expected) or a newer token was issued since. The caller
// then issues a token the ordinary way.
var ErrNotConfirmed = errors.New("fencing: speculative token not confirmed")

// Speculator is an Issuer that can also issue a token while the grant it is
// for is still being won, so that the two overlap. It is for idle moments: a
// speculative issuance is a conditional write of its own, not batched with
// others.
type Speculator interface {
	Issuer
	// Speculate sends, without waiting for it, an issuance for c that takes
	// effect only if the newest token of c.Key is last (0: none was ever
	// issued), so it cannot fence out a grant the caller does not know was
	// given up. The caller must end the Speculation with exactly one call
	// of Confirm or Abandon.
	Speculate(ctx context.Context, c Claim, last Token) (Speculation, error)
}

// Speculation is a token issuance sent ahead of its grant (see Speculator).
type Speculation interface {
	// Confirm is called once the grant is won. It returns the speculative
	// token once it is durably recorded and still the newest one for the
	// key, so it is larger than every token issued before the call. Otherwise
	// it returns an error, matching ErrNotConfirmed when no failure occurred
	// but the token is not grantable; the caller must not grant with it.
	Confirm(ctx context.Context) (Token, error)
	// Abandon is called when the grant is not won. It ends the
	// speculation; the speculative token, if it was issued, stays unused
	// (burned), never withdrawn, so a key's token only goes up and no
	// number is issued twice. That is safe: no live grant held the token
	// it replaced.
	Abandon(ctx context.Context) error
}

// Parse parses a decimal token as carried in headers and query strings.
func Parse(s string) (Token, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return 0, fmt.Errorf("%w: empty", ErrInvalid)
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 1 || s[0] == '+' {
		return 0, fmt.Errorf("%w: %q is not a positive integer", ErrInvalid, s)
	}
	return Token(n), nil
}

// FromRequest reads the token from the Fencing-Token header of r.
func FromRequest(r *http.Request) (Token, error) {
	v := r.Header.Values(Header)
	if len(v) != 1 {
		return 0, fmt.Errorf("%w: want exactly one %s header, got %d", ErrInvalid, Header, len(v))
	}
	return Parse(v[0])
}

// SetHeader sets the Fencing-Token header on h.
func SetHeader(h http.Header, t Token) { h.Set(Header, t.String()) }

// Check applies the monotonic rule: it returns nil when got is valid and at
// least as new as last (the newest token already applied; 0 for none), a
// *StaleError (matching ErrStale) when it is older, and an error matching
// ErrInvalid when it is not a token Redfence issues (below 1 or above
// MaxToken: once applied, such a token would refuse every real one after
// it). Equal tokens are accepted so one holder may write several times
// under one grant. CheckMax is Check for an Issuer with a wider range.
func Check(last, got Token) error { return CheckMax(last, got, MaxToken) }

// CheckMax is Check with max, not MaxToken, as the largest valid token (0
// or less means MaxToken, as in Guard.Max and RequireOptions.Max).
func CheckMax(last, got, max Token) error {
	if max <= 0 {
		max = MaxToken
	}
	if !got.Valid() {
		return fmt.Errorf("%w: %d", ErrInvalid, got)
	}
	if got > max {
		return fmt.Errorf("%w: %d is above the largest token issued (%d)", ErrInvalid, got, max)
	}
	if got < last {
		return &StaleError{Got: got, Current: last}
	}
	return nil
}

// Guard tracks the newest token applied per key in memory and applies Check
// atomically with recording it. It is safe for concurrent use. It is a building
// block for single-process storage layers; a durable store must keep the last
// token next to the data and compare in the same transaction as the write.
// Its zero value is ready to use.
type Guard struct {
	// Max is the largest valid token; 0 means MaxToken. Set it before
	// the first Apply.
	Max  Token
	mu   sync.Mutex
	last map[string]Token
}

// Apply checks got against the newest token applied for key and, when it
// passes, records it and runs write while still holding the guard, so no
// older token can slip in between the check and the write. If write fails the
// token is not recorded.
func (g *Guard) Apply(key string, got Token, write func() error) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.last == nil {
		g.last = make(map[string]Token)
	}
	if err := CheckMax(g.last[key], got, g.Max); err != nil {
		if se, ok := err.(*StaleError); ok {
			se.Key = key
			return se
		}
		return fmt.Errorf("apply %q: %w", key, err)
	}
	if write != nil {
		if err := write(); err != nil {
			return err
		}
	}
	g.last[key] = got
	return nil
}

// Last returns the newest token applied for key (0 if none).
func (g *Guard) Last(key string) Token {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.last[key]
}

// Record is what an Issuer remembers of the newest token issued for a key.
type Record struct {
	Claim
	// Token is the newest token issued for Key; 0 if none was.
	Token Token
	// IssuedAt is when Token was issued (zero if none was).
	IssuedAt time.Time
}
