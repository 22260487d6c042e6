package api_test

import (
	"bufio"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redfence/redfence/api"
	"github.com/redfence/redfence/client"
	"github.com/redfence/redfence/client/clienttest"
)

// dashboardMetrics returns every redfence_* metric name the Grafana
// dashboard's queries use.
func dashboardMetrics(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("../deploy/grafana/redfence.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatalf("the dashboard is not valid JSON: %v", err)
	}
	var names []string
	re := regexp.MustCompile(`\bredfence_[a-z_]+`)
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			found := re.FindAllString(tg.Expr, -1)
			if len(found) == 0 {
				t.Errorf("panel %q queries no redfence metric: %s", p.Title, tg.Expr)
			}
			names = append(names, found...)
		}
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// scrape returns the metric families /metrics serves, by name and type.
func scrape(t *testing.T, url string) map[string]string {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /metrics = %d", resp.StatusCode)
	}
	families := map[string]string{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) == 4 && f[0] == "#" && f[1] == "TYPE" {
			families[f[2]] = f[3]
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return families
}

// logLines collects JSON log records.
type logLines struct {
	mu    sync.Mutex
	lines []map[string]any
	raw   strings.Builder
}

func (l *logLines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.raw.Write(p)
	var m map[string]any
	if err := json.Unmarshal(p, &m); err == nil {
		l.lines = append(l.lines, m)
	}
	return len(p), nil
}

func (l *logLines) find(msg string) map[string]any {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, m := range l.lines {
		if m["msg"] == msg {
			return m
		}
	}
	return nil
}

func (l *logLines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.raw.String()
}

// TestMetrics_Dashboard runs traffic through a real server and checks that
// every metric the Grafana dashboard uses is served, and that the dashboard
// shows every metric Redfence exports. It also checks the audit log.
func TestMetrics_Dashboard(t *testing.T) {
	t.Parallel()
	logs := &logLines{}
	s := clienttest.Start(t, clienttest.Options{Logger: slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	c, err := client.New(s.URL, client.Options{Owner: "alice"})
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()

	// Traffic: a grant, a refusal, an extension, writes (one stale), a
	// release, a refused release, a blocking acquire.
	l, err := c.Acquire(ctx, "orders", &client.LockOptions{TTL: 10 * time.Second, NoRenew: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Acquire(ctx, "orders", nil); !errors.Is(err, client.ErrHeld) {
		t.Fatalf("second Acquire = %v; want ErrHeld", err)
	}
	if err := l.Extend(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := c.PutResource(ctx, "orders", l.FencingToken(), 42); err != nil {
		t.Fatal(err)
	}
	if _, err := c.PutResource(ctx, "orders", l.FencingToken()+100, 0); !errors.Is(err, client.ErrStale) {
		t.Fatalf("PutResource with an unissued token = %v; want ErrStale", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	stranger := lockTokenOf(t, s.URL)
	resp, err := http.DefaultClient.Do(mustRequest(t, http.MethodDelete, s.URL+"/v1/locks/orders", "Lock-Token", stranger))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusConflict {
		t.Fatalf("release by a stranger = %d; want 409", resp.StatusCode)
	}

	families := scrape(t, s.URL)
	used := dashboardMetrics(t)
	for _, name := range used {
		base := name
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			if b, ok := strings.CutSuffix(name, suffix); ok && families[b] == "histogram" {
				base = b
			}
		}
		if _, ok := families[base]; !ok {
			t.Errorf("the dashboard uses %s, which /metrics does not serve", name)
		}
	}
	for _, name := range []string{
		api.MetricHTTPRequests, api.MetricHTTPSeconds, api.MetricAcquisitions, api.MetricAcquireSeconds,
		api.MetricExtensions, api.MetricReleases, api.MetricReleaseSeconds, api.MetricStaleWrites,
		api.MetricQuorumFailures, api.MetricNodeRequests, api.MetricNodeSeconds, api.MetricNodeQuarantined,
		api.MetricNodeQuarantines, api.MetricBlockedWaiters, api.MetricTokensIssued, api.MetricTokenIssueFailures,
		api.MetricTokenIssueSeconds, api.MetricSpeculations,
	} {
		if _, ok := families[name]; !ok {
			t.Errorf("/metrics does not serve %s after traffic", name)
		}
		if !slices.ContainsFunc(used, func(u string) bool { return u == name || strings.HasPrefix(u, name+"_") }) {
			t.Errorf("the dashboard does not show %s", name)
		}
	}

	// The audit log: one line per grant, refusal and release, naming the
	// lock, the owner, the fencing token and the outcome (a refused
	// release's line may follow its answer: see Handler.Wait).
	s.Handler.Wait()
	for _, tc := range []struct {
		msg, outcome string
		token        bool
	}{
		{"lock granted", "granted", true},
		{"lock refused", "lock-held", false},
		{"lock extended", "extended", true},
		{"lock released", "released", true},
		{"lock release refused", "not-holder", false},
	} {
		m := logs.find(tc.msg)
		if m == nil {
			t.Errorf("no %q audit line in the log:\n%s", tc.msg, logs)
			continue
		}
		if m["audit"] != true || m["name"] != "orders" || m["outcome"] != tc.outcome || (tc.token && m["fencing_token"] != float64(l.FencingToken())) {
			t.Errorf("%q = %v; want audit, name orders, outcome %s, fencing token %d: %v", tc.msg, m, tc.outcome, l.FencingToken(), tc.token)
		}
		if tc.msg != "lock release refused" && m["owner"] != "alice" {
			t.Errorf("%q owner = %v; want alice", tc.msg, m["owner"])
		}
	}
	if strings.Contains(logs.String(), stranger) {
		t.Error("the log contains a lock token")
	}
}

func mustRequest(t *testing.T, method, url string, hdr ...string) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	return req
}

// lockTokenOf acquires another lock and returns its lock token: a
// well-formed token that holds nothing on "orders". The log must never show
// it, or any other lock token.
func lockTokenOf(t *testing.T, url string) string {
	t.Helper()
	req := mustRequest(t, http.MethodPost, url+"/v1/locks/other")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var g api.LockResponse
	if err := json.NewDecoder(resp.Body).Decode(&g); err != nil || g.LockToken == "" {
		t.Fatalf("acquire other = %d %v", resp.StatusCode, err)
	}
	return g.LockToken
}
