package main

import (
	"slices"
	"strings"
	"testing"
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
