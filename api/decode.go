// Reading a request: its body (size, media type, JSON) and the bounds of
// its durations, with a 400 that names every bad field.

package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/redfence/redfence/internal/apikey"
	"github.com/redfence/redfence/internal/refstore"
	"github.com/redfence/redfence/service"
)

// decode reads a JSON body into v strictly: one object, no unknown fields, no
// trailing data, at most MaxBodyBytes. An empty body leaves v unchanged when
// optional is true.
func (h *Handler) decode(_ http.ResponseWriter, r *http.Request, v any, optional bool) error {
	buf := getBuf()
	defer putBuf(buf)
	body, err := h.readJSON(r, buf, optional)
	if err != nil || body == nil {
		return err
	}
	return decodeJSON(body, v)
}

// decodeAcquire is decode for an acquire body: plain bodies take a fast
// path (fastAcquireRequest), the rest encoding/json's.
func (h *Handler) decodeAcquire(r *http.Request, req *AcquireRequest) error {
	buf := getBuf()
	defer putBuf(buf)
	body, err := h.readJSON(r, buf, true)
	if err != nil || body == nil || fastAcquireRequest(body, req) {
		return err
	}
	slow := new(AcquireRequest) // escapes, as anything encoding/json decodes into
	err = decodeJSON(body, slow)
	*req = *slow // what was decoded before an error too, as decode would leave it
	return err
}

// readJSON reads the body of r into *buf and checks it is a JSON object
// sent as JSON: it returns the body, or nil for an empty body when optional
// is true. The body aliases *buf.
func (h *Handler) readJSON(r *http.Request, buf *[]byte, optional bool) ([]byte, error) {
	if r.ContentLength > h.opts.MaxBodyBytes {
		// Refused unread: a client that sent Expect: 100-continue is
		// told before it uploads (net/http sends 100 on the first read).
		return nil, &requestError{kind: kTooLarge, detail: fmt.Sprintf("the body exceeds %d bytes", h.opts.MaxBodyBytes)}
	}
	if r.ContentLength > 0 {
		// A body declared non-empty is refused for its encoding or media
		// type unread too, for the same reason; a chunked one only once
		// read, since an empty body takes the defaults whatever its type.
		if err := mediaTypeError(r); err != nil {
			return nil, err
		}
	}
	body, err := readBody((*buf)[:0], r.Body, h.opts.MaxBodyBytes)
	*buf = body
	if err != nil {
		return nil, bodyReadError(r.Context(), err)
	}
	if len(body) == 0 {
		// Only an empty body takes the defaults: whitespace is not a
		// JSON text (it is refused below, as any non-object).
		if optional {
			return nil, nil
		}
		return nil, unreadableBody("a JSON body is required", "required", nil)
	}
	if r.ContentLength <= 0 { // else checked before the read
		if err := mediaTypeError(r); err != nil {
			return nil, err
		}
	}
	if bytes.HasPrefix(body, utf8BOM) {
		// RFC 8259 §8.1: a JSON text MUST NOT begin with a byte-order
		// mark (a parser MAY ignore one); Redfence refuses it, as it
		// refuses everything but one plain JSON object, so that what it
		// accepts reads the same to every JSON parser.
		return nil, unreadableBody("the body starts with a UTF-8 byte-order mark, which JSON text must not (RFC 8259 §8.1): send the JSON object without it",
			"must not start with a byte-order mark", nil)
	}
	if i := skipJSONSpace(body, 0); i == len(body) {
		detail := "the body holds only whitespace: send a JSON object"
		if optional {
			detail += ", or no body at all for the defaults"
		}
		return nil, unreadableBody(detail, "must be a JSON object", nil)
	} else if body[i] != '{' {
		return nil, unreadableBody("the body must be a JSON object", "must be a JSON object", nil)
	}
	return body, nil
}

// mediaTypeError returns the 415 for a non-empty body of r that is not
// plain JSON: one with a Content-Encoding other than identity, more than
// one Content-Type, or a Content-Type that is not JSON or names a charset
// other than UTF-8; or nil.
func mediaTypeError(r *http.Request) error {
	if ce := r.Header["Content-Encoding"]; len(ce) > 0 && !(len(ce) == 1 && strings.EqualFold(strings.TrimSpace(ce[0]), "identity")) {
		// RFC 9110 §15.5.16: 415 for a content coding the server does
		// not take, and Accept-Encoding names the ones it does.
		return &requestError{kind: kMediaType, detail: "the body must be sent without Content-Encoding (identity)", identityOnly: true}
	}
	if len(r.Header["Content-Type"]) > 1 {
		return &requestError{kind: kMediaType, detail: "the request has more than one Content-Type header"}
	}
	ct := header(r.Header, "Content-Type")
	if ct != "application/json" { // what ParseMediaType would accept at once
		mt, params, err := mime.ParseMediaType(ct)
		if err != nil || !jsonMediaType(mt) {
			// The header's value is not quoted: it is the client's, and
			// could be anything, a secret pasted by mistake included.
			return &requestError{kind: kMediaType, detail: "the Content-Type is not application/json"}
		}
		if cs, ok := params["charset"]; ok && !utf8Label(cs) {
			return &requestError{kind: kMediaType, detail: "the Content-Type names a charset other than UTF-8; JSON is UTF-8 (RFC 8259)"}
		}
	}
	return nil
}

// utf8BOM is the UTF-8 encoding of U+FEFF, the byte-order mark.
var utf8BOM = []byte("\xef\xbb\xbf")

// jsonMediaType reports whether mt, a media type as mime.ParseMediaType
// returns it (lower case), is JSON: application/json, or a type/subtype
// whose subtype has the +json suffix after a name (RFC 6839 §3.1).
func jsonMediaType(mt string) bool {
	typ, sub, ok := strings.Cut(mt, "/")
	if !ok || typ == "" {
		return false
	}
	if typ == "application" && sub == "json" {
		return true
	}
	name, found := strings.CutSuffix(sub, "+json")
	return found && name != ""
}

// bodyReadError is the answer to a body that could not be read: 413 past
// the limit, 408 when the server's read timeout ran out first, 503
// shutting-down when the server closed the connection, 499 cancelled when
// the client left (ctx, the request's, ended: an HTTP/2 stream it reset
// while sending the body), else 400. Neither says why in Go's words, which
// name the connection's addresses; the cause is logged.
func bodyReadError(ctx context.Context, err error) error {
	var mbe *http.MaxBytesError
	var ne net.Error
	switch {
	case errors.As(err, &mbe):
		return &requestError{kind: kTooLarge, detail: fmt.Sprintf("the body exceeds %d bytes", mbe.Limit)}
	case errors.As(err, &ne) && ne.Timeout():
		return &requestError{kind: kTimeout, detail: "the body did not arrive in full before the server's read timeout; nothing was done", cause: err}
	case errors.Is(err, io.ErrUnexpectedEOF):
		return unreadableBody("the body ended early: the connection closed before the bytes its Content-Length (or chunked encoding) announced arrived",
			"ended early", err)
	case errors.Is(err, net.ErrClosed):
		// This server closed the connection under the read: its shutdown's
		// grace period ran out. Not the client's fault.
		return &requestError{kind: kShutdown, detail: "the server shut down while the body was arriving; nothing was done", cause: err}
	case ctx.Err() != nil:
		return fmt.Errorf("the body could not be read: %w: %w", ctx.Err(), err)
	}
	return unreadableBody("the body could not be read", "could not be read", err)
}

// decodeJSON decodes body, a JSON object, into v (a pointer to a struct of
// at most 64 fields) with encoding/json, strictly, and names every member at
// fault: an unknown one (encoding/json would ignore it), one whose name
// matches a field only when case is ignored (which encoding/json would
// take), one that appears twice (two parsers could each take a different
// one), null for a field that is not free-form JSON (json.RawMessage), and a
// value of the wrong type. Malformed JSON and trailing data are problems of
// the body as a whole. The members that are right are decoded, even when
// others are not.
func decodeJSON(body []byte, v any) error {
	rv := reflect.ValueOf(v).Elem()
	t := rv.Type()
	dec := json.NewDecoder(bytes.NewReader(body))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return malformedJSON(err)
	}
	var bad badRequest
	var seen uint64 // bit i: field i appeared
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return malformedJSON(err)
		}
		name, _ := tok.(string)
		var raw json.RawMessage
		start := dec.InputOffset()
		if err := dec.Decode(&raw); err != nil {
			if !tooDeep(err) {
				return malformedJSON(err)
			}
			// encoding/json stops at 10,000 levels of nesting, inside this
			// member's value: the member is at fault, and what follows it
			// cannot be read.
			bad.add(deepMember(t, name, body[start:]))
			bad.unreadable = true
			return bad.err()
		}
		i, known := jsonField(t, name)
		if !known {
			bad.add(unknownField(t, name))
			continue
		}
		if seen&(1<<i) != 0 {
			bad.add(fmt.Sprintf("field %q appears more than once", name), InvalidParam{Name: name, Reason: "must appear at most once"})
			continue
		}
		seen |= 1 << i
		f := t.Field(i)
		if string(raw) == "null" && f.Type != rawMessageType {
			bad.add(nullField(v, name))
			continue
		}
		if err := json.Unmarshal(raw, rv.Field(i).Addr().Interface()); err != nil {
			rv.Field(i).SetZero() // not the pointer to 0 encoding/json leaves
			reason := typeReason(f.Type, err)
			bad.add(fmt.Sprintf("field %q %s", name, reason), InvalidParam{Name: name, Reason: reason})
		}
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return malformedJSON(err)
	}
	if _, err := dec.Token(); err != io.EOF {
		bad.add("the body has data after the JSON object", InvalidParam{Name: "body", Reason: "trailing data"})
	}
	return bad.err()
}

// tooDeep reports whether err is encoding/json's refusal of a value nested
// deeper than it reads.
func tooDeep(err error) bool {
	var se *json.SyntaxError
	return errors.As(err, &se) && strings.Contains(se.Error(), "exceeded max depth")
}

// deepMember is the problem of member name of a body decoded into struct t,
// whose value (the rest of the body, from just after the name) nests
// arrays and objects deeper than encoding/json reads: free-form JSON (data)
// is told its own limit, as a value past that limit but within
// encoding/json's is.
func deepMember(t reflect.Type, name string, rest []byte) (string, InvalidParam) {
	i, known := jsonField(t, name)
	if !known {
		return unknownField(t, name)
	}
	reason := "must not nest arrays and objects 10000 levels deep or more"
	if ft := t.Field(i).Type; ft != rawMessageType {
		if ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		reason = fmt.Sprintf("must be %s, got an array or object nested 10000 levels deep or more", jsonType(ft.Kind().String()))
	} else if de := (*refstore.DataError)(nil); errors.As(refstore.CheckJSON(rest), &de) {
		reason = de.Reason
	}
	return fmt.Sprintf("field %q %s", name, reason), InvalidParam{Name: name, Reason: reason}
}

// malformedJSON is the answer to a body that is not one JSON text.
func malformedJSON(err error) error {
	reason := "malformed JSON"
	if err != nil {
		reason = jsonReason(err)
	}
	return unreadableBody("the body is not valid JSON: "+reason, reason, nil)
}

// requiredFields is implemented by request types with fields that have no
// default: required says what such a field must be ("a positive integer").
type requiredFields interface {
	required(field string) (what string, ok bool)
}

// nullField is the problem of a member of v that is null: a field with a
// default is left out for it, a required one has none.
func nullField(v any, name string) (string, InvalidParam) {
	if rf, ok := v.(requiredFields); ok {
		if what, ok := rf.required(name); ok {
			return fmt.Sprintf("field %q is required and must be %s, not null", name, what),
				InvalidParam{Name: name, Reason: "required: " + what + ", not null"}
		}
	}
	return fmt.Sprintf("field %q must not be null (leave it out for the default)", name),
		InvalidParam{Name: name, Reason: "must not be null (leave it out for the default)"}
}

// reasonBeyondInt64 is the reason for an integer beyond 64 bits; a field
// with bounds of its own replaces it with them (badRequest.outOfBounds).
const reasonBeyondInt64 = "must fit in a 64-bit integer"

// typeReason says why encoding/json refused a value for a field of type t.
func typeReason(t reflect.Type, err error) string {
	var te *json.UnmarshalTypeError
	if !errors.As(err, &te) {
		return "is not valid: " + jsonReason(err)
	}
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t.Kind() == reflect.Int64 && isIntegerLiteral(strings.TrimPrefix(te.Value, "number ")) {
		return reasonBeyondInt64
	}
	// A number's literal is quoted, cut short as an unknown field's name is:
	// it goes into the answer and the log.
	got := te.Value
	if len(got) > len("number ")+maxQuotedField {
		got = got[:len("number ")+maxQuotedField] + "…"
	}
	return fmt.Sprintf("must be %s, got %s", jsonType(t.Kind().String()), got)
}

var rawMessageType = reflect.TypeFor[json.RawMessage]()

// jsonField returns the index of the field of struct t (of at most 64
// fields) that encoding/json names name, matching case exactly.
func jsonField(t reflect.Type, name string) (int, bool) {
	for i := range min(t.NumField(), 64) {
		f := t.Field(i)
		tag, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if tag == name && tag != "-" && f.IsExported() {
			return i, true
		}
	}
	return 0, false
}

// unknownField is the problem of an unknown member of a body decoded into
// t. The member's name (the client's) is cut short and without the secret
// of an API key pasted into it: it goes into the answer and the log.
func unknownField(t reflect.Type, name string) (string, InvalidParam) {
	shown := apikey.Redact(name)
	if len(shown) > maxQuotedField {
		shown = strings.ToValidUTF8(shown[:maxQuotedField], "") + "…"
	}
	reason := "unknown field"
	for i := range min(t.NumField(), 64) {
		tag, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ",")
		if tag != "-" && tag != "" && strings.EqualFold(tag, name) {
			reason = fmt.Sprintf("unknown field (names are case-sensitive: did you mean %q?)", tag)
			break
		}
	}
	return "unknown field " + strconv.Quote(shown) + strings.TrimPrefix(reason, "unknown field"), InvalidParam{Name: shown, Reason: reason}
}

// readBody appends body to buf, reading at most limit bytes: past that it
// returns an *http.MaxBytesError, as http.MaxBytesReader would.
func readBody(buf []byte, body io.Reader, limit int64) ([]byte, error) {
	for {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		room := buf[len(buf):cap(buf)]
		if over := int64(len(buf)) + int64(len(room)) - (limit + 1); over > 0 {
			room = room[:int64(len(room))-over] // read one byte past the limit, no more
		}
		n, err := body.Read(room)
		buf = buf[:len(buf)+n]
		if int64(len(buf)) > limit {
			return buf[:limit], &http.MaxBytesError{Limit: limit}
		}
		if err == io.EOF {
			return buf, nil
		}
		if err != nil {
			return buf, err
		}
	}
}

func jsonReason(err error) string {
	var se *json.SyntaxError
	switch {
	case errors.As(err, &se):
		// The message names a character of the body at most, or the nesting
		// limit: "invalid character 'x' after object key".
		return fmt.Sprintf("malformed JSON at byte %d: %s", se.Offset, strings.TrimPrefix(se.Error(), "json: "))
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF):
		// json.Decoder.Token says io.EOF when the body ends inside an
		// object.
		return "truncated JSON"
	}
	return err.Error()
}

// isIntegerLiteral reports whether s is a JSON number without fraction or
// exponent.
func isIntegerLiteral(s string) bool {
	s = strings.TrimPrefix(s, "-")
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// maxQuotedField bounds how much of an unknown field's name, or of a number
// of the wrong type, an error quotes.
const maxQuotedField = 64

func jsonType(kind string) string {
	switch kind {
	case "int64", "int":
		return "an integer"
	case "string":
		return "a string"
	case "ptr":
		return "a value of the documented type"
	}
	return kind
}

// msBounds are the bounds of a millisecond field, in milliseconds.
type msBounds struct {
	lo, hi int64
	// what the bounds are, for the reason.
	what string
}

// reason is why a value outside b is refused: it names the bounds, in
// milliseconds as the field, whatever the value.
func (b msBounds) reason() string {
	return fmt.Sprintf("must be from %d to %d (%s, in milliseconds)", b.lo, b.hi, b.what)
}

// lockerBounds are the bounds of ttl_ms and wait_ms: the configured ones
// of a Locker that has Options (a *service.Locker), so that a value outside
// is refused with the other problems of its request and with the bounds in
// the field's unit. Another Locker (a fake) checks its own: the API only
// keeps the milliseconds within a day.
func lockerBounds(l Locker) (ttl, wait msBounds) {
	if o, ok := l.(interface{ Options() service.Options }); ok {
		opts := o.Options()
		// Whole milliseconds within the bounds (which Durations may
		// split finer): the minimum rounded up, the maxima down.
		return msBounds{lo: int64((opts.MinTTL + time.Millisecond - 1) / time.Millisecond), hi: opts.MaxTTL.Milliseconds(), what: "the server's TTL bounds"},
			msBounds{lo: 0, hi: opts.MaxWait.Milliseconds(), what: "the server's longest wait"}
	}
	day := (24 * time.Hour).Milliseconds()
	return msBounds{lo: 0, hi: day, what: "at most a day"}, msBounds{lo: 0, hi: day, what: "at most a day"}
}

// millis validates an optional millisecond field within b, adding its
// problem to bad; def is its default.
func millis(bad *badRequest, name string, v *int64, def time.Duration, b msBounds) time.Duration {
	if v != nil && bad.has(name) {
		return def // refused already (repeated): its first value is not judged too
	}
	if v == nil {
		if len(bad.params) > 0 {
			bad.outOfBounds(name, b) // an integer beyond 64 bits is out of bounds too
		}
		return def
	}
	if *v < b.lo || *v > b.hi {
		reason := b.reason()
		bad.add(name+" "+reason, InvalidParam{Name: name, Reason: reason})
		return def
	}
	return time.Duration(*v) * time.Millisecond
}

// outOfBounds gives the field name, refused as beyond 64 bits, the reason
// of its bounds b instead.
func (b *badRequest) outOfBounds(name string, bounds msBounds) {
	b.beyondInt64(name, bounds.reason())
}

// beyondInt64 gives the field name, refused as beyond 64 bits, reason
// instead: the bounds of its own.
func (b *badRequest) beyondInt64(name, reason string) {
	for i, p := range b.params {
		if p.Name == name && p.Reason == reasonBeyondInt64 {
			b.params[i].Reason = reason
			b.parts[i] = name + " " + reason
		}
	}
}

// serviceBounds turns a *service.InvalidError into an invalid-request naming
// the JSON field.
func serviceBounds(err error) error {
	var buf [8]error
	if ie, ok := asErr[*service.InvalidError](flatten(buf[:0], err)); ok {
		field := ie.Field + "_ms"
		return invalid(field+" "+ie.Reason, InvalidParam{Name: field, Reason: ie.Reason})
	}
	return err
}
