package client

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redfence/redfence/internal/apikey"
)

func TestProblemError(t *testing.T) {
	t.Parallel()
	problem := func(slug string, status int, extra string) string {
		return fmt.Sprintf(`{"type":"urn:redfence:problem:%s","title":"t","status":%d,"detail":"d","request_id":"r1"%s}`, slug, status, extra)
	}
	for _, tc := range []struct {
		name        string
		status      int
		contentType string
		body        string
		header      http.Header
		want        error
		slug        string
		retryAfter  time.Duration
		current     int64
	}{
		{"LockHeld", 409, "application/problem+json", problem("lock-held", 409, `,"retry_after_ms":2417`), nil, ErrHeld, "lock-held", 2417 * time.Millisecond, 0},
		{"WaitTimeout", 409, "application/problem+json", problem("wait-timeout", 409, ""), http.Header{"Retry-After": {"3"}}, ErrHeld, "wait-timeout", 3 * time.Second, 0},
		{"LockLost", 409, "application/problem+json", problem("lock-lost", 409, ""), nil, ErrLost, "lock-lost", 0, 0},
		{"NotHolder", 409, "application/problem+json", problem("not-holder", 409, ""), nil, ErrLost, "not-holder", 0, 0},
		{"Stale", 409, "application/problem+json", problem("stale-token", 409, `,"current_fencing_token":35`), nil, ErrStale, "stale-token", 0, 35},
		{"Quorum", 503, "application/problem+json", problem("quorum-unavailable", 503, `,"nodes":[{"address":"r1:6379","outcome":"yes"},{"address":"r2:6379","outcome":"quarantined","error":"restarted without its data"}]`), nil, ErrUnavailable, "quorum-unavailable", 0, 0},
		{"Fencing", 503, "application/problem+json", problem("fencing-unavailable", 503, ""), nil, ErrUnavailable, "fencing-unavailable", 0, 0},
		{"LeaseExpired", 503, "application/problem+json", problem("lease-expired", 503, ""), nil, ErrUnavailable, "lease-expired", 0, 0},
		{"Invalid", 400, "application/problem+json", problem("invalid-request", 400, ""), nil, ErrInvalid, "invalid-request", 0, 0},
		{"RequestTimeout", 408, "application/problem+json", problem("request-timeout", 408, ""), nil, ErrUnavailable, "request-timeout", 0, 0},
		{"ResourceNotFound", 404, "application/problem+json", problem("resource-not-found", 404, ""), nil, ErrNotFound, "resource-not-found", 0, 0},
		{"UnknownTypeByStatus401", 401, "application/problem+json", problem("unauthorized", 401, ""), nil, ErrDenied, "unauthorized", 0, 0},
		{"UnknownTypeByStatus429", 429, "application/problem+json", problem("rate-limited", 429, ""), http.Header{"Retry-After": {"2"}}, ErrUnavailable, "rate-limited", 2 * time.Second, 0},
		{"UnknownConflict", 409, "application/problem+json", problem("something-new", 409, ""), nil, nil, "something-new", 0, 0},
		{"NotAProblem502", 502, "text/html", "<html>bad gateway</html>", nil, ErrUnavailable, "", 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := http.Header{"Content-Type": {tc.contentType}}
			for k, v := range tc.header {
				h[k] = v
			}
			e := problemError("acquire", "orders", &http.Response{StatusCode: tc.status, Header: h}, []byte(tc.body))
			for _, s := range []error{ErrHeld, ErrLost, ErrStale, ErrUnavailable, ErrInvalid, ErrNotFound, ErrDenied} {
				if got := errors.Is(e, s); got != (s == tc.want) {
					t.Errorf("errors.Is(%v, %v) = %v; want %v", e, s, got, s == tc.want)
				}
			}
			if e.Slug() != tc.slug || e.RetryAfter != tc.retryAfter || int64(e.CurrentFencingToken) != tc.current || e.Status != tc.status {
				t.Errorf("problemError = %+v; want slug %q, retry after %v, current token %d", e, tc.slug, tc.retryAfter, tc.current)
			}
			if want := []NodeOutcome{{"r1:6379", "yes", ""}, {"r2:6379", "quarantined", "restarted without its data"}}; tc.name == "Quorum" && !slices.Equal(e.Nodes, want) {
				t.Errorf("problemError nodes = %+v; want %+v", e.Nodes, want)
			}
			if tc.slug != "" && (e.RequestID != "r1" || !strings.Contains(e.Error(), tc.slug)) {
				t.Errorf("problemError = %q (request id %q); want the slug in the message and request id r1", e.Error(), e.RequestID)
			}
		})
	}
}

// TestDecodeError: a 2xx answer that cannot be decoded is ErrUnavailable,
// and its message says it could not be decoded, not only "HTTP 200".
func TestDecodeError(t *testing.T) {
	t.Parallel()
	var v struct{ N int }
	err := decode("put", "doc", []byte(`{"N":"x"}`), &v)
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("decode = %v; want ErrUnavailable", err)
	}
	if msg := err.Error(); !strings.Contains(msg, "HTTP 200") || !strings.Contains(msg, "decoding the answer") {
		t.Errorf("message %q; want the status and why the answer could not be decoded", msg)
	}
}

// TestError_NameWithAPIKey: an API key pasted into a lock name by mistake
// (the server refuses the name, quoting it redacted) is quoted by the
// error without its secret too: errors are logged.
func TestError_NameWithAPIKey(t *testing.T) {
	t.Parallel()
	key, id := apikey.New()
	e := &Error{Op: "acquire", Name: "jobs:" + key, Status: 400, Type: "urn:redfence:problem:invalid-request"}
	if msg := e.Error(); strings.Contains(msg, key[len(key)-20:]) || !strings.Contains(msg, "jobs:"+apikey.Prefix+id+"_[redacted]") {
		t.Errorf("Error() = %q; want the name with the key's secret redacted", msg)
	}
}
