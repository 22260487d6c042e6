package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/redfence/redfence"
	"github.com/redfence/redfence/api"
	"github.com/redfence/redfence/internal/inflight"
	"github.com/redfence/redfence/service"
	"github.com/redfence/redfence/store"
)

// Server is a running Redfence: nodes, Postgres pool, lock manager and HTTP
// server. Open starts it; Close stops it.
type Server struct {
	cfg    *Config
	log    *slog.Logger
	nodes  []*service.RedisNode
	db     *store.DB
	locker *service.Locker
	ln     net.Listener
	http   *http.Server
	api    *api.Handler
	// tls is the HTTPS configuration; nil serves plain HTTP.
	tls *tls.Config
	// keys watches API key changes (nil with REDFENCE_AUTH=false).
	keys *store.KeyWatcher
	// stop cancels the context of the requests still in flight once the
	// shutdown's grace period is over, with the cause api.ErrCutShort: they
	// are cut short, without an answer.
	stop context.CancelFunc
	// handlers counts the requests being handled: Close waits for those it
	// cut short. (A WaitGroup would not do: net/http may still start a
	// handler after Close, while Wait runs.)
	handlers inflight.Counter
	served   chan error
	Options  ServerOptions
	// beforeClose runs in Close once requests are done, before the
	// backends close (redfence dev revokes its key there).
	beforeClose []func(context.Context)
}

// ServerOptions are the parts of a Server that tests replace.
type ServerOptions struct {
	// AfterQuorum is service.Options.AfterQuorum (a test hook).
	AfterQuorum func(ctx context.Context, key string)
	// Unfenced is store.Options.Unfenced (a test-only switch).
	Unfenced bool
	// NoQuarantine turns off restart detection (a test-only switch for the
	// negative control of the restart fault test).
	NoQuarantine bool
}

// registry returns the node registry unless a test switched it off.
func registry(db *store.DB, opts ServerOptions) service.Registry {
	if opts.NoQuarantine {
		return nil
	}
	return db
}

// Open connects to Postgres and applies migrations, connects the Redis nodes,
// listens on cfg.ListenAddr (failing at once on a bad address) and starts
// serving in the background.
func Open(ctx context.Context, cfg *Config, log *slog.Logger, opts ServerOptions) (*Server, error) {
	if len(cfg.RedisAddrs) == 0 {
		return nil, errors.New("REDFENCE_REDIS_ADDRS is empty: list the Redis masters (host:port,...), or run `redfence dev`")
	}
	if cfg.DatabaseURL == "" {
		return nil, errors.New("REDFENCE_DATABASE_URL is empty: give a Postgres URL, or run `redfence dev`")
	}
	s := &Server{cfg: cfg, log: log, Options: opts, served: make(chan error, 1)}
	ok := false
	defer func() {
		if !ok {
			s.closeBackends()
		}
	}()

	db, err := store.Open(ctx, cfg.DatabaseURL, cfg.storeOptions(log, opts.Unfenced))
	if err != nil {
		return nil, err
	}
	s.db = db
	applied, err := db.Migrate(ctx)
	if err != nil {
		return nil, err
	}
	if len(applied) > 0 {
		log.Info("migrations applied", slog.Any("migrations", applied))
	}

	auth, err := s.openAuth(ctx)
	if err != nil {
		return nil, err
	}
	redisTLS, err := cfg.redisTLS()
	if err != nil {
		return nil, err
	}
	nodes := make([]service.Node, len(cfg.RedisAddrs))
	for i, a := range cfg.RedisAddrs {
		n := service.NewRedisNode(a, service.RedisOptions{Username: cfg.RedisUsername, Password: cfg.RedisPassword, TLSConfig: redisTLS})
		s.nodes = append(s.nodes, n)
		nodes[i] = n
	}
	reg := prometheus.NewRegistry()
	obs := api.NewObserver(reg)
	s.locker, err = service.New(nodes, obs.Issuer(db), service.Options{
		NodeTimeout:   cfg.NodeTimeout,
		DriftFactor:   cfg.DriftFactor,
		MinTTL:        cfg.MinTTL,
		MaxTTL:        cfg.MaxTTL,
		MaxWait:       cfg.MaxWait,
		RetryDelayMin: cfg.RetryDelayMin,
		RetryDelayMax: cfg.RetryDelayMax,
		IssueTimeout:  cfg.IssueTimeout,
		NoSpeculation: !cfg.Speculate,
		AfterQuorum:   opts.AfterQuorum,
		Observer:      obs,
		Registry:      registry(db, opts),
		Logger:        log,
	})
	if err != nil {
		return nil, err
	}
	if err := s.locker.Init(ctx); err != nil {
		if errors.Is(err, service.ErrAuth) {
			err = fmt.Errorf("%w (set by REDFENCE_REDIS_USERNAME and REDFENCE_REDIS_PASSWORD)", err)
		}
		return nil, err
	}
	s.reportNodes(ctx)

	// Every answer but a blocking acquire's (which sets its own deadline:
	// its wait plus this) is written within writeTimeout of the request's
	// arrival: a round, an issuance, and room for a slow reader.
	writeTimeout := cfg.IssueTimeout + 30*time.Second
	h := api.NewHandler(s.locker, db, api.Options{
		WriteTimeout:   writeTimeout,
		DefaultTTL:     cfg.DefaultTTL,
		MaxBodyBytes:   cfg.MaxBodyBytes,
		MaxHeaderBytes: cfg.MaxHeaderBytes,
		StoreTimeout:   cfg.StoreTimeout,
		Logger:         log,
		QuietAccessLog: !cfg.AccessLog,
		Registry:       reg,
		OpenAPI:        redfence.OpenAPI,
		Auth:           auth,
		RateLimit:      cfg.RateLimit,
		RateBurst:      cfg.RateBurst,
	})

	s.api = h
	if s.tls, err = cfg.serverTLS(log); err != nil {
		return nil, err
	}

	s.ln, err = net.Listen("tcp", cfg.ListenAddr)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", cfg.ListenAddr, err)
	}
	base, stop := context.WithCancelCause(context.Background())
	s.stop = func() { stop(api.ErrCutShort) }
	s.http = &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			s.handlers.Add()
			defer s.handlers.Done()
			h.ServeHTTP(w, r)
		}),
		ReadHeaderTimeout: cfg.ReadHeaderTimeout,
		ReadTimeout:       cfg.ReadTimeout,
		WriteTimeout:      writeTimeout,
		IdleTimeout:       cfg.IdleTimeout,
		// Above the API's own problem+json 431, net/http answers in plain text.
		MaxHeaderBytes: 2 * cfg.MaxHeaderBytes,
		ErrorLog:       slog.NewLogLogger(log.Handler(), slog.LevelWarn),
		BaseContext:    func(net.Listener) context.Context { return base },
		// "OPTIONS *" reaches the API too (a problem+json answer with a
		// request ID and an access-log line), not net/http's own 200.
		DisableGeneralOptionsHandler: true,
		TLSConfig:                    s.tls,
	}
	if cfg.H2C && s.tls == nil {
		// Many requests share one connection, and their frames share writes.
		var p http.Protocols
		p.SetHTTP1(true)
		p.SetUnencryptedHTTP2(true)
		s.http.Protocols = &p
	}
	go func() { s.served <- s.serve() }()
	ok = true
	log.Info("redfence serving", slog.String("addr", s.Addr()), slog.String("url", s.URL()), slog.Bool("auth", auth != nil), slog.Int("nodes", len(nodes)),
		slog.Int("quorum", s.locker.Quorum()), slog.String("max_ttl", cfg.MaxTTL.String()))
	return s, nil
}

// storeOptions are the store's settings: its pools, its statements'
// timeout, and issuance's, which bounds a claim in the store as it does in
// the service (a claim waiting for a held row, a speculation).
func (c *Config) storeOptions(log *slog.Logger, unfenced bool) store.Options {
	return store.Options{
		MaxConns: c.DBMaxConns, DocMaxConns: c.DBDocMaxConns, StatementTimeout: c.StatementTimeout,
		IssueTimeout: c.IssueTimeout, Logger: log, Unfenced: unfenced,
	}
}

// Addr returns the address the server listens on.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Locker returns the lock manager.
func (s *Server) Locker() *service.Locker { return s.locker }

// Done receives the error that ended serving, if it ends on its own.
func (s *Server) Done() <-chan error { return s.served }

// Close stops accepting requests, ends the waits of blocking acquires (they
// answer 503 shutting-down after their current try), gives in-flight
// requests until ctx ends (then cancels them, and waits a little for their
// clean-up), and closes the backends.
func (s *Server) Close(ctx context.Context) error {
	s.api.Drain()
	err := s.http.Shutdown(ctx)
	if err != nil {
		s.stop()
		err = errors.Join(err, s.http.Close())
	}
	s.stop()
	// http.Close does not wait for the handlers it cut short. An acquire
	// cut short deletes what its try set on the nodes (each within the
	// node timeout) before it returns: closing the nodes under it would
	// leave its keys to refuse the name to everyone until their TTL.
	wctx, cancel := context.WithTimeout(context.Background(), s.cleanupBound())
	if !s.handlers.Wait(wctx) {
		s.log.Warn("requests still running after the shutdown: closing the backends under them")
	}
	cancel()
	s.api.Wait() // audit lines still looking their grant up
	for _, f := range s.beforeClose {
		f(ctx)
	}
	done := make(chan struct{})
	go func() {
		s.closeBackends()
		close(done)
	}()
	if !closedWithin(done, s.cleanupBound()) {
		// Postgres not answering: closing its connections waits for
		// each cancel request (pgx gives them 15 s).
		s.log.Warn("closing the connections to Redis and Postgres is taking too long: not waiting for it")
	}
	return err
}

// cleanupBound is how long Close waits for handlers it cut short, then for
// the backends to close: a few node timeouts (a round, its clean-up, the
// last redelivery of deletes in doubt) and a second for Postgres.
func (s *Server) cleanupBound() time.Duration {
	return 6*s.cfg.NodeTimeout + time.Second
}

// closedWithin reports whether done is closed within d.
func closedWithin(done <-chan struct{}, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-done:
		return true
	case <-t.C:
		return false
	}
}

func (s *Server) closeBackends() {
	if s.locker != nil {
		s.locker.Close()
	}
	if s.keys != nil {
		s.keys.Close()
	}
	for _, n := range s.nodes {
		_ = n.Close()
	}
	if s.db != nil {
		s.db.Close()
	}
}

// reportNodes logs, at start, each node that does not answer (a wrong
// address or TLS setting shows here, not only in /readyz) or is
// quarantined. The server starts anyway: nodes may come up later.
func (s *Server) reportNodes(ctx context.Context) {
	if n, q := len(s.nodes), s.locker.Quorum(); n < 3 || n%2 == 0 {
		s.log.Warn("with this many Redis nodes a majority tolerates few failures: use an odd number, 3 or more (5 is usual)",
			slog.Int("nodes", n), slog.Int("quorum", q), slog.Int("failures_tolerated", n-q))
	}
	// Too few nodes answering, or counting, is logged by the Locker as it
	// finds it (this ping's round included), with the line that says when
	// it is over.
	for _, st := range s.locker.Nodes(ctx) {
		switch {
		case !st.Up:
			attrs := []any{slog.String("node", st.Addr)}
			if st.Err != nil {
				attrs = append(attrs, slog.String("error", st.Err.Error()))
			}
			s.log.Warn("node does not answer", attrs...)
		case !st.QuarantinedUntil.IsZero():
			s.log.Warn("node quarantined: its votes do not count yet", slog.String("node", st.Addr), slog.Time("quarantined_until", st.QuarantinedUntil))
		}
	}
}
