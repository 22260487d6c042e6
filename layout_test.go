package redfence_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestLayout checks that dependencies point down, as DESIGN.md lays them out:
// cmd -> api -> service -> fencing and cmd -> store -> fencing, api talking
// to store only through interfaces (and the leaf types of internal/apikey and
// internal/refstore), nothing importing cmd or api.
func TestLayout(t *testing.T) {
	t.Parallel()
	const mod = "github.com/redfence/redfence/"
	for _, tc := range []struct {
		pkg       string
		forbidden []string // import path prefixes
	}{
		{"fencing", []string{mod}},
		{"service", []string{mod + "api", mod + "store", mod + "cmd", "github.com/jackc/pgx"}},
		{"api", []string{mod + "store", mod + "cmd", mod + "migrations", "github.com/jackc/pgx"}},
		{"store", []string{mod + "api", mod + "service", mod + "cmd"}},
		{"client", []string{mod + "api", mod + "service", mod + "store", mod + "cmd"}},
		{"internal/apikey", []string{mod + "api", mod + "store", mod + "service"}},
		{"internal/refstore", []string{mod + "api", mod + "store", mod + "service"}},
	} {
		t.Run(strings.ReplaceAll(tc.pkg, "/", "_"), func(t *testing.T) {
			t.Parallel()
			out, err := exec.Command("go", "list", "-deps", "./"+tc.pkg).CombinedOutput()
			if err != nil {
				t.Fatalf("go list -deps ./%s: %v\n%s", tc.pkg, err, out)
			}
			deps := strings.Fields(string(out))
			if len(deps) == 0 || deps[len(deps)-1] != mod+tc.pkg {
				t.Fatalf("go list -deps ./%s did not list the package itself last:\n%s", tc.pkg, out)
			}
			for _, d := range deps {
				for _, f := range tc.forbidden {
					if d != mod+tc.pkg && strings.HasPrefix(d, f) {
						t.Errorf("%s depends on %s", tc.pkg, d)
					}
				}
			}
		})
	}
}
