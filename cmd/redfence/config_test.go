package main

import (
	"fmt"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestUnknownSettings: a REDFENCE_* variable nothing reads (a typo) is
// reported; every setting, and the client's and tooling's variables, are
// not.
func TestUnknownSettings(t *testing.T) {
	t.Parallel()
	env := []string{"REDFENCE_MAXTTL=5s", "REDFENCE_MAX_TTL=5s", "REDFENCE_SERVER=http://x", "REDFENCE_API_KEY=k",
		"REDFENCE_REDIS_TLS_CA_FILE=/ca", "REDFENCE_ACCESS_LOG=false", "PATH=/bin", "REDFENCE_LOG_LEVL=debug", "REDFENCE_FENCING_TOKEN=3"}
	if got := unknownSettings(env); !slices.Equal(got, []string{"REDFENCE_LOG_LEVL", "REDFENCE_MAXTTL"}) {
		t.Errorf("unknownSettings = %q; want the two typos", got)
	}
	var help strings.Builder
	printSettings(&help)
	var all []string
	for line := range strings.Lines(help.String()) {
		if k, _, _ := strings.Cut(line, " "); strings.HasPrefix(k, "REDFENCE_") {
			all = append(all, k+"=x")
		}
	}
	if len(all) < 30 {
		t.Fatalf("only %d settings in the help:\n%s", len(all), help.String())
	}
	if got := unknownSettings(all); len(got) != 0 {
		t.Errorf("settings reported unknown: %q", got)
	}
}

// cleanEnv unsets every REDFENCE_* variable for the test (restored after).
func cleanEnv(t *testing.T) {
	t.Helper()
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); strings.HasPrefix(k, "REDFENCE_") {
			t.Setenv(k, "")
			os.Unsetenv(k)
		}
	}
}

// TestLoadConfig_Rejects: a setting that passes parsing but is no usable
// value (NaN or an infinity for a number, an empty listen address) fails
// loadConfig with one line naming it, as other bad values do.
func TestLoadConfig_Rejects(t *testing.T) {
	var floats []string
	typ := reflect.TypeFor[Config]()
	for i := range typ.NumField() {
		if typ.Field(i).Type.Kind() == reflect.Float64 {
			floats = append(floats, envName(typ.Field(i)))
		}
	}
	if len(floats) < 2 {
		t.Fatalf("float settings: %q; want REDFENCE_DRIFT_FACTOR and REDFENCE_RATE_LIMIT at least", floats)
	}
	type tc struct{ env, value, want string }
	var cases []tc
	for _, name := range floats {
		for _, v := range []string{"NaN", "nan", "Inf", "+Inf", "-Inf", "infinity"} {
			cases = append(cases, tc{name, v, name + " (" + fmt.Sprint(mustFloat(t, v)) + ") must be a finite number"})
		}
	}
	cases = append(cases, tc{"REDFENCE_LISTEN_ADDR", "", "REDFENCE_LISTEN_ADDR is empty"})
	for _, c := range cases {
		t.Run(c.env+"="+c.value, func(t *testing.T) {
			cleanEnv(t)
			t.Setenv(c.env, c.value)
			cfg, err := loadConfig()
			if err == nil || !strings.HasPrefix(err.Error(), c.want) || strings.Contains(err.Error(), "\n") {
				t.Errorf("loadConfig with %s=%q = %+v, %v; want one line starting %q", c.env, c.value, cfg, err, c.want)
			}
		})
	}
	t.Run("Defaults", func(t *testing.T) {
		cleanEnv(t)
		if _, err := loadConfig(); err != nil {
			t.Errorf("loadConfig with no settings = %v", err)
		}
	})
}

func mustFloat(t *testing.T, s string) float64 {
	t.Helper()
	f, err := strconv.ParseFloat(s, 64)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// TestStoreOptions: the store gets the settings it enforces,
// REDFENCE_ISSUE_TIMEOUT among them. (Found by fault injection: it was left
// at the store's default, 10 s, so under REDFENCE_ISSUE_TIMEOUT=30s a grant
// waiting for a held row was given up after 10 s.)
func TestStoreOptions(t *testing.T) {
	t.Parallel()
	c := &Config{DBMaxConns: 7, DBDocMaxConns: 3, StatementTimeout: 4 * time.Second, IssueTimeout: 30 * time.Second}
	got := c.storeOptions(nil, true)
	if got.MaxConns != 7 || got.DocMaxConns != 3 || got.StatementTimeout != 4*time.Second || got.IssueTimeout != 30*time.Second || !got.Unfenced {
		t.Errorf("storeOptions = %+v; want the pools' sizes, both timeouts and Unfenced from the settings", got)
	}
}
