package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/redfence/redfence/internal/apikey"

	"github.com/redfence/redfence/api"
	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/internal/testutil"
	"github.com/redfence/redfence/store"
)

// keyDB opens the store at url for creating and revoking keys in a test.
func keyDB(t testing.TB, url string, log *slog.Logger) *store.DB {
	t.Helper()
	db, err := store.Open(t.Context(), url, store.Options{Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	if _, err := db.Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}
	return db
}

// createKey creates an API key and returns it with its id.
func createKey(t testing.TB, db *store.DB, tenant string, scopes ...string) (key, id string) {
	t.Helper()
	key, k, err := db.CreateKey(t.Context(), tenant, scopes)
	if err != nil {
		t.Fatal(err)
	}
	return key, k.ID
}

func auth(key string) []string { return []string{"Authorization", "Bearer " + key} }

// TestAuth_RevocationAcrossServers runs two servers on one database, each
// with a key cached for an hour, revokes the key and waits until both
// refuse it: only the Postgres notification can have told them.
func TestAuth_RevocationAcrossServers(t *testing.T) {
	t.Parallel()
	nodes := clustertest.Redis(t, 3, cluster.RedisOptions{})
	url := clustertest.Database(t)
	var servers [2]*Server
	for i := range servers {
		cfg := testConfig(t, addrs(nodes), url)
		cfg.Auth = true
		cfg.AuthCacheTTL = time.Hour
		servers[i], _ = open(t, cfg, discard)
	}
	db := keyDB(t, url, discard)
	key, id := createKey(t, db, "acme", apikey.AllScopes()...)
	for i, s := range servers {
		expect(t, fmt.Sprintf("GET on server %d with the key", i), call(t, http.MethodGet, s.Addr(), "/v1/locks/x", "", auth(key)...), http.StatusOK, nil)
	}

	revoked := time.Now()
	if _, err := db.RevokeKey(t.Context(), id); err != nil {
		t.Fatal(err)
	}
	for i, s := range servers {
		testutil.WaitFor(t, waitTimeout, fmt.Sprintf("server %d to refuse the revoked key", i), func() (bool, error) {
			return call(t, http.MethodGet, s.Addr(), "/v1/locks/x", "", auth(key)...).status == http.StatusUnauthorized, nil
		})
	}
	// Informational: the bound that matters is REDFENCE_AUTH_CACHE_TTL (1s by
	// default), which applies even when a notification is lost.
	t.Logf("both servers refused the key %v after the revocation committed", time.Since(revoked))

	// A key created now works on both at once.
	key2, _ := createKey(t, db, "acme", apikey.ScopeLocks)
	for i, s := range servers {
		expect(t, fmt.Sprintf("GET on server %d with a new key", i), call(t, http.MethodGet, s.Addr(), "/v1/locks/x", "", auth(key2)...), http.StatusOK, nil)
	}
}

// TestAuth_NoSecretsInLogs captures every log line of a full run with access
// control (debug level) and checks that no API key, no key secret and no
// lock token appears in any of them.
func TestAuth_NoSecretsInLogs(t *testing.T) {
	t.Parallel()
	nodes := clustertest.Redis(t, 3, cluster.RedisOptions{})
	url := clustertest.Database(t)
	var logs testutil.Buffer
	log := slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	cfg := testConfig(t, addrs(nodes), url)
	cfg.Auth = true
	cfg.RateLimit, cfg.RateBurst = 0.001, 20
	s, closeFn := open(t, cfg, log)
	addr := s.Addr()
	db := keyDB(t, url, log)

	a, aID := createKey(t, db, "acme", apikey.AllScopes()...)
	b, _ := createKey(t, db, "beta", apikey.ScopeLocks)
	noisy, _ := createKey(t, db, "noisy", apikey.ScopeLocks)
	revoked, revokedID := createKey(t, db, "acme", apikey.AllScopes()...)
	if _, err := db.RevokeKey(t.Context(), revokedID); err != nil {
		t.Fatal(err)
	}
	apiKeys := []string{a, b, noisy, revoked}
	var lockTokens []string
	hdr := func(key string, more ...string) []string { return append(auth(key), more...) }

	g := acquireAs(t, addr, a, "s")
	lockTokens = append(lockTokens, g.LockToken)
	expect(t, "extend", call(t, http.MethodPost, addr, "/v1/locks/s/extend", `{"ttl_ms":20000}`, hdr(a, api.LockTokenHeader, g.LockToken)...), http.StatusOK, nil)
	expect(t, "status", call(t, http.MethodGet, addr, "/v1/locks/s", "", hdr(a)...), http.StatusOK, nil)
	expect(t, "put", call(t, http.MethodPut, addr, "/v1/resources/s", fmt.Sprintf(`{"fencing_token":%d,"data":{"v":1}}`, g.FencingToken), hdr(a)...), http.StatusOK, nil)
	expect(t, "get resource", call(t, http.MethodGet, addr, "/v1/resources/s", "", hdr(a)...), http.StatusOK, nil)
	expect(t, "nodes", call(t, http.MethodGet, addr, "/v1/nodes", "", hdr(a)...), http.StatusOK, nil)
	expect(t, "metrics", call(t, http.MethodGet, addr, "/metrics", "", hdr(a)...), http.StatusOK, nil)
	// Another tenant with a's lock token: as if the lock did not exist.
	expect(t, "release by another tenant", call(t, http.MethodDelete, addr, "/v1/locks/s", "", hdr(b, api.LockTokenHeader, g.LockToken)...), http.StatusConflict, nil)
	expect(t, "missing scope", call(t, http.MethodGet, addr, "/v1/resources/s", "", hdr(b)...), http.StatusForbidden, nil)
	expect(t, "release", call(t, http.MethodDelete, addr, "/v1/locks/s", "", hdr(a, api.LockTokenHeader, g.LockToken)...), http.StatusNoContent, nil)
	expect(t, "release again", call(t, http.MethodDelete, addr, "/v1/locks/s", "", hdr(a, api.LockTokenHeader, g.LockToken)...), http.StatusConflict, nil)
	// Keys that grant nothing.
	wrong := a[:len(a)-43] + strings.Repeat("Z", 43)
	for what, h := range map[string][]string{
		"revoked key":   auth(revoked),
		"wrong secret":  auth(wrong),
		"unknown key":   auth(apikey.Prefix + "0123456789abcdef_" + a[len(a)-43:]),
		"malformed key": auth("x" + a),
		"key as Basic":  {"Authorization", "Basic " + a},
		"two keys":      {"Authorization", "Bearer " + a, "Authorization", "Bearer " + b},
		"no key":        {api.LockTokenHeader, g.LockToken},
	} {
		expect(t, what, call(t, http.MethodGet, addr, "/v1/locks/s", "", h...), http.StatusUnauthorized, nil)
	}
	apiKeys = append(apiKeys, wrong)
	// A noisy key runs into its rate limit.
	limited := false
	for range 25 {
		if call(t, http.MethodGet, addr, "/v1/locks/n", "", hdr(noisy)...).status == http.StatusTooManyRequests {
			limited = true
			break
		}
	}
	if !limited {
		t.Error("the noisy key was never rate limited")
	}
	g2 := acquireAs(t, addr, a, "s")
	lockTokens = append(lockTokens, g2.LockToken)
	if _, err := db.RevokeKey(t.Context(), aID); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, waitTimeout, "the revocation to apply", func() (bool, error) {
		return call(t, http.MethodGet, addr, "/v1/locks/s", "", hdr(a)...).status == http.StatusUnauthorized, nil
	})

	ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
	defer cancel()
	if err := closeFn(ctx); err != nil {
		t.Fatalf("Close: %v", err)
	}

	text := logs.String()
	if n := strings.Count(text, `"msg":"http request"`); n < 30 {
		t.Fatalf("captured %d access log lines; want at least 30 (is the logger wired?):\n%s", n, text)
	}
	if !strings.Contains(text, `"key_id":"`+aID+`"`) {
		t.Errorf("no log line names key_id %s (who acted); logs:\n%s", aID, text)
	}
	for _, k := range apiKeys {
		for _, secret := range []string{k, k[len(k)-43:]} {
			if strings.Contains(text, secret) {
				t.Errorf("the log contains API key material %q", secret)
			}
		}
	}
	for _, tok := range lockTokens {
		if strings.Contains(text, tok) {
			t.Errorf("the log contains lock token %q", tok)
		}
	}
}

// acquireAs takes the lock name with key.
func acquireAs(t testing.TB, addr, key, name string) api.LockResponse {
	t.Helper()
	var g api.LockResponse
	expect(t, "acquire "+name, call(t, http.MethodPost, addr, "/v1/locks/"+name, `{"ttl_ms":30000}`, auth(key)...), http.StatusCreated, &g)
	return g
}

// TestRun_Keys runs the keys commands. It sets the environment, so it cannot
// run in parallel.
func TestRun_Keys(t *testing.T) {
	t.Setenv("REDFENCE_DATABASE_URL", clustertest.Database(t))
	keys := func(args ...string) (string, string, error) {
		t.Helper()
		var stdout, stderr bytes.Buffer
		err := run(t.Context(), append([]string{"keys"}, args...), &stdout, &stderr)
		return stdout.String(), stderr.String(), err
	}

	out, errOut, err := keys("create", "--tenant", "acme", "--scope", "admin,locks")
	if err != nil {
		t.Fatalf("keys create = %v (stderr %s)", err, errOut)
	}
	acme := strings.TrimSpace(out)
	acmeID, ok := apikey.ParseID(acme)
	if !ok || strings.Count(out, "\n") != 1 {
		t.Fatalf("keys create printed %q; want one line, the key", out)
	}
	if !strings.Contains(errOut, acmeID) || strings.Contains(errOut, acme) {
		t.Errorf("keys create stderr = %q; want the key's id and not the key", errOut)
	}
	out, _, err = keys("create", "--tenant", "beta", "--scope", "admin", "--scope", "resources") // repeated: they add up
	if err != nil {
		t.Fatal(err)
	}
	beta := strings.TrimSpace(out)
	betaID, _ := apikey.ParseID(beta)
	out, _, err = keys("create", "--tenant", "gamma") // the default scopes
	if err != nil {
		t.Fatal(err)
	}
	gamma := strings.TrimSpace(out)
	gammaID, _ := apikey.ParseID(gamma)
	// A key pasted as the tenant: refused, and not echoed (a tenant is
	// logged with every request of its keys).
	if _, errOut, err := keys("create", "--tenant", gamma); !errors.Is(err, errUsage) ||
		strings.Contains(errOut, gamma[len(gamma)-20:]) || !strings.Contains(errOut, "must not hold an API key") {
		t.Errorf("keys create --tenant <key> = %v, stderr %q; want errUsage saying a tenant holds no key, without its secret", err, errOut)
	}

	list := func() [][]string {
		t.Helper()
		out, errOut, err := keys("list")
		if err != nil {
			t.Fatalf("keys list = %v (stderr %s)", err, errOut)
		}
		if strings.Contains(out, acme[len(acme)-43:]) || strings.Contains(out, beta[len(beta)-43:]) {
			t.Errorf("keys list shows a secret:\n%s", out)
		}
		var rows [][]string
		for line := range strings.Lines(out) {
			rows = append(rows, strings.Fields(line))
		}
		return rows
	}
	rows := list()
	want := [][]string{{acmeID, "acme", "locks,admin", "", "-"}, {betaID, "beta", "resources,admin", "", "-"}, {gammaID, "gamma", "locks,resources", "", "-"}}
	if len(rows) != len(want) {
		t.Fatalf("keys list = %q; want %d lines", rows, len(want))
	}
	for i, w := range want {
		r := rows[i]
		if len(r) != 5 || r[0] != w[0] || r[1] != w[1] || r[2] != w[2] || r[4] != w[4] {
			t.Errorf("keys list line %d = %q; want %q (id, tenant, scopes, created, revoked)", i, r, w)
			continue
		}
		if _, err := time.Parse(time.RFC3339, r[3]); err != nil {
			t.Errorf("keys list line %d: created %q is not RFC 3339", i, r[3])
		}
	}

	out, _, err = keys("revoke", acmeID)
	if err != nil || !strings.HasPrefix(out, "revoked "+acmeID) {
		t.Errorf("keys revoke %s = %q, %v; want \"revoked %s ...\"", acmeID, out, err, acmeID)
	}
	// The whole key works as well as its id.
	if out, _, err = keys("revoke", beta); err != nil || !strings.HasPrefix(out, "revoked "+betaID) {
		t.Errorf("keys revoke <key> = %q, %v; want \"revoked %s ...\"", out, err, betaID)
	}
	for i, r := range list()[:2] { // acme and beta; gamma stays active
		if _, err := time.Parse(time.RFC3339, r[len(r)-1]); err != nil {
			t.Errorf("keys list line %d after revoking = %q; want a revocation time last", i, r)
		}
	}

	for _, tc := range []struct {
		name string
		args []string
	}{
		{"NoSubcommand", nil},
		{"UnknownSubcommand", []string{"rotate"}},
		{"NoTenant", []string{"create"}},
		{"BadTenant", []string{"create", "--tenant", "a/b"}},
		{"BadScope", []string{"create", "--tenant", "acme", "--scope", "locks,root"}},
		{"RevokeNoID", []string{"revoke"}},
		{"RevokeTwoIDs", []string{"revoke", acmeID, betaID}},
	} {
		if _, _, err := keys(tc.args...); !errors.Is(err, errUsage) {
			t.Errorf("%s: keys %q = %v; want errUsage", tc.name, tc.args, err)
		}
	}
	if _, _, err := keys("revoke", "0000000000000000"); err == nil || !strings.Contains(err.Error(), "0000000000000000") {
		t.Errorf("keys revoke <unknown id> = %v; want an error naming the id", err)
	}
	// A key mistyped or cut short is refused without being echoed, and
	// revokes nothing; one pasted with spaces around it is the key.
	for _, arg := range []string{gamma + "x", gamma[:len(gamma)-1], "Bearer " + gamma} {
		_, errOut, err := keys("revoke", arg)
		if !errors.Is(err, errUsage) || strings.Contains(errOut, gamma[len(gamma)-20:]) || !strings.Contains(errOut, gammaID) {
			t.Errorf("keys revoke <near key> = %v, stderr %q; want errUsage naming key id %s, without its secret", err, errOut, gammaID)
		}
	}
	if rows := list(); rows[2][len(rows[2])-1] != "-" {
		t.Errorf("keys list after near-key revokes = %q; want gamma still active", rows[2])
	}
	if out, _, err := keys("revoke", " "+gamma+"\n"); err != nil || !strings.HasPrefix(out, "revoked "+gammaID) {
		t.Errorf("keys revoke <key with spaces> = %q, %v; want \"revoked %s ...\"", out, err, gammaID)
	}
	if out, _, err := keys("-h"); err != nil || !strings.Contains(out, "keys create") {
		t.Errorf("keys -h = %q, %v; want the help", out, err)
	}
	t.Setenv("REDFENCE_DATABASE_URL", "")
	if _, _, err := keys("list"); err == nil || !strings.Contains(err.Error(), "REDFENCE_DATABASE_URL") {
		t.Errorf("keys list without a URL = %v; want an error naming REDFENCE_DATABASE_URL", err)
	}
}

func TestConfig_Security(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		change func(*Config)
		want   string // in the error; "" for none
	}{
		{"Defaults", func(*Config) {}, ""},
		{"AuthOff", func(c *Config) { c.Auth = false }, ""},
		{"NoRateLimit", func(c *Config) { c.RateLimit, c.RateBurst = 0, 0 }, ""},
		{"NegativeRate", func(c *Config) { c.RateLimit = -1 }, "REDFENCE_RATE_LIMIT"},
		{"ZeroBurst", func(c *Config) { c.RateBurst = 0 }, "REDFENCE_RATE_BURST"},
		{"ZeroCacheTTL", func(c *Config) { c.AuthCacheTTL = 0 }, "REDFENCE_AUTH_CACHE_TTL"},
		{"CertWithoutKey", func(c *Config) { c.TLSCertFile = "c.pem" }, "REDFENCE_TLS_KEY_FILE"},
		{"ClientCAWithoutCert", func(c *Config) { c.TLSClientCAFile = "ca.pem" }, "REDFENCE_TLS_CLIENT_CA_FILE"},
		{"RedisCAWithoutTLS", func(c *Config) { c.RedisTLSCAFile = "ca.pem" }, "REDFENCE_REDIS_TLS=true"},
		{"RedisCertWithoutKey", func(c *Config) { c.RedisTLS, c.RedisTLSCertFile = true, "c.pem" }, "REDFENCE_REDIS_TLS_KEY_FILE"},
		{"RedisAddrs", func(c *Config) { c.RedisAddrs = []string{" 10.0.0.1:6379", "redis-2:6380", "[::1]:6379"} }, ""},
		{"RedisAddrEmpty", func(c *Config) { c.RedisAddrs = []string{"10.0.0.1:6379", ""} }, "REDFENCE_REDIS_ADDRS"},
		{"RedisAddrNoPort", func(c *Config) { c.RedisAddrs = []string{"redis-1"} }, "REDFENCE_REDIS_ADDRS"},
		{"RedisAddrBadPort", func(c *Config) { c.RedisAddrs = []string{"redis-1:http"} }, "REDFENCE_REDIS_ADDRS"},
		{"RedisAddrPortRange", func(c *Config) { c.RedisAddrs = []string{"redis-1:99999"} }, "REDFENCE_REDIS_ADDRS"},
		{"RedisAddrPortZero", func(c *Config) { c.RedisAddrs = []string{"redis-1:0"} }, "REDFENCE_REDIS_ADDRS"},
		{"NegativeDBConns", func(c *Config) { c.DBMaxConns = -3 }, "REDFENCE_DB_MAX_CONNS"},
		{"NegativeDocConns", func(c *Config) { c.DBDocMaxConns = -1 }, "REDFENCE_DB_DOC_MAX_CONNS"},
		{"ZeroBody", func(c *Config) { c.MaxBodyBytes = 0 }, "REDFENCE_MAX_BODY_BYTES"},
		{"ZeroHeaders", func(c *Config) { c.MaxHeaderBytes = 0 }, "REDFENCE_MAX_HEADER_BYTES"},
		{"NegativeReadTimeout", func(c *Config) { c.ReadTimeout = -time.Second }, "REDFENCE_READ_TIMEOUT"},
		{"ZeroStoreTimeout", func(c *Config) { c.StoreTimeout = 0 }, "REDFENCE_STORE_TIMEOUT"},
		{"NegativeShutdown", func(c *Config) { c.ShutdownTimeout = -time.Second }, "REDFENCE_SHUTDOWN_TIMEOUT"},
		{"ZeroShutdown", func(c *Config) { c.ShutdownTimeout = 0 }, ""},
		{"MaxTTLDay", func(c *Config) { c.MaxTTL = 24 * time.Hour }, ""},
		{"MaxTTLAboveDay", func(c *Config) { c.MaxTTL = 24*time.Hour + time.Millisecond }, "REDFENCE_MAX_TTL"},
		{"MaxWaitDay", func(c *Config) { c.MaxWait = 24 * time.Hour }, ""},
		{"MaxWaitAboveDay", func(c *Config) { c.MaxWait = 48 * time.Hour }, "REDFENCE_MAX_WAIT"},
		{"NegativeMaxWait", func(c *Config) { c.MaxWait = -time.Second }, "REDFENCE_MAX_WAIT"},
		{"ZeroDrift", func(c *Config) { c.DriftFactor = 0 }, "REDFENCE_DRIFT_FACTOR"},
		{"HalfDrift", func(c *Config) { c.DriftFactor = 0.5 }, "REDFENCE_DRIFT_FACTOR"},
		{"SmallDrift", func(c *Config) { c.DriftFactor = 0.001 }, ""},
		{"TwoErrors", func(c *Config) { c.MaxBodyBytes, c.DBMaxConns = 0, -1 }, "2 invalid settings:\n  REDFENCE_DB_MAX_CONNS"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := testConfig(t, nil, "")
			c.Auth = true
			tc.change(c)
			err := c.validate()
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("validate = %v; want nil", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("validate = %v; want an error naming %s", err, tc.want)
			}
		})
	}
}

// TestLoadConfig_ParseError: a value of the wrong type is named with the
// variable and what it takes, not envconfig's Go field and type names.
func TestLoadConfig_ParseError(t *testing.T) {
	t.Setenv("REDFENCE_MAX_TTL", "abc")
	_, err := loadConfig()
	if err == nil || err.Error() != `REDFENCE_MAX_TTL="abc": want a duration such as 500ms, 30s or 2m` {
		t.Errorf("loadConfig with REDFENCE_MAX_TTL=abc = %v", err)
	}
}

// TestConfig_RedisAddrWithCredentials: a Redis URL, or any entry with a
// user or password in it, is refused without quoting it (the error is
// logged), and a password@host:port that splits as host:port is refused
// too rather than logged, labelled and shown as a node's address.
func TestConfig_RedisAddrWithCredentials(t *testing.T) {
	t.Parallel()
	const pw = "s3cr3tRedisPW"
	for _, addr := range []string{
		"redis://:" + pw + "@10.0.0.1:6379",
		"rediss://redfence:" + pw + "@redis-1:6380/0",
		"redfence:" + pw + "@redis-1:6379",
		pw + "@10.0.0.1:6379",
		"redis-1:6379?password=" + pw,
	} {
		c := testConfig(t, nil, "")
		c.RedisAddrs = []string{"10.0.0.2:6379", addr}
		err := c.validate()
		if err == nil {
			t.Errorf("validate with REDFENCE_REDIS_ADDRS entry %q = nil; want an error", addr)
			continue
		}
		if msg := err.Error(); strings.Contains(msg, pw) || !strings.Contains(msg, "REDFENCE_REDIS_ADDRS: entry 2") ||
			!strings.Contains(msg, "REDFENCE_REDIS_PASSWORD") {
			t.Errorf("validate with REDFENCE_REDIS_ADDRS entry %q = %q; want entry 2 named, REDFENCE_REDIS_PASSWORD advised, the password not quoted", addr, msg)
		}
	}
	c := testConfig(t, nil, "")
	c.RedisAddrs = []string{"redis-1:http"}
	if err := c.validate(); err == nil || !strings.Contains(err.Error(), `"redis-1:http" is not host:port`) {
		t.Errorf("validate with a bad port = %v; want the entry quoted", err)
	}
}
