// Package openapitest checks HTTP traffic against an OpenAPI 3 document in
// tests: a Validator hands out http.Clients whose transport validates every
// request it sends and every response it receives, with kin-openapi.
//
// Guarantees: every response is checked strictly — its status must be listed
// for the operation (a catch-all "default" response does not count, so an
// unplanned 500 fails the test), and its declared headers, Content-Type and
// body must match; a body where the spec declares none is an error. A request
// the spec has no operation for must be answered 404 or 405 with a body that
// matches components/schemas/Problem, when the spec has one. Response
// objects may carry no member their schema does not list, and strings with
// an x-extensible-enum no value it does not list, though the spec leaves
// both open to clients (see closeResponses). A component schema without a
// type accepts null, as OpenAPI 3.0.3 says. Requests are
// checked too, unless SkipRequests is given. Failures are reported with
// tb.Errorf, so a test sees all of them and goes on; the caller receives the
// response unchanged, body included.
//
// Not guaranteed: streaming. Each body is read whole into memory before the
// caller sees it. Servers are ignored: paths match on any scheme, host and
// port, which is what httptest servers need.
package openapitest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/getkin/kin-openapi/routers/gorillamux"
)

// Validator checks requests and responses against the spec.
type Validator struct {
	doc    *openapi3.T
	router routers.Router
	// problem is components/schemas/Problem, if the spec has one: the body of
	// the answer to a request no operation matches.
	problem *openapi3.SchemaRef
}

// New loads spec (YAML or JSON), validates it with doc.Validate (examples
// included) and fails tb on any error.
func New(tb testing.TB, spec []byte) *Validator {
	tb.Helper()
	loader := openapi3.NewLoader()
	doc, err := loader.LoadFromData(spec)
	if err != nil {
		tb.Fatalf("openapitest: load spec: %v", err)
		return nil
	}
	if err := doc.Validate(context.Background()); err != nil {
		tb.Fatalf("openapitest: invalid spec: %v", err)
		return nil
	}
	typelessNullable(doc)
	closeResponses(doc)
	// Match on paths only, so that a server on any host:port (an httptest
	// server on 127.0.0.1:random) is checked: with no servers the router
	// accepts any scheme and host.
	doc.Servers = nil
	for _, item := range doc.Paths.Map() {
		item.Servers = nil
		for _, op := range item.Operations() {
			op.Servers = nil
		}
	}
	// gorillamux rather than legacy: it matches the escaped path, as chi does
	// (a "%2F" inside a {name} stays one segment instead of splitting it), and
	// it tells "no such path" from "no such method on this path". legacy
	// matches the decoded path.
	router, err := gorillamux.NewRouter(doc)
	if err != nil {
		tb.Fatalf("openapitest: build router: %v", err)
		return nil
	}
	v := &Validator{doc: doc, router: router}
	if doc.Components != nil {
		v.problem = doc.Components.Schemas["Problem"]
	}
	return v
}

// typelessNullable lets every component schema without a type accept null
// too, as OpenAPI 3.0.3 reads it (any value; nullable takes effect only
// beside a type): kin-openapi refuses null unless nullable is set.
func typelessNullable(doc *openapi3.T) {
	if doc.Components == nil {
		return
	}
	for _, ref := range doc.Components.Schemas {
		s := ref.Value
		if s != nil && (s.Type == nil || len(*s.Type) == 0) && len(s.AllOf)+len(s.AnyOf)+len(s.OneOf) == 0 && s.Not == nil {
			s.Nullable = true
		}
	}
}

// closeResponses makes the response schemas of doc as strict as what the
// server sends, where the spec leaves them open for clients' sake (members
// and values may be added in later versions): an object schema with
// properties and no additionalProperties accepts no other member (an allOf
// of objects is merged into one object first, or each branch would refuse
// the others' members), and a string's x-extensible-enum becomes its enum.
// Request schemas are left as they are: the server must accept what they
// accept.
func closeResponses(doc *openapi3.T) {
	seen := map[*openapi3.Schema]bool{}
	var visit func(ref *openapi3.SchemaRef)
	visit = func(ref *openapi3.SchemaRef) {
		if ref == nil || ref.Value == nil || seen[ref.Value] {
			return
		}
		if merged := mergeAllOf(ref.Value); merged != nil {
			ref.Value = merged
		}
		s := ref.Value
		seen[s] = true
		if vals, ok := s.Extensions["x-extensible-enum"].([]any); ok && len(s.Enum) == 0 {
			s.Enum = vals
		}
		if len(s.Properties) > 0 && s.AdditionalProperties.Has == nil && s.AdditionalProperties.Schema == nil {
			closed := false
			s.AdditionalProperties.Has = &closed
		}
		for _, p := range s.Properties {
			visit(p)
		}
		visit(s.Items)
		for _, b := range slices.Concat(s.AllOf, s.AnyOf, s.OneOf) {
			visit(b)
		}
	}
	for _, item := range doc.Paths.Map() {
		for _, op := range item.Operations() {
			for _, resp := range op.Responses.Map() {
				if resp.Value == nil {
					continue
				}
				for _, mt := range resp.Value.Content {
					visit(mt.Schema)
				}
			}
		}
	}
}

// mergeAllOf returns a copy of s with its allOf branches merged into one
// object schema (their properties and required members together), or nil
// if s has no allOf or a branch is not a plain object schema.
func mergeAllOf(s *openapi3.Schema) *openapi3.Schema {
	if len(s.AllOf) == 0 {
		return nil
	}
	m := *s
	m.AllOf = nil
	m.Type = &openapi3.Types{openapi3.TypeObject}
	m.Properties = openapi3.Schemas{}
	for name, p := range s.Properties {
		m.Properties[name] = p
	}
	m.Required = slices.Clone(s.Required)
	for _, b := range s.AllOf {
		if b.Value == nil || len(b.Value.AllOf)+len(b.Value.AnyOf)+len(b.Value.OneOf) > 0 || !b.Value.Type.Permits(openapi3.TypeObject) {
			return nil
		}
		for name, p := range b.Value.Properties {
			m.Properties[name] = p
		}
		m.Required = append(m.Required, b.Value.Required...)
	}
	return &m
}

// Operations returns "METHOD /path/{param}" for every operation in the spec,
// sorted.
func (v *Validator) Operations() []string {
	var out []string
	for path, item := range v.doc.Paths.Map() {
		for method := range item.Operations() {
			out = append(out, method+" "+path)
		}
	}
	slices.Sort(out)
	return out
}

// Option tunes a Client.
type Option func(*clientOptions)

type clientOptions struct {
	skipRequests bool
	base         http.RoundTripper
}

// SkipRequests turns off request validation, for tests that send invalid
// requests on purpose. Responses are still validated.
func SkipRequests() Option {
	return func(o *clientOptions) { o.skipRequests = true }
}

// Transport sends requests through rt (for example an httptest TLS server's
// Client().Transport). The default is http.DefaultTransport.
func Transport(rt http.RoundTripper) Option {
	return func(o *clientOptions) { o.base = rt }
}

// Client returns an http.Client whose transport validates every response
// (status, headers, content type, body) against the spec, strictly: a status
// the operation does not list is an error even if it has a default response.
// It validates requests too unless SkipRequests is given. Failures are
// reported with tb.Errorf naming the method, path, status and error; they do
// not stop the request.
func (v *Validator) Client(tb testing.TB, opts ...Option) *http.Client {
	tb.Helper()
	o := clientOptions{base: http.DefaultTransport}
	for _, f := range opts {
		f(&o)
	}
	return &http.Client{Transport: &transport{v: v, tb: tb, opts: o}}
}

type transport struct {
	v    *Validator
	tb   testing.TB
	opts clientOptions
}

// CloseIdleConnections closes the base transport's idle connections.
func (t *transport) CloseIdleConnections() {
	if c, ok := t.opts.base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

func (t *transport) RoundTrip(req *http.Request) (*http.Response, error) {
	// Read the body once; send one copy and validate another. A RoundTripper
	// may consume the request's body but must not change the request.
	var body []byte
	if req.Body != nil && req.Body != http.NoBody {
		b, err := io.ReadAll(req.Body)
		_ = req.Body.Close()
		if err != nil {
			return nil, err
		}
		body = b
	}
	out := withBody(req, body)
	vreq := withBody(req, body)

	route, params, rerr := t.v.router.FindRoute(vreq)
	input := &openapi3filter.RequestValidationInput{
		Request:    vreq,
		PathParams: params,
		Route:      route,
		Options: &openapi3filter.Options{
			MultiError:            true,
			IncludeResponseStatus: true,
			AuthenticationFunc:    openapi3filter.NoopAuthenticationFunc,
		},
	}
	if !t.opts.skipRequests {
		if rerr != nil {
			t.tb.Errorf("openapitest: %s %s: the spec has no such operation: %v", req.Method, req.URL.Path, rerr)
		} else if err := openapi3filter.ValidateRequest(req.Context(), input); err != nil {
			t.tb.Errorf("openapitest: %s %s: request does not match the spec:\n%v", req.Method, req.URL.Path, err)
		}
	}

	resp, err := t.opts.base.RoundTrip(out)
	if err != nil {
		return nil, err
	}
	data, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	resp.Body = io.NopCloser(bytes.NewReader(data))
	if err != nil {
		return resp, err
	}

	var verr error
	if rerr != nil {
		verr = t.v.checkUnmatched(resp, data)
	} else {
		verr = checkResponse(req.Context(), input, resp, data)
	}
	if verr != nil {
		t.tb.Errorf("openapitest: %s %s -> %d: response does not match the spec:\n%v",
			req.Method, req.URL.Path, resp.StatusCode, verr)
	}
	return resp, nil
}

// withBody returns a shallow copy of req that reads body.
func withBody(req *http.Request, body []byte) *http.Request {
	r := req.Clone(req.Context())
	if body == nil {
		r.Body, r.GetBody = http.NoBody, nil
		return r
	}
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	r.Body, _ = r.GetBody()
	return r
}

// checkResponse validates a response to a matched operation.
func checkResponse(ctx context.Context, in *openapi3filter.RequestValidationInput, resp *http.Response, data []byte) error {
	ref := in.Route.Operation.Responses.Status(resp.StatusCode)
	if ref == nil {
		return fmt.Errorf("status %d is not documented for %s (only a default response could match)",
			resp.StatusCode, in.Route.Operation.OperationID)
	}
	if ref.Value != nil && len(ref.Value.Content) == 0 && len(data) > 0 {
		return fmt.Errorf("status %d declares no body, got %d bytes (Content-Type %q)",
			resp.StatusCode, len(data), resp.Header.Get("Content-Type"))
	}
	out := &openapi3filter.ResponseValidationInput{
		RequestValidationInput: in,
		Status:                 resp.StatusCode,
		Header:                 resp.Header,
		Options:                in.Options,
	}
	out.SetBodyBytes(data)
	return openapi3filter.ValidateResponse(ctx, out)
}

// checkUnmatched validates the answer to a request no operation matches: it
// must refuse it as 404 or 405, with a Problem body when the spec has one.
func (v *Validator) checkUnmatched(resp *http.Response, data []byte) error {
	var errs []error
	if resp.StatusCode != http.StatusNotFound && resp.StatusCode != http.StatusMethodNotAllowed {
		errs = append(errs, fmt.Errorf("the spec has no operation for this request, so the status must be 404 or 405, got %d", resp.StatusCode))
	}
	if v.problem != nil {
		ct := resp.Header.Get("Content-Type")
		if mt, _, err := mime.ParseMediaType(ct); err != nil || !strings.HasSuffix(mt, "json") {
			errs = append(errs, fmt.Errorf("the body of an error must be JSON (a Problem), got Content-Type %q", ct))
		} else if value, err := decodeJSON(data); err != nil {
			errs = append(errs, fmt.Errorf("the body is not JSON: %w", err))
		} else if err := v.problem.Value.VisitJSON(value, openapi3.MultiErrors(), openapi3.VisitAsResponse()); err != nil {
			errs = append(errs, fmt.Errorf("the body does not match components/schemas/Problem: %w", err))
		}
	}
	return errors.Join(errs...)
}

func decodeJSON(data []byte) (any, error) {
	h := http.Header{"Content-Type": {"application/json"}}
	return openapi3filter.RegisteredBodyDecoder("application/json")(bytes.NewReader(data), h, nil, nil)
}
