package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// devDefaultAddr is where dev listens when neither --addr nor
// REDFENCE_LISTEN_ADDR says: loopback only, as its API key has every scope.
const devDefaultAddr = "127.0.0.1:8080"

// devAddr returns dev's listen address: --addr when given (flagAddr), else
// REDFENCE_LISTEN_ADDR when set (lookup), else devDefaultAddr.
func devAddr(fs *flag.FlagSet, flagAddr string, lookup func(string) (string, bool)) string {
	given := false
	fs.Visit(func(f *flag.Flag) { given = given || f.Name == "addr" })
	if given {
		return flagAddr
	}
	if env, ok := lookup("REDFENCE_LISTEN_ADDR"); ok {
		return env
	}
	return devDefaultAddr
}

// devRateLimit turns the per-key rate limit off unless REDFENCE_RATE_LIMIT
// is set (lookup): a trial server on loopback is often load-tested, and its
// one key with every scope would otherwise be held to serve's default.
func devRateLimit(cfg *Config, lookup func(string) (string, bool)) {
	if _, ok := lookup("REDFENCE_RATE_LIMIT"); !ok {
		cfg.RateLimit = 0
	}
}

func cmdDev(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flags("dev", `Starts local servers and serves on them, for trying Redfence out:
with no REDFENCE_REDIS_ADDRS it starts its own redis-server nodes, and with
no REDFENCE_DATABASE_URL a throwaway Postgres, on free loopback ports (local
binaries, or Docker through dockertest when they are missing), migrates, and
serves. Ctrl-C stops everything it started and removes its temporary data.

Unlike serve, dev listens on loopback unless told otherwise (--addr, or
else REDFENCE_LISTEN_ADDR), logs text unless REDFENCE_LOG_FORMAT is set, and
limits no API key's rate unless REDFENCE_RATE_LIMIT is set; the settings
below are otherwise the same.`, stderr)
	addr := fs.String("addr", devDefaultAddr, "HTTP listen address; without it, REDFENCE_LISTEN_ADDR if set")
	n := fs.Int("nodes", 5, "number of Redis nodes to start")
	if err := parseFlags(fs, args, stdout); err != nil {
		return helpOK(err)
	}
	if *n < 1 {
		return errors.New("--nodes must be at least 1")
	}
	if _, ok := os.LookupEnv("REDFENCE_LOG_FORMAT"); !ok {
		os.Setenv("REDFENCE_LOG_FORMAT", "text")
	}
	cfg, err := loadConfig()
	if err != nil {
		return err
	}
	cfg.ListenAddr = devAddr(fs, *addr, os.LookupEnv)
	devRateLimit(cfg, os.LookupEnv)
	logw := newAsyncWriter(stderr)
	defer logw.Close()
	log := cfg.logger(logw)
	logw.reportDropsTo(log)
	quietRedis(log)
	warnUnknownSettings(log, os.Environ())

	sharedDB := cfg.DatabaseURL != "" // one this command did not start: it outlives it
	if len(cfg.RedisAddrs) == 0 || cfg.DatabaseURL == "" {
		// Only what is not configured: the rest is the user's.
		opts := localOptions{nodes: *n, withoutRedis: len(cfg.RedisAddrs) > 0, withoutPostgres: cfg.DatabaseURL != ""}
		switch {
		case opts.withoutRedis:
			fmt.Fprintln(stdout, "Starting Postgres on loopback...")
		case opts.withoutPostgres:
			fmt.Fprintf(stdout, "Starting %d redis-server nodes on loopback...\n", *n)
		default:
			fmt.Fprintf(stdout, "Starting %d redis-server nodes and Postgres on loopback...\n", *n)
		}
		c, err := startLocal(ctx, opts)
		if err != nil {
			if ctx.Err() != nil { // Ctrl-C while starting: not a failure to report
				fmt.Fprintln(stderr, "redfence dev: interrupted while starting; stopped what had started")
				return &exitError{code: 130}
			}
			return err
		}
		defer func() {
			if err := c.Close(); err != nil {
				log.Warn("stopping local servers", slog.String("error", err.Error()))
			}
			fmt.Fprintln(stdout, "Stopped the local servers it started; removed their data.")
		}()
		if len(cfg.RedisAddrs) == 0 {
			cfg.RedisAddrs = c.Addrs()
		}
		if cfg.DatabaseURL == "" {
			cfg.DatabaseURL = c.PostgresURL()
		}
	}
	s, err := Open(ctx, cfg, log, ServerOptions{})
	if err != nil {
		return err
	}
	warnSchemaAhead(ctx, s)
	key := ""
	if cfg.Auth {
		if key, err = s.devKey(ctx, sharedDB); err != nil {
			_ = s.Close(context.Background())
			return err
		}
	}
	prog, err := os.Executable() // the banner's commands work from any directory
	if err != nil {
		prog = "redfence"
	}
	fmt.Fprint(stdout, walkthrough(s.URL(), cfg, key, prog))
	return serveUntilDone(ctx, s, cfg)
}

// walkthrough is the banner redfence dev prints: what runs where, and curl
// commands to try that work as printed in a POSIX shell. key is the API key
// for tenant "dev" the commands send; "" when auth is off. prog is the path
// of this binary, for the commands that run it.
func walkthrough(base string, cfg *Config, key, prog string) string {
	var b strings.Builder
	fmt.Fprintf(&b, `
Redfence is serving on %s
  Redis nodes: %s
  Postgres:    %s
  max TTL %v, default TTL %v, node timeout %v
`, base, strings.Join(cfg.RedisAddrs, ","), redactURL(cfg.DatabaseURL), cfg.MaxTTL, cfg.DefaultTTL, cfg.NodeTimeout)
	auth := ` -H "Authorization: Bearer $KEY"`
	if key == "" {
		auth = ""
		b.WriteString(`
  !!! AUTHENTICATION IS OFF (REDFENCE_AUTH=false): anyone who reaches the port can do anything !!!
`)
	}
	fmt.Fprintf(&b, `
Try it (in another terminal):

  RF=%s
`, base)
	if key != "" {
		fmt.Fprintf(&b, "  # an API key for tenant \"dev\" with every scope, shown only here\n  KEY=%s\n", key)
	}
	b.WriteString(strings.ReplaceAll(`  # 1. acquire the lock "orders" for 30 s; keep the lock token and fencing token
  R=$(curl -s -X POST $RF/v1/locks/orders@AUTH@ -H 'Content-Type: application/json' -d '{"ttl_ms":30000,"owner":"alice"}'); echo "$R"
  LOCK=$(echo "$R" | sed -E 's/.*"lock_token":"([^"]+)".*/\1/'); FENCE=$(echo "$R" | sed -E 's/.*"fencing_token":([0-9]+).*/\1/')
  # 2. write to the fenced reference store with the fencing token
  curl -s -X PUT $RF/v1/resources/orders@AUTH@ -H 'Content-Type: application/json' -d "{\"fencing_token\":$FENCE,\"data\":{\"total\":42}}"
  # 3. look at the lock (never shows the lock token), extend it, release it
  curl -s $RF/v1/locks/orders@AUTH@
  curl -s -X POST $RF/v1/locks/orders/extend@AUTH@ -H "Lock-Token: $LOCK" -H 'Content-Type: application/json' -d '{"ttl_ms":30000}'
  curl -s -X DELETE $RF/v1/locks/orders@AUTH@ -H "Lock-Token: $LOCK" -w '%{http_code}\n'
  # 4. someone else acquires (fencing token +1); the old token can no longer write: 409 stale-token
  curl -s -X POST $RF/v1/locks/orders@AUTH@ -H 'Content-Type: application/json' -d '{"ttl_ms":30000,"owner":"bob"}'
  curl -s -X PUT $RF/v1/resources/orders@AUTH@ -H 'Content-Type: application/json' -d "{\"fencing_token\":$FENCE,\"data\":{\"total\":0}}"
`, "@AUTH@", auth))
	if key != "" {
		b.WriteString(`  # 5. without the key: 401 unauthorized
  curl -s $RF/v1/locks/orders -w '%{http_code}\n'
`)
	}
	fmt.Fprintf(&b, `
  API: $RF/openapi.yaml   nodes: curl%s $RF/v1/nodes   metrics: curl%s $RF/metrics
  More keys: REDFENCE_DATABASE_URL='%s' %s keys create --tenant <tenant>
Press Ctrl-C to stop.

`, auth, auth, redactURL(cfg.DatabaseURL), prog)
	return b.String()
}

// redactURL hides the passwords of a database URL or DSN: the user's
// (userinfo, a password= query parameter or key=value setting) and that of
// an encrypted client key (sslpassword=).
func redactURL(u string) string {
	if cfg, err := pgconn.ParseConfig(u); err == nil && cfg.Password == "" && !strings.Contains(u, "sslpassword") {
		return u
	}
	if pu, err := url.Parse(u); err == nil && pu.Scheme != "" {
		if _, ok := pu.User.Password(); ok {
			pu.User = url.UserPassword(pu.User.Username(), "xxxxx")
		}
		q := pu.Query()
		for _, k := range []string{"password", "sslpassword"} {
			if q.Has(k) {
				q.Set(k, "xxxxx")
				pu.RawQuery = q.Encode()
			}
		}
		return pu.String()
	}
	return "(connection string with a password)"
}
