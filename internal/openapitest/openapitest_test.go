package openapitest

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
)

const testSpec = `
openapi: 3.0.3
info: {title: test, version: 1.0.0}
servers:
  - url: http://localhost:8080
paths:
  /healthz:
    get:
      operationId: healthz
      responses:
        '200':
          description: ok
          content:
            application/json:
              schema:
                type: object
                additionalProperties: false
                required: [status]
                properties:
                  status: {type: string}
        default:
          $ref: '#/components/responses/Problem'
  /open:
    get:
      operationId: open
      responses:
        '200':
          description: open for clients, closed in tests
          content:
            application/json:
              schema:
                allOf:
                  - type: object
                    required: [a]
                    properties:
                      a: {type: string}
                  - type: object
                    properties:
                      b: {type: string, x-extensible-enum: [x, y]}
        default:
          $ref: '#/components/responses/Problem'
  /things/{name}:
    parameters:
      - name: name
        in: path
        required: true
        schema: {type: string, pattern: '^[a-z]{1,10}$'}
    put:
      operationId: putThing
      requestBody:
        required: true
        content:
          application/json:
            schema:
              type: object
              additionalProperties: false
              required: [n]
              properties:
                n: {type: integer}
                data: {nullable: true, description: any JSON value}
                any: {$ref: '#/components/schemas/Any'}
      responses:
        '200':
          description: the thing
          content:
            application/json:
              schema:
                type: object
                required: [n]
                properties:
                  n: {type: integer}
                  data: {nullable: true, description: any JSON value}
        '202':
          description: accepted, no body
        '204':
          description: nothing
        '400':
          $ref: '#/components/responses/Problem'
        default:
          $ref: '#/components/responses/Problem'
components:
  responses:
    Problem:
      description: an error
      content:
        application/problem+json:
          schema:
            $ref: '#/components/schemas/Problem'
  schemas:
    Any:
      description: any JSON value, null included
    Problem:
      type: object
      required: [type, status]
      properties:
        type: {type: string}
        status: {type: integer}
`

// recorder is a testing.TB that records Errorf calls instead of failing.
type recorder struct {
	testing.TB
	mu   sync.Mutex
	errs []string
}

func (r *recorder) Errorf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}

func (r *recorder) Fatalf(format string, args ...any) {
	r.Errorf(format, args...)
	runtime.Goexit()
}

func (r *recorder) errors() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.errs)
}

// reply answers every request with status, content type and body.
func reply(status int, contentType, body string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if contentType != "" {
			w.Header().Set("Content-Type", contentType)
		}
		w.WriteHeader(status)
		_, _ = io.WriteString(w, body)
	}
}

func TestValidator_Client(t *testing.T) {
	v := New(t, []byte(testSpec))
	const problem = `{"type":"urn:x:not-found","status":404}`
	tests := []struct {
		name    string
		handler http.HandlerFunc
		method  string
		path    string
		body    string
		ct      string
		opts    []Option
		want    string // a substring of the one error expected; "" for none
	}{
		{name: "Valid", handler: reply(200, "application/json", `{"status":"ok"}`),
			method: "GET", path: "/healthz"},
		{name: "MissingRequiredField", handler: reply(200, "application/json", `{}`),
			method: "GET", path: "/healthz", want: `property "status" is missing`},
		{name: "UnknownField", handler: reply(200, "application/json", `{"status":"ok","extra":1}`),
			method: "GET", path: "/healthz", want: `"extra"`},
		{name: "OpenSchemaValid", handler: reply(200, "application/json", `{"a":"1","b":"x"}`),
			method: "GET", path: "/open"},
		{name: "OpenSchemaUnknownMember", handler: reply(200, "application/json", `{"a":"1","c":1}`),
			method: "GET", path: "/open", want: `"c"`},
		{name: "OpenSchemaUnknownValue", handler: reply(200, "application/json", `{"a":"1","b":"z"}`),
			method: "GET", path: "/open", want: `allowed values`},
		{name: "OpenSchemaMissingMember", handler: reply(200, "application/json", `{"b":"x"}`),
			method: "GET", path: "/open", want: `property "a" is missing`},
		{name: "WrongContentType", handler: reply(200, "text/plain", `{"status":"ok"}`),
			method: "GET", path: "/healthz", want: "Content-Type"},
		{name: "UndocumentedStatus", handler: reply(418, "application/problem+json", `{"type":"x","status":418}`),
			method: "GET", path: "/healthz", want: "status 418 is not documented"},
		{name: "InternalErrorOnlyByDefault", handler: reply(500, "application/problem+json", `{"type":"x","status":500}`),
			method: "GET", path: "/healthz", want: "status 500 is not documented"},
		{name: "BodyWhereNoneDeclared", handler: reply(202, "application/json", `{}`),
			method: "PUT", path: "/things/abc", body: `{"n":1}`, ct: "application/json", want: "declares no body"},
		{name: "NoContent", handler: reply(204, "", ""),
			method: "PUT", path: "/things/abc", body: `{"n":1}`, ct: "application/json"},
		{name: "AnyJSONObject", handler: reply(200, "application/json", `{"n":1,"data":{"a":[1,2]}}`),
			method: "PUT", path: "/things/abc", body: `{"n":1,"data":{"a":[1,2]}}`, ct: "application/json"},
		{name: "AnyJSONNull", handler: reply(200, "application/json", `{"n":1,"data":null}`),
			method: "PUT", path: "/things/abc", body: `{"n":1,"data":null}`, ct: "application/json"},
		{name: "AnyJSONScalars", handler: reply(200, "application/json", `{"n":1,"data":"s"}`),
			method: "PUT", path: "/things/abc", body: `{"n":1,"data":[true,1.5,"x",null]}`, ct: "application/json"},
		{name: "TypelessComponentNull", handler: reply(204, "", ""),
			method: "PUT", path: "/things/abc", body: `{"n":1,"any":null}`, ct: "application/json"},
		{name: "TypelessComponentArrayOfNull", handler: reply(204, "", ""),
			method: "PUT", path: "/things/abc", body: `{"n":1,"any":[null,1,"x",{"a":null}]}`, ct: "application/json"},
		{name: "InvalidRequestBody", handler: reply(400, "application/problem+json", `{"type":"x","status":400}`),
			method: "PUT", path: "/things/abc", body: `{"n":"one"}`, ct: "application/json", want: "request does not match"},
		{name: "InvalidPathParam", handler: reply(400, "application/problem+json", `{"type":"x","status":400}`),
			method: "PUT", path: "/things/ABC", body: `{"n":1}`, ct: "application/json", want: "request does not match"},
		{name: "InvalidRequestSkipped", handler: reply(400, "application/problem+json", `{"type":"x","status":400}`),
			method: "PUT", path: "/things/abc", body: `{"n":"one"}`, ct: "application/json", opts: []Option{SkipRequests()}},
		{name: "UnknownRouteRequest", handler: reply(404, "application/problem+json", problem),
			method: "GET", path: "/nope", want: "no such operation"},
		{name: "UnknownRouteRefused", handler: reply(404, "application/problem+json", problem),
			method: "GET", path: "/nope", opts: []Option{SkipRequests()}},
		{name: "UnknownMethodRefused", handler: reply(405, "application/problem+json", `{"type":"x","status":405}`),
			method: "DELETE", path: "/healthz", opts: []Option{SkipRequests()}},
		{name: "UnknownRouteServed", handler: reply(200, "application/json", `{}`),
			method: "GET", path: "/nope", opts: []Option{SkipRequests()}, want: "must be 404 or 405"},
		{name: "UnknownRouteBadProblem", handler: reply(404, "text/plain", "404 page not found"),
			method: "GET", path: "/nope", opts: []Option{SkipRequests()}, want: "must be JSON"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got []byte // the request body the server received
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				got, _ = io.ReadAll(r.Body)
				tt.handler(w, r)
			}))
			defer srv.Close()
			rec := &recorder{TB: t}
			c := v.Client(rec, tt.opts...)
			req, err := http.NewRequest(tt.method, srv.URL+tt.path, strings.NewReader(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			if tt.ct != "" {
				req.Header.Set("Content-Type", tt.ct)
			}
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, err := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			if err != nil {
				t.Fatal(err)
			}
			rr := httptest.NewRecorder()
			tt.handler(rr, req)
			if string(body) != rr.Body.String() {
				t.Errorf("caller read body %q; want %q (restored after validation)", body, rr.Body.String())
			}
			if string(got) != tt.body {
				t.Errorf("server received body %q; want %q", got, tt.body)
			}

			errs := rec.errors()
			for _, e := range errs {
				t.Logf("reported: %s", e)
			}
			switch {
			case tt.want == "" && len(errs) > 0:
				t.Errorf("reported %d errors, want none:\n%s", len(errs), strings.Join(errs, "\n"))
			case tt.want != "" && len(errs) != 1:
				t.Errorf("reported %d errors, want 1 containing %q:\n%s", len(errs), tt.want, strings.Join(errs, "\n"))
			case tt.want != "" && !strings.Contains(errs[0], tt.want):
				t.Errorf("reported %q; want it to contain %q", errs[0], tt.want)
			}
			for _, e := range errs {
				if !strings.Contains(e, tt.method+" "+tt.path) {
					t.Errorf("error %q does not name the request %s %s", e, tt.method, tt.path)
				}
			}
		})
	}
}

func TestValidator_Operations(t *testing.T) {
	got := New(t, []byte(testSpec)).Operations()
	want := []string{"GET /healthz", "GET /open", "PUT /things/{name}"}
	if !slices.Equal(got, want) {
		t.Errorf("Operations() = %q; want %q", got, want)
	}
}

func TestValidator_New(t *testing.T) {
	for name, spec := range map[string]string{
		"NotYAML":        "{",
		"MissingInfo":    "openapi: 3.0.3\npaths: {}\n",
		"DanglingRef":    strings.Replace(testSpec, "#/components/schemas/Problem", "#/components/schemas/Nope", 1),
		"ExampleInvalid": strings.Replace(testSpec, "properties:\n                  status: {type: string}", "properties:\n                  status: {type: string, example: 1}", 1),
	} {
		t.Run(name, func(t *testing.T) {
			rec := &recorder{TB: t}
			done := make(chan struct{})
			go func() {
				defer close(done)
				New(rec, []byte(spec))
			}()
			<-done
			if len(rec.errors()) != 1 {
				t.Errorf("New reported %q; want one fatal error", rec.errors())
			}
		})
	}
}
