package store

import (
	"context"
	"strings"
	"testing"
)

// A database URL that does not parse is refused with what is wrong with it,
// and never with its password.
func TestOpen_BadURLSaysWhyWithoutPassword(t *testing.T) {
	const pw = "s3cr3tPW"
	cases := []struct {
		name, url, want string
	}{
		{"SSLMode", "postgres://u:" + pw + "@127.0.0.1:5432/db?sslmode=nope", "sslmode is invalid"},
		{"Port", "postgres://u:" + pw + "@127.0.0.1:port/db", "invalid port"},
		{"Escape", "postgres://u:" + pw + "%zz@127.0.0.1:5432/db", "failed to parse as URL"},
		{"KeywordValue", "host=127.0.0.1 password=" + pw + " port=x", "invalid port"},
		{"ConnectTimeout", "postgres://u:" + pw + "@127.0.0.1/db?connect_timeout=soon", "invalid connect_timeout"},
		// Causes that quote a piece of the input: the password's.
		{"KeywordSpace", "host=127.0.0.1 password=foo " + pw + " port=5432", "failed to parse as keyword/value"},
		{"URLSpace", "postgres://u:pa/ss " + pw + "@h/db", "failed to parse as URL"},
		{"URLPercent", "postgres://u:pa/" + pw + "%CR@h/db", "failed to parse as URL"},
		{"URLSpaceNoHost", "postgres://u:" + pw + " x/db", "failed to parse as URL"},
		// An "@" not percent-encoded in the password: pgx takes what
		// follows it for the host, which connection errors would name.
		{"URLAtInPassword", "postgres://u:pa@" + pw + "@127.0.0.1:5432/db", "percent-encode"},
		{"URLAtInPasswordHosts", "postgres://u:pa@" + pw + "@127.0.0.1:5432,127.0.0.2:5432/db", "percent-encode"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Open(context.Background(), tc.url, Options{})
			if err == nil {
				t.Fatal("Open succeeded")
			}
			msg := err.Error()
			if strings.Contains(msg, pw) || strings.Contains(msg, "zz") || strings.Contains(msg, "pa/") {
				t.Fatalf("error quotes the password: %s", msg)
			}
			if !strings.Contains(msg, "invalid connection string: ") || !strings.Contains(msg, tc.want) {
				t.Fatalf("error = %q, want it to say %q", msg, tc.want)
			}
		})
	}
}
