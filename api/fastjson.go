package api

import (
	"net/http"
	"strconv"
	"sync"
	"time"
	"unicode/utf8"
)

// Hand-written JSON for the hot path: the acquire body, the grant and the
// problem. Each produces or accepts exactly what encoding/json does for the
// same type (json.Encoder with SetEscapeHTML(false); a strict json.Decoder):
// fastjson_test.go and the differential fuzz test hold them to it.

// bufPool holds the byte buffers of request and response bodies. Buffers
// that grew past maxPooledBuf are left to the garbage collector.
var bufPool = sync.Pool{New: func() any { b := make([]byte, 0, 1024); return &b }}

const maxPooledBuf = 64 << 10

func getBuf() *[]byte { return bufPool.Get().(*[]byte) }

func putBuf(b *[]byte) {
	if cap(*b) > maxPooledBuf {
		return
	}
	*b = (*b)[:0]
	bufPool.Put(b)
}

const hexDigits = "0123456789abcdef"

// jsonSafe[b] reports whether the ASCII byte b stands for itself inside a
// JSON string as encoding/json writes it without HTML escaping.
var jsonSafe = func() (t [utf8.RuneSelf]bool) {
	for b := 0x20; b < utf8.RuneSelf; b++ {
		t[b] = b != '"' && b != '\\'
	}
	return t
}()

// appendJSONString appends s as a JSON string exactly as encoding/json does
// with SetEscapeHTML(false): quotes, backslashes and control characters
// escaped (\b \f \n \r \t short, others \u00XX), invalid UTF-8 replaced by
// \ufffd, U+2028 and U+2029 escaped, everything else as is.
func appendJSONString[S []byte | string](dst []byte, s S) []byte {
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		if b := s[i]; b < utf8.RuneSelf {
			if jsonSafe[b] {
				i++
				continue
			}
			dst = append(dst, s[start:i]...)
			switch b {
			case '\\', '"':
				dst = append(dst, '\\', b)
			case '\b':
				dst = append(dst, '\\', 'b')
			case '\f':
				dst = append(dst, '\\', 'f')
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			default:
				dst = append(dst, '\\', 'u', '0', '0', hexDigits[b>>4], hexDigits[b&0xF])
			}
			i++
			start = i
			continue
		}
		c, size := utf8.DecodeRuneInString(string(s[i:min(len(s), i+utf8.UTFMax)]))
		if c == utf8.RuneError && size == 1 {
			dst = append(dst, s[start:i]...)
			dst = append(dst, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if c == '\u2028' || c == '\u2029' {
			dst = append(dst, s[start:i]...)
			dst = append(dst, '\\', 'u', '2', '0', '2', hexDigits[c&0xF])
			i += size
			start = i
			continue
		}
		i += size
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}

// appendLockResponse appends r as encoding/json encodes it, with the
// encoder's trailing newline, taking expiresAt for r.ExpiresAt (so that the
// caller need not make it a string).
func appendLockResponse[S []byte | string](dst []byte, r *LockResponse, expiresAt S) []byte {
	dst = append(dst, `{"name":`...)
	dst = appendJSONString(dst, r.Name)
	if r.LockToken != "" {
		dst = append(dst, `,"lock_token":`...)
		dst = appendJSONString(dst, r.LockToken)
	}
	dst = append(dst, `,"fencing_token":`...)
	dst = strconv.AppendInt(dst, r.FencingToken, 10)
	dst = append(dst, `,"ttl_ms":`...)
	dst = strconv.AppendInt(dst, r.TTLMS, 10)
	dst = append(dst, `,"validity_ms":`...)
	dst = strconv.AppendInt(dst, r.ValidityMS, 10)
	dst = append(dst, `,"expires_at":`...)
	dst = appendJSONString(dst, expiresAt)
	dst = append(dst, `,"owner":`...)
	dst = appendJSONString(dst, r.Owner)
	return append(dst, "}\n"...)
}

// appendProblem appends p as encoding/json encodes it (omitempty members
// left out when empty), with the encoder's trailing newline.
func appendProblem(dst []byte, p *Problem) []byte {
	dst = append(dst, `{"type":`...)
	dst = appendJSONString(dst, p.Type)
	dst = append(dst, `,"title":`...)
	dst = appendJSONString(dst, p.Title)
	dst = append(dst, `,"status":`...)
	dst = strconv.AppendInt(dst, int64(p.Status), 10)
	if p.Detail != "" {
		dst = append(dst, `,"detail":`...)
		dst = appendJSONString(dst, p.Detail)
	}
	if p.Instance != "" {
		dst = append(dst, `,"instance":`...)
		dst = appendJSONString(dst, p.Instance)
	}
	if p.RequestID != "" {
		dst = append(dst, `,"request_id":`...)
		dst = appendJSONString(dst, p.RequestID)
	}
	if p.RetryAfterMS != nil {
		dst = append(dst, `,"retry_after_ms":`...)
		dst = strconv.AppendInt(dst, *p.RetryAfterMS, 10)
	}
	if len(p.Nodes) > 0 {
		dst = append(dst, `,"nodes":[`...)
		for i := range p.Nodes {
			n := &p.Nodes[i]
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = append(dst, `{"address":`...)
			dst = appendJSONString(dst, n.Address)
			dst = append(dst, `,"outcome":`...)
			dst = appendJSONString(dst, n.Outcome)
			if n.Error != "" {
				dst = append(dst, `,"error":`...)
				dst = appendJSONString(dst, n.Error)
			}
			dst = append(dst, '}')
		}
		dst = append(dst, ']')
	}
	if p.CurrentFencingToken != nil {
		dst = append(dst, `,"current_fencing_token":`...)
		dst = strconv.AppendInt(dst, *p.CurrentFencingToken, 10)
	}
	if p.CurrentVersion != nil {
		dst = append(dst, `,"current_version":`...)
		dst = strconv.AppendInt(dst, *p.CurrentVersion, 10)
	}
	if len(p.InvalidParams) > 0 {
		dst = append(dst, `,"invalid_params":[`...)
		for i := range p.InvalidParams {
			ip := &p.InvalidParams[i]
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = append(dst, `{"name":`...)
			dst = appendJSONString(dst, ip.Name)
			dst = append(dst, `,"reason":`...)
			dst = appendJSONString(dst, ip.Reason)
			dst = append(dst, '}')
		}
		dst = append(dst, ']')
	}
	return append(dst, "}\n"...)
}

// appendRFC3339Nano appends t in UTC as time.RFC3339Nano, as
// t.UTC().Format(time.RFC3339Nano) would return it.
func appendRFC3339Nano(dst []byte, t time.Time) []byte {
	return t.UTC().AppendFormat(dst, time.RFC3339Nano)
}

// writeBody writes a JSON (or problem+json) body that b holds, with the
// headers every JSON answer carries.
func writeBody(w http.ResponseWriter, status int, contentType string, b []byte) {
	setHeader(w, "Content-Type", contentType)
	setHeader(w, "Cache-Control", "no-store")
	// Declared: the answer is never chunked.
	setHeader(w, "Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// fastAcquireRequest decodes body into out when body is a plain acquire
// request: one JSON object, no trailing data but JSON whitespace, keys
// spelt exactly ttl_ms, wait_ms or owner, integers without fraction or
// exponent of at most 18 digits, owners of plain valid UTF-8 (no escapes),
// each member at most once. It reports false, leaving out alone, for
// anything else (null and repeated members included), which the
// encoding/json path then decides: whatever this accepts, that path accepts
// with the same value (the differential fuzz test checks it).
func fastAcquireRequest(body []byte, out *AcquireRequest) bool {
	// The values, in one allocation: an absent member leaves a nil pointer.
	var ttl, wait int64
	var owner []byte // aliases body, which is pooled: copied below
	var hasTTL, hasWait, hasOwner bool
	i := skipJSONSpace(body, 0)
	if i >= len(body) || body[i] != '{' {
		return false
	}
	i = skipJSONSpace(body, i+1)
	if i < len(body) && body[i] == '}' {
		i++
	} else {
		for {
			if i >= len(body) || body[i] != '"' {
				return false
			}
			j := i + 1
			for j < len(body) && body[j] != '"' {
				if c := body[j]; c == '\\' || c < 0x20 || c >= utf8.RuneSelf {
					return false
				}
				j++
			}
			if j >= len(body) {
				return false
			}
			key := body[i+1 : j]
			i = skipJSONSpace(body, j+1)
			if i >= len(body) || body[i] != ':' {
				return false
			}
			i = skipJSONSpace(body, i+1)
			// A repeated member and null are refused: by the slow path,
			// which says why (checkMembers).
			var seen *bool
			ok := false
			switch string(key) {
			case "ttl_ms":
				seen = &hasTTL
				i, ok = fastInt(body, i, &ttl)
			case "wait_ms":
				seen = &hasWait
				i, ok = fastInt(body, i, &wait)
			case "owner":
				seen = &hasOwner
				i, ok = fastString(body, i, &owner)
			}
			if ok && *seen {
				return false
			}
			if ok {
				*seen = true
			}
			if !ok {
				return false
			}
			i = skipJSONSpace(body, i)
			if i >= len(body) {
				return false
			}
			if body[i] == ',' {
				i = skipJSONSpace(body, i+1)
				continue
			}
			if body[i] != '}' {
				return false
			}
			i++
			break
		}
	}
	if skipJSONSpace(body, i) != len(body) {
		return false
	}
	var req AcquireRequest
	if hasTTL || hasWait || hasOwner {
		v := &struct {
			ttl, wait int64
			owner     string
		}{ttl: ttl, wait: wait}
		if hasTTL {
			req.TTLMS = &v.ttl
		}
		if hasWait {
			req.WaitMS = &v.wait
		}
		if hasOwner {
			v.owner = string(owner)
			req.Owner = &v.owner
		}
	}
	*out = req
	return true
}

func skipJSONSpace(b []byte, i int) int {
	for i < len(b) {
		switch b[i] {
		case ' ', '\t', '\n', '\r':
			i++
		default:
			return i
		}
	}
	return i
}

// fastInt reads a JSON integer at b[i:] into *v. It reports !ok for null, fractions, exponents,
// leading zeros and more than 18 digits (which always fit in an int64): the
// caller falls back on encoding/json. What follows the number is the
// caller's to check.
func fastInt(b []byte, i int, v *int64) (next int, ok bool) {
	neg := false
	if i < len(b) && b[i] == '-' {
		neg = true
		i++
	}
	start := i
	var n int64
	for i < len(b) && b[i] >= '0' && b[i] <= '9' {
		if i-start == 18 {
			return i, false
		}
		n = n*10 + int64(b[i]-'0')
		i++
	}
	if i == start || (b[start] == '0' && i-start > 1) {
		return i, false
	}
	if neg {
		n = -n
	}
	*v = n
	return i, true
}

// fastString reads a JSON string without escapes, of valid UTF-8, at b[i:]
// into *v, which aliases b. It reports !ok for anything else (null
// included).
func fastString(b []byte, i int, v *[]byte) (next int, ok bool) {
	if i >= len(b) || b[i] != '"' {
		return i, false
	}
	j := i + 1
	ascii := true
	for j < len(b) && b[j] != '"' {
		c := b[j]
		if c == '\\' || c < 0x20 {
			return i, false
		}
		if c >= utf8.RuneSelf {
			ascii = false
		}
		j++
	}
	if j >= len(b) {
		return i, false
	}
	raw := b[i+1 : j]
	if !ascii && !utf8.Valid(raw) {
		return i, false
	}
	*v = raw
	return j + 1, true
}
