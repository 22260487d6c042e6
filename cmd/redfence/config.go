package main

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kelseyhightower/envconfig"
)

// Config is every setting, read from REDFENCE_* environment variables.
type Config struct {
	ListenAddr        string        `split_words:"true" default:":8080" desc:"HTTP listen address (redfence dev: 127.0.0.1:8080; its --addr wins)"`
	RedisAddrs        []string      `split_words:"true" desc:"comma-separated host:port of the independent Redis masters (serve: required)"`
	DatabaseURL       string        `envconfig:"DATABASE_URL" desc:"Postgres URL, e.g. postgres://user:pass@host:5432/db (serve, migrate, keys: required)"`
	MaxTTL            time.Duration `envconfig:"MAX_TTL" default:"60s" desc:"longest TTL or extension, at most 24h; also how long a node that lost its memory is distrusted"`
	MinTTL            time.Duration `envconfig:"MIN_TTL" default:"100ms" desc:"shortest TTL accepted"`
	DefaultTTL        time.Duration `envconfig:"DEFAULT_TTL" default:"10s" desc:"TTL when a request gives no ttl_ms"`
	MaxWait           time.Duration `split_words:"true" default:"60s" desc:"longest wait_ms accepted, at most 24h"`
	NodeTimeout       time.Duration `split_words:"true" default:"50ms" desc:"timeout of each request to one Redis node"`
	DriftFactor       float64       `split_words:"true" default:"0.01" desc:"clock drift allowance: drift = ttl*factor + 2ms"`
	RetryDelayMin     time.Duration `split_words:"true" default:"10ms" desc:"shortest random delay between attempts of a waiting acquire when too few nodes answered"`
	RetryDelayMax     time.Duration `split_words:"true" default:"100ms" desc:"longest random delay between attempts of a waiting acquire when too few nodes answered (a held lock: until its lease ends, at most max(1s, this); a release wakes the waiter)"`
	IssueTimeout      time.Duration `split_words:"true" default:"2s" desc:"timeout of fencing-token issuance in Postgres"`
	Speculate         bool          `envconfig:"SPECULATE" default:"true" desc:"let an acquire that runs alone issue its fencing token while its Redis round runs (confirmed after the quorum, left unused if the try fails)"`
	RedisUsername     string        `split_words:"true" desc:"Redis ACL user for every node"`
	RedisPassword     string        `split_words:"true" desc:"Redis password for every node"`
	DBMaxConns        int32         `envconfig:"DB_MAX_CONNS" desc:"Postgres pool size of the locks: token issuance, heartbeats, node records, API keys (default: max(4, CPUs))"`
	DBDocMaxConns     int32         `envconfig:"DB_DOC_MAX_CONNS" desc:"Postgres pool size of the reference store's documents, kept apart from the locks' (default: REDFENCE_DB_MAX_CONNS's)"`
	StatementTimeout  time.Duration `split_words:"true" default:"5s" desc:"Postgres statement_timeout of Redfence's sessions (those waiting for a name's row held by another transaction: at least REDFENCE_ISSUE_TIMEOUT), and their idle_in_transaction_session_timeout (the documents' pool: 500ms at most)"`
	StoreTimeout      time.Duration `split_words:"true" default:"2s" desc:"timeout of each reference-store call (PUT and GET /v1/resources), including the wait for a pooled connection"`
	MaxBodyBytes      int64         `split_words:"true" default:"1048576" desc:"largest request body accepted"`
	MaxHeaderBytes    int           `split_words:"true" default:"65536" desc:"largest request line plus headers accepted (431 above)"`
	ReadHeaderTimeout time.Duration `split_words:"true" default:"5s" desc:"time to read request headers"`
	ReadTimeout       time.Duration `split_words:"true" default:"30s" desc:"time to read a whole request"`
	IdleTimeout       time.Duration `split_words:"true" default:"120s" desc:"keep-alive idle timeout"`
	H2C               bool          `envconfig:"H2C" default:"false" desc:"without TLS, also serve HTTP/2 to clients that start with its preface (prior knowledge, as gRPC does); with TLS, HTTP/2 is negotiated anyway"`
	ShutdownTimeout   time.Duration `split_words:"true" default:"30s" desc:"grace period for in-flight requests on SIGINT/SIGTERM/SIGHUP (waiting acquires end at once with 503 shutting-down; a second signal ends it, a third the process)"`
	ShutdownDelay     time.Duration `split_words:"true" default:"0s" desc:"on SIGINT/SIGTERM/SIGHUP, first answer /readyz with 503 shutting-down and serve as before for this long (a load balancer takes the server out of its pool), then shut down; a second signal ends the delay, a third the grace period, a fourth the process"`
	LogLevel          string        `split_words:"true" default:"info" desc:"debug, info, warn or error"`
	AccessLog         bool          `split_words:"true" default:"true" desc:"log an access line per request at info (false: at debug; audit lines stay at info); successful /healthz, /readyz and /metrics requests are logged at debug either way"`
	LogFormat         string        `split_words:"true" default:"json" desc:"json or text"`
	Auth              bool          `envconfig:"AUTH" default:"true" desc:"require an API key (Authorization: Bearer) on /v1 and /metrics; false lets anyone who reaches the port do anything"`
	AuthCacheTTL      time.Duration `envconfig:"AUTH_CACHE_TTL" default:"1s" desc:"how long a server trusts a cached API key: the bound on applying a revocation whose notification was lost"`
	RateLimit         float64       `split_words:"true" default:"100" desc:"requests per second per API key on average, on each server (token bucket); 0 turns rate limits off (redfence dev: 0 unless set)"`
	RateBurst         int           `split_words:"true" default:"200" desc:"requests an API key may send at once (the token bucket's size; it refills at REDFENCE_RATE_LIMIT)"`
	TLSCertFile       string        `envconfig:"TLS_CERT_FILE" desc:"PEM certificate chain: serve HTTPS (with REDFENCE_TLS_KEY_FILE); reloaded when the file changes"`
	TLSKeyFile        string        `envconfig:"TLS_KEY_FILE" desc:"PEM private key of REDFENCE_TLS_CERT_FILE"`
	TLSClientCAFile   string        `envconfig:"TLS_CLIENT_CA_FILE" desc:"PEM CA certificates: require client certificates signed by them (mTLS; read at start)"`
	RedisTLS          bool          `envconfig:"REDIS_TLS" default:"false" desc:"connect to the Redis nodes over TLS"`
	RedisTLSCAFile    string        `envconfig:"REDIS_TLS_CA_FILE" desc:"PEM CA certificates of the Redis nodes (default: the system's roots)"`
	RedisTLSCertFile  string        `envconfig:"REDIS_TLS_CERT_FILE" desc:"PEM client certificate for Redis nodes that verify clients (tls-auth-clients)"`
	RedisTLSKeyFile   string        `envconfig:"REDIS_TLS_KEY_FILE" desc:"PEM private key of REDFENCE_REDIS_TLS_CERT_FILE"`
}

const envPrefix = "redfence"

// loadConfig reads the REDFENCE_* environment variables.
func loadConfig() (*Config, error) {
	var c Config
	if err := envconfig.Process(envPrefix, &c); err != nil {
		var pe *envconfig.ParseError
		if errors.As(err, &pe) {
			// Not envconfig's wording, which names Go fields and types.
			return nil, fmt.Errorf("%s=%q: want %s", pe.KeyName, pe.Value, typeHint(pe.TypeName))
		}
		return nil, fmt.Errorf("config: %w", err)
	}
	if err := c.validate(); err != nil {
		return nil, err
	}
	return &c, nil
}

// maxSetting bounds REDFENCE_MAX_TTL and REDFENCE_MAX_WAIT: ttl_ms and
// wait_ms are at most a day in the API (openapi.yaml).
const maxSetting = 24 * time.Hour

func (c *Config) validate() error {
	var errs []error
	if c.MinTTL <= 0 || c.MaxTTL < c.MinTTL {
		errs = append(errs, fmt.Errorf("REDFENCE_MIN_TTL (%v) must be positive and at most REDFENCE_MAX_TTL (%v)", c.MinTTL, c.MaxTTL))
	}
	if c.DefaultTTL < c.MinTTL || c.DefaultTTL > c.MaxTTL {
		errs = append(errs, fmt.Errorf("REDFENCE_DEFAULT_TTL (%v) must be within [REDFENCE_MIN_TTL, REDFENCE_MAX_TTL]", c.DefaultTTL))
	}
	if c.NodeTimeout <= 0 {
		errs = append(errs, errors.New("REDFENCE_NODE_TIMEOUT must be positive"))
	}
	if c.ListenAddr == "" {
		errs = append(errs, errors.New("REDFENCE_LISTEN_ADDR is empty: give host:port, such as :8080 (every interface) or 127.0.0.1:8080, or unset it for :8080"))
	}
	if isFinite("REDFENCE_DRIFT_FACTOR", c.DriftFactor, &errs) && (c.DriftFactor <= 0 || c.DriftFactor >= 0.5) {
		errs = append(errs, errors.New("REDFENCE_DRIFT_FACTOR must be in (0, 0.5): above 0, as clocks do drift"))
	}
	if c.RetryDelayMin <= 0 || c.RetryDelayMax < c.RetryDelayMin {
		errs = append(errs, errors.New("REDFENCE_RETRY_DELAY_MIN must be positive and at most REDFENCE_RETRY_DELAY_MAX"))
	}
	if c.MaxTTL > maxSetting {
		errs = append(errs, fmt.Errorf("REDFENCE_MAX_TTL (%v) must be at most 24h (the API's bound on ttl_ms; a node that lost its memory is distrusted that long)", c.MaxTTL))
	}
	if c.MaxWait < 0 || c.MaxWait > maxSetting {
		errs = append(errs, fmt.Errorf("REDFENCE_MAX_WAIT (%v) must be within [0, 24h] (the API's bound on wait_ms)", c.MaxWait))
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"REDFENCE_ISSUE_TIMEOUT", c.IssueTimeout}, {"REDFENCE_STATEMENT_TIMEOUT", c.StatementTimeout},
		{"REDFENCE_STORE_TIMEOUT", c.StoreTimeout},
		{"REDFENCE_READ_HEADER_TIMEOUT", c.ReadHeaderTimeout}, {"REDFENCE_READ_TIMEOUT", c.ReadTimeout},
		{"REDFENCE_IDLE_TIMEOUT", c.IdleTimeout},
	} {
		if d.v <= 0 {
			errs = append(errs, fmt.Errorf("%s (%v) must be positive", d.name, d.v))
		}
	}
	if c.ShutdownTimeout < 0 {
		errs = append(errs, fmt.Errorf("REDFENCE_SHUTDOWN_TIMEOUT (%v) must not be negative", c.ShutdownTimeout))
	}
	if c.ShutdownDelay < 0 || c.ShutdownDelay > maxSetting {
		errs = append(errs, fmt.Errorf("REDFENCE_SHUTDOWN_DELAY (%v) must be within [0, 24h]", c.ShutdownDelay))
	}
	if c.DBMaxConns < 0 {
		errs = append(errs, fmt.Errorf("REDFENCE_DB_MAX_CONNS (%d) must not be negative (0: the default)", c.DBMaxConns))
	}
	if c.DBDocMaxConns < 0 {
		errs = append(errs, fmt.Errorf("REDFENCE_DB_DOC_MAX_CONNS (%d) must not be negative (0: the default)", c.DBDocMaxConns))
	}
	if c.MaxBodyBytes <= 0 {
		errs = append(errs, fmt.Errorf("REDFENCE_MAX_BODY_BYTES (%d) must be positive", c.MaxBodyBytes))
	}
	if c.MaxHeaderBytes <= 0 {
		errs = append(errs, fmt.Errorf("REDFENCE_MAX_HEADER_BYTES (%d) must be positive", c.MaxHeaderBytes))
	}
	if _, err := parseLevel(c.LogLevel); err != nil {
		errs = append(errs, err)
	}
	if c.LogFormat != "json" && c.LogFormat != "text" {
		errs = append(errs, fmt.Errorf("REDFENCE_LOG_FORMAT %q: want json or text", c.LogFormat))
	}
	for i, a := range c.RedisAddrs {
		c.RedisAddrs[i] = strings.TrimSpace(a)
		if err := checkRedisAddr(c.RedisAddrs[i]); err != nil {
			errs = append(errs, fmt.Errorf("REDFENCE_REDIS_ADDRS: entry %d: %w", i+1, err))
		}
	}
	errs = append(errs, c.validateSecurity()...)
	if len(errs) > 1 {
		msgs := make([]string, len(errs))
		for i, e := range errs {
			msgs[i] = e.Error()
		}
		return fmt.Errorf("%d invalid settings:\n  %s", len(errs), strings.Join(msgs, "\n  "))
	}
	return errors.Join(errs...)
}

// checkRedisAddr returns an error unless addr is host:port (port 1-65535).
// An address is logged, labels metrics and is shown in /v1/nodes and in
// lock errors' nodes, so one holding any character a host and port are not
// spelled with is refused, and not quoted: it may be a Redis URL with a user
// and password (redis://user:password@host:6379), and the error is logged.
func checkRedisAddr(addr string) error {
	_, port, err := net.SplitHostPort(addr)
	n, perr := strconv.ParseUint(port, 10, 16)
	switch {
	case strings.ContainsFunc(addr, notHostPortChar):
		return errors.New("not host:port (not quoted: it holds characters no host:port has, such as a Redis URL's user and password; " +
			"give the nodes as host:port and their credentials in REDFENCE_REDIS_USERNAME and REDFENCE_REDIS_PASSWORD)")
	case err != nil || perr != nil || n == 0:
		return fmt.Errorf("%q is not host:port (port 1-65535)", addr)
	}
	return nil
}

// notHostPortChar reports whether c cannot be in host:port: letters,
// digits, "." "-" "_" of host names, ":" "[" "]" of IPv6 addresses and "%"
// of their zones.
func notHostPortChar(c rune) bool {
	return !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.ContainsRune(".-_:[]%", c))
}

// isFinite reports whether v, the value of the float setting name, is a
// number (not NaN, which every comparison lets through, nor ±Inf), and adds
// an error to errs when it is not.
func isFinite(name string, v float64, errs *[]error) bool {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		*errs = append(*errs, fmt.Errorf("%s (%v) must be a finite number", name, v))
		return false
	}
	return true
}

// typeHint names what a setting of Go type t takes.
func typeHint(t string) string {
	switch t {
	case "time.Duration":
		return "a duration such as 500ms, 30s or 2m"
	case "bool":
		return "true or false"
	case "float64":
		return "a number"
	case "int", "int32", "int64", "uint", "uint64":
		return "an integer"
	}
	return "a value of type " + t
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return 0, fmt.Errorf("REDFENCE_LOG_LEVEL %q: want debug, info, warn or error", s)
	}
	return l, nil
}

func (c *Config) logger(w io.Writer) *slog.Logger {
	level, _ := parseLevel(c.LogLevel)
	opts := &slog.HandlerOptions{Level: level}
	if c.LogFormat == "text" {
		return slog.New(slog.NewTextHandler(w, opts))
	}
	return slog.New(slog.NewJSONHandler(w, opts))
}

// unknownSettings returns the REDFENCE_* variables of environ that nothing
// reads, sorted: most likely typos (REDFENCE_MAXTTL), which would otherwise
// be ignored without a word.
func unknownSettings(environ []string) []string {
	var keys strings.Builder
	_ = envconfig.Usagef(envPrefix, &Config{}, &keys, "{{range .}}{{usage_key .}}\n{{end}}")
	known := map[string]bool{
		// redfence lock's and the clients', those it sets for its
		// command, and the tooling's (make test-ts, the benchmark).
		"REDFENCE_SERVER": true, "REDFENCE_API_KEY": true, "REDFENCE_CA_FILE": true,
		"REDFENCE_CLIENT_CERT_FILE": true, "REDFENCE_CLIENT_KEY_FILE": true,
		"REDFENCE_LOCK_NAME": true, "REDFENCE_FENCING_TOKEN": true,
		"REDFENCE_BIN": true, "REDFENCE_BENCH_PPROF_ADDR": true, "REDFENCE_LOCK_HELPER": true,
	}
	for k := range strings.Lines(keys.String()) {
		known[strings.TrimSpace(k)] = true
	}
	var unknown []string
	for _, kv := range environ {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "REDFENCE_") && !known[k] {
			unknown = append(unknown, k)
		}
	}
	slices.Sort(unknown)
	return unknown
}

// warnUnknownSettings logs each REDFENCE_* variable nothing reads.
func warnUnknownSettings(log *slog.Logger, environ []string) {
	for _, k := range unknownSettings(environ) {
		log.Warn("unknown setting ignored (a typo? redfence -h lists the settings)", slog.String("variable", k))
	}
}

// printSettings lists every environment variable with its default.
func printSettings(w io.Writer) {
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "VARIABLE\tDEFAULT\tDESCRIPTION")
	_ = envconfig.Usagef(envPrefix, &Config{}, tw, "{{range .}}{{usage_key .}}\t{{usage_default .}}\t{{usage_description .}}\n{{end}}")
	_ = tw.Flush()
}
