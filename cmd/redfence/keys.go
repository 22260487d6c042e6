package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/redfence/redfence/internal/apikey"

	"github.com/redfence/redfence/api"
	"github.com/redfence/redfence/store"
)

// openAuth returns the API key authenticator, watching Postgres for key
// changes, or nil (an open API) with REDFENCE_AUTH=false.
func (s *Server) openAuth(ctx context.Context) (api.Authenticator, error) {
	if !s.cfg.Auth {
		s.log.Warn("AUTHENTICATION IS OFF (REDFENCE_AUTH=false): anyone who can reach this port can take, " +
			"release and extend every lock and overwrite every resource. Never run production like this.")
		return nil, nil
	}
	opts := api.KeyAuthOptions{CacheTTL: s.cfg.AuthCacheTTL}
	if s.cfg.DBMaxConns > 0 {
		// Half the pool at most, so that issuance keeps the rest (the
		// default pool, at least 4, leaves KeyAuth's default of 2).
		opts.MaxLookups = max(1, min(2, int(s.cfg.DBMaxConns)/2))
	}
	auth := api.NewKeyAuth(s.db, opts)
	w, err := s.db.WatchKeys(ctx, auth.Changed)
	if err != nil {
		return nil, err
	}
	s.keys = w
	return auth, nil
}

const keysHelp = `Manages API keys in the database at REDFENCE_DATABASE_URL (migrating it first).

  redfence keys create --tenant T [--scope locks,resources,admin]
      Creates a key for tenant T and prints it on stdout. It is shown only this
      once: the database keeps its SHA-256. Scopes (comma list, default
      locks,resources): locks (the /v1/locks calls), resources (/v1/resources),
      admin (/v1/nodes and /metrics).
  redfence keys list
      Prints one line per key: id, tenant, scopes, created, revoked ("-" while
      active). Never the key itself.
  redfence keys revoke ID
      Revokes the key with this id (or the key itself) on every server: at once
      where they are notified, within REDFENCE_AUTH_CACHE_TTL otherwise.`

func keysUsage(w io.Writer) {
	fmt.Fprintf(w, "Usage: redfence keys create|list|revoke\n\n%s\n", keysHelp)
}

func cmdKeys(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		keysUsage(stderr)
		return errUsage
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		keysUsage(stdout)
		return nil
	case "create":
		return cmdKeysCreate(ctx, args[1:], stdout, stderr)
	case "list":
		return cmdKeysList(ctx, args[1:], stdout, stderr)
	case "revoke":
		return cmdKeysRevoke(ctx, args[1:], stdout, stderr)
	}
	fmt.Fprintf(stderr, "redfence keys: unknown command %q\n\n", args[0])
	keysUsage(stderr)
	return errUsage
}

// keysDB opens and migrates the database at REDFENCE_DATABASE_URL.
func keysDB(ctx context.Context, stderr io.Writer) (*store.DB, error) {
	cfg, err := loadConfig()
	if err != nil {
		return nil, err
	}
	if cfg.DatabaseURL == "" {
		return nil, errors.New("REDFENCE_DATABASE_URL is empty: give the Postgres URL the servers use")
	}
	db, err := store.Open(ctx, cfg.DatabaseURL, store.Options{Logger: cfg.logger(stderr)})
	if err != nil {
		return nil, err
	}
	if _, err := db.Migrate(ctx); err != nil {
		db.Close()
		return nil, err
	}
	return db, nil
}

func cmdKeysCreate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flags("keys create --tenant T [--scope locks,resources,admin]", `Creates an API key for tenant T in the database at REDFENCE_DATABASE_URL and
prints it on stdout. It is shown only this once: the database keeps its
SHA-256. Scopes (comma list, or --scope repeated; default locks,resources):
locks (the /v1/locks calls), resources (/v1/resources), admin (/v1/nodes and
/metrics).`, stderr)
	tenant := fs.String("tenant", "", "the tenant (namespace) of the key: 1-200 characters of A-Z a-z 0-9 . _ - : (required)")
	// --scope may be repeated: the scopes add up (--scope locks --scope
	// admin is locks,admin), as with a comma-separated list.
	var scopeList []string
	fs.Func("scope", "comma-separated scopes, or the flag repeated: "+strings.Join(apikey.AllScopes(), ", ")+
		" (default "+strings.Join(apikey.DefaultScopes(), ",")+")", func(v string) error {
		scopeList = append(scopeList, v)
		return nil
	})
	if err := parseFlags(fs, args, stdout); err != nil {
		return helpOK(err)
	}
	scope := strings.Join(apikey.DefaultScopes(), ",")
	if scopeList != nil {
		scope = strings.Join(scopeList, ",")
	}
	if reason := apikey.ValidTenant(*tenant); reason != "" {
		fmt.Fprintf(stderr, "--tenant %q: %s\n", apikey.Redact(*tenant), reason)
		return errUsage
	}
	scopes, err := apikey.ParseScopes(scope)
	if err != nil {
		fmt.Fprintf(stderr, "--scope: %s\n", strings.TrimPrefix(err.Error(), "apikey: "))
		return errUsage
	}
	db, err := keysDB(ctx, stderr)
	if err != nil {
		return err
	}
	defer db.Close()
	key, k, err := db.CreateKey(ctx, *tenant, scopes)
	if err != nil {
		return err
	}
	fmt.Fprintln(stdout, key)
	fmt.Fprintf(stderr, "Created API key %s for tenant %q with scopes %s. It is shown only this once: keep it in a secret store.\n",
		k.ID, k.Tenant, strings.Join(k.Scopes, ","))
	return nil
}

func cmdKeysList(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flags("keys list", "Prints one line per API key: id, tenant, scopes, created, revoked (\"-\" while active).", stderr)
	if err := parseFlags(fs, args, stdout); err != nil {
		return helpOK(err)
	}
	db, err := keysDB(ctx, stderr)
	if err != nil {
		return err
	}
	defer db.Close()
	keys, err := db.Keys(ctx)
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	for _, k := range keys {
		revoked := "-"
		if k.Revoked() {
			revoked = k.RevokedAt.UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", k.ID, k.Tenant, strings.Join(k.Scopes, ","), k.CreatedAt.UTC().Format(time.RFC3339), revoked)
	}
	if len(keys) == 0 {
		fmt.Fprintln(stderr, "no API keys; create one with: redfence keys create --tenant <tenant>")
	}
	return tw.Flush()
}

func cmdKeysRevoke(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flags("keys revoke ID", "Revokes the API key with this id (or the key itself) on every server.", stderr)
	if err := parseArgs(fs, args, stdout); err != nil {
		return helpOK(err)
	}
	if fs.NArg() != 1 {
		fmt.Fprintln(stderr, "redfence keys revoke: give exactly one key id (see redfence keys list)")
		return errUsage
	}
	id := strings.TrimSpace(fs.Arg(0))
	if kid, ok := apikey.ParseID(id); ok {
		id = kid // the whole key was given
	} else if !apikey.ValidID(id) {
		// Never echo it: it may be a key mistyped or cut short.
		if kid, ok := apikey.FindID(id); ok {
			fmt.Fprintf(stderr, "redfence keys revoke: the argument is neither a whole API key nor a key id; it names key id %s (to revoke that key: redfence keys revoke %s)\n", kid, kid)
		} else {
			fmt.Fprintln(stderr, "redfence keys revoke: the argument is neither an API key nor a key id (16 hex digits; see redfence keys list)")
		}
		return errUsage
	}
	db, err := keysDB(ctx, stderr)
	if err != nil {
		return err
	}
	defer db.Close()
	k, err := db.RevokeKey(ctx, id)
	if errors.Is(err, apikey.ErrNotFound) {
		return fmt.Errorf("no API key has id %q (see redfence keys list)", id)
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "revoked %s (tenant %s) at %s\n", k.ID, k.Tenant, k.RevokedAt.UTC().Format(time.RFC3339))
	return nil
}

// devKey creates the API key redfence dev prints: for tenant "dev", with
// every scope. With revoke (a database redfence dev did not start, which
// outlives it) the key is revoked when the server closes, so no key with
// every scope is left behind; it records this process as its creator, and
// first revokes the keys of the redfence dev runs of this host that are gone
// without revoking theirs (killed with SIGKILL, say).
func (s *Server) devKey(ctx context.Context, revoke bool) (string, error) {
	creator, owned := keyCreator()
	owned = owned && revoke
	if owned {
		orphans, err := s.db.RevokeOrphanKeys(ctx, creator.Host, processGone)
		if err != nil {
			s.log.Warn("could not revoke the API keys of redfence dev runs that are gone", slog.String("error", err.Error()))
		}
		for _, k := range orphans {
			s.log.Info("revoked the API key of a redfence dev run that is gone", slog.String("key_id", k.ID), slog.String("tenant", k.Tenant))
		}
	}
	var key string
	var k *store.APIKey
	var err error
	if owned {
		key, k, err = s.db.CreateProcessKey(ctx, "dev", apikey.AllScopes(), creator)
	} else {
		key, k, err = s.db.CreateKey(ctx, "dev", apikey.AllScopes())
	}
	if err != nil {
		return "", err
	}
	s.log.Info("created an API key for redfence dev", slog.String("key_id", k.ID), slog.String("tenant", k.Tenant), slog.Bool("revoked_at_exit", revoke))
	if revoke {
		s.beforeClose = append(s.beforeClose, func(ctx context.Context) {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			if _, err := s.db.RevokeKey(rctx, k.ID); err != nil {
				s.log.Warn("could not revoke redfence dev's API key; revoke it with redfence keys revoke", slog.String("key_id", k.ID), slog.String("error", err.Error()))
				return
			}
			s.log.Info("revoked redfence dev's API key", slog.String("key_id", k.ID))
		})
	}
	return key, nil
}
