package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/redfence/redfence/internal/apikey"
	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/store"
)

// runScript runs script with sh and returns its output.
func runScript(t *testing.T, script string, env ...string) string {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), "sh", "-c", script)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("sh: %v\nscript:\n%s\noutput:\n%s", err, script, out)
	}
	return string(out)
}

// wantInOrder checks that out contains each of want, in this order.
func wantInOrder(t *testing.T, what, out string, want ...string) {
	t.Helper()
	rest := out
	for _, w := range want {
		i := strings.Index(rest, w)
		if i < 0 {
			t.Errorf("%s: output lacks %q (after the earlier matches):\n%s", what, w, out)
			return
		}
		rest = rest[i+len(w):]
	}
}

// TestDev_Walkthrough runs the curl walkthrough that `redfence dev` prints,
// and the one in README.md, against a server with access control, as
// printed.
func TestDev_Walkthrough(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("curl"); err != nil {
		t.Skip("curl is not installed; the walkthrough needs it")
	}
	nodes := clustertest.Redis(t, 3, cluster.RedisOptions{})
	cfg := testConfig(t, addrs(nodes), clustertest.Database(t))
	cfg.Auth = true
	s, _ := open(t, cfg, discard)

	t.Run("Banner", func(t *testing.T) {
		key, err := s.devKey(t.Context(), false)
		if err != nil {
			t.Fatal(err)
		}
		banner := walkthrough(s.URL(), cfg, key, "/opt/redfence/bin/redfence")
		_, script, ok := strings.Cut(banner, "Try it (in another terminal):\n")
		script, _, ok2 := strings.Cut(script, "\n  API:")
		if !ok || !ok2 || !strings.Contains(script, "KEY="+key) {
			t.Fatalf("the banner has no walkthrough with the key:\n%s", banner)
		}
		out := runScript(t, script)
		wantInOrder(t, "dev walkthrough", out,
			`"fencing_token":1`, `"owner":"alice"`,
			`"data":{"total":42}`,
			`"held":true`,
			`"fencing_token":1,"ttl_ms":30000`,
			"204",
			`"fencing_token":2`, `"owner":"bob"`,
			`"type":"urn:redfence:problem:stale-token"`,
			`"type":"urn:redfence:problem:unauthorized"`, "401")
		if !strings.Contains(banner, "/opt/redfence/bin/redfence keys create") {
			t.Errorf("the banner's keys command does not run this binary:\n%s", banner)
		}
		if off := walkthrough(s.URL(), cfg, "", "/opt/redfence/bin/redfence"); !strings.Contains(off, "AUTHENTICATION IS OFF") || strings.Contains(off, "Authorization") {
			t.Errorf("the banner without a key does not warn, or still sends a key:\n%s", off)
		}
	})

	t.Run("README", func(t *testing.T) {
		readme, err := os.ReadFile("../../README.md")
		if err != nil {
			t.Fatal(err)
		}
		_, rest, ok := strings.Cut(string(readme), "## A walkthrough with curl")
		_, rest, ok2 := strings.Cut(rest, "```sh\n")
		script, _, ok3 := strings.Cut(rest, "```")
		if !ok || !ok2 || !ok3 {
			t.Fatal("README.md has no sh block under \"## A walkthrough with curl\"")
		}
		const rf = "RF=http://127.0.0.1:8080\n"
		if !strings.HasPrefix(script, rf) {
			t.Fatalf("the README walkthrough does not start with %q:\n%s", rf, script)
		}
		// The reader pastes the KEY= line redfence dev printed; the server
		// runs elsewhere. Another tenant keeps it apart from the banner's run.
		key, _, err := s.db.CreateKey(t.Context(), "readme", []string{"locks", "resources"})
		if err != nil {
			t.Fatal(err)
		}
		out := runScript(t, "RF="+s.URL()+"\n"+strings.TrimPrefix(script, rf), "KEY="+key)
		wantInOrder(t, "README walkthrough", out,
			`"fencing_token":1`, `"owner":"alice"`,
			`"data":{"total":42}`,
			`"held":true`,
			`"fencing_token":1,"ttl_ms":30000`,
			"204",
			`"fencing_token":2`, `"owner":"bob"`,
			`"type":"urn:redfence:problem:stale-token"`,
			`"type":"urn:redfence:problem:unauthorized"`, "401")
	})
}

// TestDev_KeyRevokedOnSharedDatabase: the key redfence dev creates in a
// database it did not start (one that outlives it) is revoked when it stops,
// so no key with every scope is left behind; in its own throwaway database
// it is not.
func TestDev_KeyRevokedOnSharedDatabase(t *testing.T) {
	t.Parallel()
	nodes := clustertest.Redis(t, 3, cluster.RedisOptions{})
	url := clustertest.Database(t)
	cfg := testConfig(t, addrs(nodes), url)
	cfg.Auth = true
	for _, revoke := range []bool{false, true} {
		s, closeFn := open(t, cfg, discard)
		key, err := s.devKey(t.Context(), revoke)
		if err != nil {
			t.Fatal(err)
		}
		id, _ := apikey.ParseID(key)
		if err := closeFn(t.Context()); err != nil {
			t.Fatal(err)
		}
		db, err := store.Open(t.Context(), url, store.Options{})
		if err != nil {
			t.Fatal(err)
		}
		keys, err := db.Keys(t.Context())
		db.Close()
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, k := range keys {
			if k.ID != id {
				continue
			}
			found = true
			if k.RevokedAt.IsZero() == revoke {
				t.Errorf("revoke %v: dev's key after close: revoked at %v", revoke, k.RevokedAt)
			}
		}
		if !found {
			t.Errorf("revoke %v: dev's key %s is not in the database", revoke, id)
		}
	}
}

// TestDev_InterruptedWhileStarting: Ctrl-C while the local servers start
// ends redfence dev quietly with status 130, not with the error of the
// start that the signal cut short.
func TestDev_InterruptedWhileStarting(t *testing.T) {
	t.Setenv("REDFENCE_REDIS_ADDRS", "")
	t.Setenv("REDFENCE_DATABASE_URL", "")
	t.Setenv("REDFENCE_LOG_FORMAT", "text") // restored after: cmdDev sets it when unset
	ctx, cancel := context.WithCancel(t.Context())
	cancel() // the signal came first
	var stdout, stderr bytes.Buffer
	err := cmdDev(ctx, []string{"--addr", "127.0.0.1:0"}, &stdout, &stderr)
	var ee *exitError
	if !errors.As(err, &ee) || ee.code != 130 || !strings.Contains(stderr.String(), "interrupted while starting") {
		t.Errorf("cmdDev after Ctrl-C = %v, stderr %q; want exit status 130 and one line", err, stderr.String())
	}
}

// TestDevAddr: dev listens on --addr when given, else on
// REDFENCE_LISTEN_ADDR when set, else on loopback.
func TestDevAddr(t *testing.T) {
	t.Parallel()
	env := func(v string) func(string) (string, bool) {
		return func(k string) (string, bool) {
			if k == "REDFENCE_LISTEN_ADDR" && v != "" {
				return v, true
			}
			return "", false
		}
	}
	for _, tc := range []struct {
		args []string
		env  string
		want string
	}{
		{nil, "", "127.0.0.1:8080"},
		{nil, "127.0.0.1:9191", "127.0.0.1:9191"},
		{[]string{"--addr", "127.0.0.1:9292"}, "127.0.0.1:9191", "127.0.0.1:9292"},
		{[]string{"--addr", "127.0.0.1:8080"}, "127.0.0.1:9191", "127.0.0.1:8080"},
	} {
		fs := flag.NewFlagSet("dev", flag.ContinueOnError)
		addr := fs.String("addr", devDefaultAddr, "")
		if err := fs.Parse(tc.args); err != nil {
			t.Fatal(err)
		}
		if got := devAddr(fs, *addr, env(tc.env)); got != tc.want {
			t.Errorf("devAddr(%q, REDFENCE_LISTEN_ADDR=%q) = %q; want %q", tc.args, tc.env, got, tc.want)
		}
	}
}

// TestDevRateLimit: dev limits no key's rate unless REDFENCE_RATE_LIMIT is
// set, even to serve's default.
func TestDevRateLimit(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		env  map[string]string
		rate float64 // as loaded from the environment
		want float64
	}{
		{nil, 100, 0},
		{map[string]string{"REDFENCE_RATE_LIMIT": "100"}, 100, 100},
		{map[string]string{"REDFENCE_RATE_LIMIT": "5"}, 5, 5},
		{map[string]string{"REDFENCE_RATE_BURST": "10"}, 100, 0},
	} {
		cfg := &Config{RateLimit: tc.rate}
		devRateLimit(cfg, func(k string) (string, bool) { v, ok := tc.env[k]; return v, ok })
		if cfg.RateLimit != tc.want {
			t.Errorf("devRateLimit with %v: RateLimit = %v; want %v", tc.env, cfg.RateLimit, tc.want)
		}
	}
}

// TestDev_OrphanKeysRevoked: redfence dev on a shared database records
// itself as its key's creator, and at start revokes the active keys that a
// redfence dev of this host created and that outlived it (killed with
// SIGKILL, it could not revoke its own); not those of a live process, of
// another host, or made to last.
func TestDev_OrphanKeysRevoked(t *testing.T) {
	t.Parallel()
	nodes := clustertest.Redis(t, 3, cluster.RedisOptions{})
	url := clustertest.Database(t)
	cfg := testConfig(t, addrs(nodes), url)
	cfg.Auth = true
	s, _ := open(t, cfg, discard)
	host, err := cluster.OwnerHost()
	if err != nil {
		t.Fatal(err)
	}

	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	live := exec.Command("cat") // runs until its stdin closes
	stdin, err := live.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := live.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stdin.Close(); _ = live.Wait() })

	ctx := t.Context()
	create := func(c *store.KeyCreator) string {
		t.Helper()
		var k *store.APIKey
		var err error
		if c == nil {
			_, k, err = s.db.CreateKey(ctx, "dev", apikey.AllScopes())
		} else {
			_, k, err = s.db.CreateProcessKey(ctx, "dev", apikey.AllScopes(), *c)
		}
		if err != nil {
			t.Fatal(err)
		}
		return k.ID
	}
	deadKey := create(&store.KeyCreator{Host: host, PID: dead.Process.Pid})
	liveKey := create(&store.KeyCreator{Host: host, PID: live.Process.Pid})
	elsewhere := create(&store.KeyCreator{Host: "another-host", PID: dead.Process.Pid})
	lasting := create(nil)

	key, err := s.devKey(ctx, true)
	if err != nil {
		t.Fatal(err)
	}
	own, _ := apikey.ParseID(key)
	want := map[string]bool{deadKey: true, liveKey: false, elsewhere: false, lasting: false, own: false}
	keys, err := s.db.Keys(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if revoked, ok := want[k.ID]; ok && k.Revoked() != revoked {
			t.Errorf("key %s: revoked %v; want %v (dead %s, live %s, another host's %s, lasting %s, dev's own %s)",
				k.ID, k.Revoked(), revoked, deadKey, liveKey, elsewhere, lasting, own)
		}
	}

	// dev's own key names this process: once it is gone (here: said to
	// be), the next dev revokes it.
	orphans, err := s.db.RevokeOrphanKeys(ctx, host, func(pid int) bool { return pid == os.Getpid() })
	if err != nil || len(orphans) != 1 || orphans[0].ID != own {
		t.Errorf("RevokeOrphanKeys for this process = %v, %v; want dev's key %s", orphans, err, own)
	}
}

// TestRedactURL: the banner of redfence dev shows the database URL without
// its passwords: the user's and an encrypted client key's (sslpassword).
func TestRedactURL(t *testing.T) {
	t.Parallel()
	const pw = "s3cr3tPW"
	for _, u := range []string{
		"postgres://u:" + pw + "@db:5432/x",
		"postgres://u@db/x?password=" + pw,
		"postgres://u@db/x?sslmode=verify-full&sslkey=/k.pem&sslcert=/c.pem&sslpassword=" + pw,
		"host=db user=u password=" + pw,
		"host=db user=u sslmode=verify-full sslkey=/k.pem sslcert=/c.pem sslpassword=" + pw,
	} {
		if got := redactURL(u); strings.Contains(got, pw) {
			t.Errorf("redactURL(%q) = %q; want it without the password", u, got)
		}
	}
	if u := "postgres://u@db:5432/x?sslmode=disable"; redactURL(u) != u {
		t.Errorf("redactURL(%q) = %q; want it unchanged", u, redactURL(u))
	}
}
