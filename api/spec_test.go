package api

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/go-chi/chi/v5"

	"github.com/redfence/redfence"
	"github.com/redfence/redfence/internal/keyspace"
	"github.com/redfence/redfence/internal/openapitest"
)

// specHandler is the API with no Locker or Store: enough for routing, the
// spec and every check made before a handler touches either.
func specHandler() *Handler {
	return NewHandler(nil, nil, Options{OpenAPI: redfence.OpenAPI})
}

func TestSpec_RoutesMatch(t *testing.T) {
	v := openapitest.New(t, redfence.OpenAPI)
	var routes []string
	err := chi.Walk(specHandler().Routes(), func(method, route string, _ http.Handler, _ ...func(http.Handler) http.Handler) error {
		routes = append(routes, method+" "+route)
		return nil
	})
	if err != nil {
		t.Fatalf("chi.Walk: %v", err)
	}
	ops := v.Operations()
	for _, r := range routes {
		if get, ok := strings.CutPrefix(r, "HEAD "); ok {
			// The document says HEAD is answered wherever GET is.
			if !slices.Contains(ops, "GET "+get) {
				t.Errorf("route %s has no documented GET", r)
			}
			continue
		}
		if !slices.Contains(ops, r) {
			t.Errorf("route %s is missing from openapi.yaml", r)
		}
	}
	for _, op := range ops {
		if !slices.Contains(routes, op) {
			t.Errorf("openapi.yaml documents %s, which has no route", op)
		}
	}
}

func TestSpec_ProblemTypes(t *testing.T) {
	doc, err := openapi3.NewLoader().LoadFromData(redfence.OpenAPI)
	if err != nil {
		t.Fatalf("load openapi.yaml: %v", err)
	}
	p := doc.Components.Schemas["Problem"]
	if p == nil || p.Value.Properties["type"] == nil {
		t.Fatal("openapi.yaml has no components/schemas/Problem with a type property")
	}
	desc := p.Value.Properties["type"].Value.Description
	for _, slug := range ProblemTypes() {
		if !strings.Contains(desc, "`"+slug+"`") {
			t.Errorf("problem type %q is not documented in Problem.type", slug)
		}
	}
}

// TestSpec_Conventions checks what every operation of openapi.yaml must
// declare, so a new operation cannot forget it.
func TestSpec_Conventions(t *testing.T) {
	doc, err := openapi3.NewLoader().LoadFromData(redfence.OpenAPI)
	if err != nil {
		t.Fatalf("load openapi.yaml: %v", err)
	}
	for path, item := range doc.Paths.Map() {
		for method, op := range item.Operations() {
			name := method + " " + path
			if op.OperationID == "" || op.Summary == "" || len(op.Tags) == 0 {
				t.Errorf("%s: operationId, summary and tags are required", name)
			}
			if op.Responses.Default() == nil {
				t.Errorf("%s: no default (Problem) response", name)
			}
			for code, ref := range op.Responses.Map() {
				resp := ref.Value
				if resp.Headers["X-Request-Id"] == nil {
					t.Errorf("%s %s: X-Request-Id header not declared", name, code)
				}
				if (code == "409" || code == "503") && resp.Headers["Retry-After"] == nil {
					t.Errorf("%s %s: Retry-After header not declared", name, code)
				}
				isError := code == "default" || code >= "4"
				if isError && name != "GET /readyz" && resp.Content.Get("application/problem+json") == nil {
					t.Errorf("%s %s: an error must be application/problem+json", name, code)
				}
			}
		}
	}
}

func TestSpec_Served(t *testing.T) {
	srv := httptest.NewServer(specHandler())
	defer srv.Close()
	c := openapitest.New(t, redfence.OpenAPI).Client(t)
	resp, err := c.Get(srv.URL + "/openapi.yaml")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Errorf("GET /openapi.yaml: status %d; want 200", resp.StatusCode)
	}
	if !bytes.Equal(body, redfence.OpenAPI) {
		t.Errorf("GET /openapi.yaml served %d bytes that differ from redfence.OpenAPI (%d bytes)", len(body), len(redfence.OpenAPI))
	}
}

// TestSpec_Refusals sends requests the handler refuses before it touches the
// Locker or the Store, and checks every answer against the spec.
func TestSpec_Refusals(t *testing.T) {
	srv := httptest.NewServer(specHandler())
	defer srv.Close()
	c := openapitest.New(t, redfence.OpenAPI).Client(t, openapitest.SkipRequests())
	const token = "jzocnifUtgU-kaoMf0LY4Vtgw_c"
	big := `{"fencing_token":1,"data":"` + strings.Repeat("x", 1<<20) + `"}`
	tests := []struct {
		name, method, path, ct, body, token string
		want                                int
		wantType                            string
	}{
		{"Healthz", "GET", "/healthz", "", "", "", 200, ""},
		{"Metrics", "GET", "/metrics", "", "", "", 200, ""},
		{"UnknownPath", "GET", "/v1/nope", "", "", "", 404, "not-found"},
		{"EmptyName", "POST", "/v1/locks/", "", "", "", 404, "not-found"},
		{"MethodNotAllowed", "PUT", "/v1/locks/a", "", "", "", 405, "method-not-allowed"},
		{"AcquireBadName", "POST", "/v1/locks/a!b", "", "", "", 400, "invalid-request"},
		{"AcquireLongName", "POST", "/v1/locks/" + strings.Repeat("a", 201), "", "", "", 400, "invalid-request"},
		{"AcquireBadJSON", "POST", "/v1/locks/a", "application/json", "{", "", 400, "invalid-request"},
		{"AcquireUnknownField", "POST", "/v1/locks/a", "application/json", `{"ttl":1}`, "", 400, "invalid-request"},
		{"AcquireNegativeTTL", "POST", "/v1/locks/a", "application/json", `{"ttl_ms":-1}`, "", 400, "invalid-request"},
		{"AcquireBadOwner", "POST", "/v1/locks/a", "application/json", `{"owner":"a\u0007"}`, "", 400, "invalid-request"},
		{"AcquireMediaType", "POST", "/v1/locks/a", "text/plain", `{}`, "", 415, "unsupported-media-type"},
		{"GetLockBadName", "GET", "/v1/locks/a%20b", "", "", "", 400, "invalid-request"},
		{"ReleaseNoToken", "DELETE", "/v1/locks/a", "", "", "", 400, "invalid-request"},
		{"ReleaseBadToken", "DELETE", "/v1/locks/a", "", "", "short", 400, "invalid-request"},
		{"ExtendNoToken", "POST", "/v1/locks/a/extend", "", "", "", 400, "invalid-request"},
		{"ExtendBadBody", "POST", "/v1/locks/a/extend", "application/json", `{"ttl_ms":"1s"}`, token, 400, "invalid-request"},
		{"ExtendMediaType", "POST", "/v1/locks/a/extend", "text/plain", `{}`, token, 415, "unsupported-media-type"},
		{"PutNoBody", "PUT", "/v1/resources/a", "application/json", "", "", 400, "invalid-request"},
		{"PutMissingFields", "PUT", "/v1/resources/a", "application/json", `{}`, "", 400, "invalid-request"},
		{"PutZeroToken", "PUT", "/v1/resources/a", "application/json", `{"fencing_token":0,"data":1}`, "", 400, "invalid-request"},
		{"PutTooLarge", "PUT", "/v1/resources/a", "application/json", big, "", 413, "request-too-large"},
		{"GetResourceBadName", "GET", "/v1/resources/" + strings.Repeat("b", 201), "", "", "", 400, "invalid-request"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var body io.Reader
			if tt.body != "" {
				body = strings.NewReader(tt.body)
			}
			req, err := http.NewRequest(tt.method, srv.URL+tt.path, body)
			if err != nil {
				t.Fatal(err)
			}
			if tt.ct != "" {
				req.Header.Set("Content-Type", tt.ct)
			}
			if tt.token != "" {
				req.Header.Set(LockTokenHeader, tt.token)
			}
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			got, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != tt.want {
				t.Errorf("%s %s: status %d; want %d\n%s", tt.method, tt.path, resp.StatusCode, tt.want, got)
			}
			if tt.wantType != "" && !bytes.Contains(got, []byte(`"type":"`+ProblemTypePrefix+tt.wantType+`"`)) {
				t.Errorf("%s %s: body %s; want problem type %s", tt.method, tt.path, got, tt.wantType)
			}
		})
	}
}

// TestSpec_NamePattern: the Name parameter's pattern in openapi.yaml accepts
// exactly the names the server accepts, so a generated client that checks it
// never sends a name the server refuses, nor refuses one it accepts.
func TestSpec_NamePattern(t *testing.T) {
	doc, err := openapi3.NewLoader().LoadFromData(redfence.OpenAPI)
	if err != nil {
		t.Fatalf("load openapi.yaml: %v", err)
	}
	p := doc.Components.Parameters["Name"]
	if p == nil || p.Value.Schema == nil {
		t.Fatal("openapi.yaml has no components/parameters/Name schema")
	}
	re, err := regexp.Compile(p.Value.Schema.Value.Pattern)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{
		"", ".", "..", "...", ".a", "a.", "..a", ".a.", "a..b", "a", "orders:invoice-7", "_", "-", ":",
		strings.Repeat("a", 200), strings.Repeat("a", 201), "." + strings.Repeat("a", 199), ".." + strings.Repeat("a", 198),
		".." + strings.Repeat("a", 199), strings.Repeat(".", 200), "a/b", "a b", "é", "a%2Fb",
	} {
		if spec, server := re.MatchString(name), keyspace.ValidName(name) == ""; spec != server {
			t.Errorf("name %q: spec pattern accepts it: %v, server accepts it: %v", name, spec, server)
		}
	}
}

// TestSpec_InvalidParamsBound: openapi.yaml bounds Problem.invalid_params
// by maxProblems, the most an answer lists.
func TestSpec_InvalidParamsBound(t *testing.T) {
	doc, err := openapi3.NewLoader().LoadFromData(redfence.OpenAPI)
	if err != nil {
		t.Fatalf("load openapi.yaml: %v", err)
	}
	p := doc.Components.Schemas["Problem"]
	if p == nil || p.Value.Properties["invalid_params"] == nil {
		t.Fatal("openapi.yaml has no components/schemas/Problem with an invalid_params property")
	}
	if m := p.Value.Properties["invalid_params"].Value.MaxItems; m == nil || *m != maxProblems {
		t.Errorf("Problem.invalid_params has maxItems %v; want %d (maxProblems)", m, maxProblems)
	}
}
