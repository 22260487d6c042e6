// Package refstore is the reference store's contract as its consumers see it:
// a document and the errors every operation may return. The store package
// (Postgres) implements it and the api package (HTTP) consumes it; both
// import this leaf so neither imports the other.
package refstore

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/redfence/redfence/fencing"
)

// ErrNotFound is returned when a resource does not exist.
var ErrNotFound = errors.New("store: not found")

// ErrUnavailable is returned (wrapped with the cause) when Postgres could not
// be reached or did not answer in time.
var ErrUnavailable = errors.New("store: unavailable")

// ErrOutcomeUnknown is returned (with ErrUnavailable) by a write whose
// COMMIT was sent but not answered: it may have been applied. A write that
// failed without it was not.
var ErrOutcomeUnknown = errors.New("store: the write's outcome is unknown")

// ErrPrecondition is returned (as a *PreconditionError) when a conditional
// write (see Condition) found the document in another state: nothing was
// written.
var ErrPrecondition = errors.New("store: precondition failed")

// Condition makes a write apply only to a document in a given state, as
// HTTP's If-Match and If-None-Match do with the document's version as its
// entity tag. The zero Condition makes none.
type Condition struct {
	// Exists: the document must exist (If-Match: * or with tags).
	Exists bool
	// Versions, if not nil, are the versions it may have (If-Match with
	// tags; empty: none can match).
	Versions []int64
	// Absent: the document must not exist (If-None-Match: *).
	Absent bool
	// NotVersions are versions it must not have (If-None-Match with tags).
	NotVersions []int64
}

// Set reports whether c makes any condition.
func (c Condition) Set() bool {
	return c.Exists || c.Versions != nil || c.Absent || c.NotVersions != nil
}

// PreconditionError says that a conditional write found the document in
// another state. It matches ErrPrecondition with errors.Is.
type PreconditionError struct {
	Key string
	// Version is the document's version then; 0 if there was none.
	Version int64
}

func (e *PreconditionError) Error() string {
	if e.Version == 0 {
		return fmt.Sprintf("store: precondition failed: no document %q", e.Key)
	}
	return fmt.Sprintf("store: precondition failed: document %q is at version %d", e.Key, e.Version)
}

// Is reports whether target is ErrPrecondition.
func (e *PreconditionError) Is(target error) bool { return target == ErrPrecondition }

// ErrInvalidData is returned when a document is refused for what it holds
// (for example a JSON string holding \u0000, which Postgres's JSON functions
// cannot read).
var ErrInvalidData = errors.New("store: data rejected")

// Resource is one document of the reference store.
type Resource struct {
	Key          string
	Data         json.RawMessage
	FencingToken fencing.Token
	// Version counts accepted writes, starting at 1.
	Version   int64
	UpdatedAt time.Time
}

// DataError says why a document cannot be stored. It matches ErrInvalidData
// with errors.Is.
type DataError struct {
	// Reason completes "data ...": "must be valid UTF-8".
	Reason string
}

func (e *DataError) Error() string { return "store: data rejected: data " + e.Reason }

// Is reports whether target is ErrInvalidData.
func (e *DataError) Is(target error) bool { return target == ErrInvalidData }

// MaxDepth is how deep arrays and objects may nest in a document.
const MaxDepth = 100

// CheckJSON returns a *DataError when data, syntactically valid JSON text,
// holds what its readers cannot read: bytes that are not UTF-8, the escape
// \u0000 (Postgres's JSON functions cannot turn it into text), a
// \uD800-\uDFFF escape that is not half of a surrogate pair (no Unicode
// text), or a number beyond the range of an IEEE 754 double (RFC 7493),
// which most JSON parsers (Go's, JavaScript's) cannot read, or arrays and
// objects nested deeper than MaxDepth, which some parsers refuse.
// encoding/json lets all of these through, so a store checks before it
// writes.
func CheckJSON(data []byte) error {
	if !utf8.Valid(data) {
		return &DataError{Reason: "must be valid UTF-8"}
	}
	inString := false
	depth := 0
	for i := 0; i < len(data); i++ {
		c := data[i]
		switch {
		case inString && c == '"':
			inString = false
		case inString && c == '\\':
			i++ // the escaped character: \\ and \" are skipped whole
			r, ok := hex4(data, i)
			if !ok {
				continue
			}
			i += 4
			switch {
			case r == 0:
				return &DataError{Reason: `must not hold the escape \u0000 (Postgres's JSON functions cannot read it)`}
			case r >= 0xDC00 && r <= 0xDFFF:
				return &DataError{Reason: "must not hold an unpaired UTF-16 surrogate escape (a low surrogate without a high one before it)"}
			case r >= 0xD800 && r <= 0xDBFF:
				// A low surrogate's escape must follow: data[i+1:] is \uXXXX.
				if lo, ok := hex4(data, i+2); !ok || data[i+1] != '\\' || lo < 0xDC00 || lo > 0xDFFF {
					return &DataError{Reason: "must not hold an unpaired UTF-16 surrogate escape (a high surrogate without a low one after it)"}
				}
				i += 6
			}
		case inString:
		case c == '"':
			inString = true
		case c == '[' || c == '{':
			if depth++; depth > MaxDepth {
				return &DataError{Reason: fmt.Sprintf("must not nest arrays and objects more than %d levels deep (some JSON parsers refuse deeper documents: Rust's serde_json stops at 128 levels)", MaxDepth)}
			}
		case c == ']' || c == '}':
			depth--
		case c == '-' || c >= '0' && c <= '9':
			j := i + 1
			for j < len(data) && strings.IndexByte("0123456789.eE+-", data[j]) >= 0 {
				j++
			}
			if !withinDouble(data[i:j]) {
				return &DataError{Reason: "must not hold a number beyond ±1.7976931348623157e308, the range of an IEEE 754 double (most JSON parsers cannot read it)"}
			}
			i = j - 1
		}
	}
	return nil
}

// withinDouble reports whether the JSON number num is at most the largest
// double in magnitude (a smaller one may round to 0: that is allowed). It
// finds the decimal exponent of the first significant digit itself, as
// strconv.ParseFloat stops reading an exponent past 10000 (so
// 0.000…0001e100000 would look small), and asks ParseFloat only at the edge.
func withinDouble(num []byte) bool {
	mant, exp := num, []byte(nil)
	if k := bytes.IndexAny(num, "eE"); k >= 0 {
		mant, exp = num[:k], num[k+1:]
	}
	intPart, frac, _ := bytes.Cut(bytes.TrimPrefix(mant, []byte("-")), []byte("."))
	// sig holds the significant digits from the first non-zero one, which
	// is 10^mag without the exponent. (Strings: num is the caller's data.)
	var sig string
	var mag int64
	if intSig := bytes.TrimLeft(intPart, "0"); len(intSig) > 0 {
		sig, mag = string(intSig)+string(frac), int64(len(intSig))-1
	} else {
		rest := bytes.TrimLeft(frac, "0")
		if len(rest) == 0 {
			return true // zero
		}
		sig, mag = string(rest), -int64(len(frac)-len(rest))-1
	}
	var e int64
	for _, d := range bytes.TrimLeft(exp, "+-") {
		if e < 1<<40 { // saturated: far beyond any double either way
			e = e*10 + int64(d-'0')
		}
	}
	if len(exp) > 0 && exp[0] == '-' {
		e = -e
	}
	switch mag += e; {
	case mag < 308:
		return true
	case mag > 308:
		return false
	}
	// 10^308 ≤ |num| < 10^309: compare d.ddd…e308 itself.
	// Every digit counts: the ones past the 17th decide the rounding there.
	_, err := strconv.ParseFloat(sig[:1]+"."+sig[1:]+"e308", 64)
	return err == nil
}

// hex4 decodes the escape \uXXXX whose 'u' is data[i].
func hex4(data []byte, i int) (rune, bool) {
	if i+4 >= len(data) || data[i] != 'u' {
		return 0, false
	}
	var r rune
	for _, c := range data[i+1 : i+5] {
		switch {
		case c >= '0' && c <= '9':
			r = r<<4 | rune(c-'0')
		case c >= 'a' && c <= 'f':
			r = r<<4 | rune(c-'a'+10)
		case c >= 'A' && c <= 'F':
			r = r<<4 | rune(c-'A'+10)
		default:
			return 0, false
		}
	}
	return r, true
}
