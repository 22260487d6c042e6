package main

import (
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"
)

// validateSecurity checks the access-control, rate-limit and TLS settings.
func (c *Config) validateSecurity() []error {
	var errs []error
	if c.AuthCacheTTL <= 0 {
		errs = append(errs, errors.New("REDFENCE_AUTH_CACHE_TTL must be positive"))
	}
	if isFinite("REDFENCE_RATE_LIMIT", c.RateLimit, &errs) && c.RateLimit < 0 {
		errs = append(errs, errors.New("REDFENCE_RATE_LIMIT must not be negative (0 turns rate limits off)"))
	}
	if c.RateLimit > 0 && c.RateBurst < 1 {
		errs = append(errs, errors.New("REDFENCE_RATE_BURST must be at least 1"))
	}
	if (c.TLSCertFile == "") != (c.TLSKeyFile == "") {
		errs = append(errs, errors.New("REDFENCE_TLS_CERT_FILE and REDFENCE_TLS_KEY_FILE go together: set both or neither"))
	}
	if c.TLSClientCAFile != "" && c.TLSCertFile == "" {
		errs = append(errs, errors.New("REDFENCE_TLS_CLIENT_CA_FILE needs REDFENCE_TLS_CERT_FILE and REDFENCE_TLS_KEY_FILE (mTLS is TLS first)"))
	}
	if (c.RedisTLSCertFile == "") != (c.RedisTLSKeyFile == "") {
		errs = append(errs, errors.New("REDFENCE_REDIS_TLS_CERT_FILE and REDFENCE_REDIS_TLS_KEY_FILE go together: set both or neither"))
	}
	if !c.RedisTLS && (c.RedisTLSCAFile != "" || c.RedisTLSCertFile != "") {
		errs = append(errs, errors.New("REDFENCE_REDIS_TLS_CA_FILE and REDFENCE_REDIS_TLS_CERT_FILE need REDFENCE_REDIS_TLS=true"))
	}
	return errs
}

// readPEM reads the PEM file file. A setting meant to name a file that
// holds the PEM data itself (a key pasted into REDFENCE_TLS_KEY_FILE) is
// not a file name: the error says so without quoting it, as the error of
// opening it would, private key and all, into the log.
func readPEM(file string) ([]byte, error) {
	data, err := os.ReadFile(file)
	if err != nil && (strings.Contains(file, "-----BEGIN") || strings.ContainsAny(file, "\r\n")) {
		return nil, errors.New("not quoted: it holds PEM data or a line break, not a file name (give the path of a file that holds the PEM data)")
	}
	return data, err
}

// loadKeyPair is tls.LoadX509KeyPair, reading the files with readPEM.
func loadKeyPair(certFile, keyFile string) (tls.Certificate, error) {
	certPEM, err := readPEM(certFile)
	if err != nil {
		return tls.Certificate{}, err
	}
	keyPEM, err := readPEM(keyFile)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.X509KeyPair(certPEM, keyPEM)
}

// certPool reads PEM certificates from file into a new pool.
func certPool(variable, file string) (*x509.CertPool, error) {
	pem, err := readPEM(file)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", variable, err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s: %s holds no PEM certificate", variable, file)
	}
	return pool, nil
}

// serverTLS returns the HTTPS configuration, or nil to serve plain HTTP. The
// certificate is reloaded when its files change, so it can be rotated
// without a restart; the client CA file is read once.
func (c *Config) serverTLS(log *slog.Logger) (*tls.Config, error) {
	if c.TLSCertFile == "" {
		return nil, nil
	}
	kp, err := newKeyPair(c.TLSCertFile, c.TLSKeyFile, log)
	if err != nil {
		return nil, err
	}
	cfg := &tls.Config{
		MinVersion:     tls.VersionTLS12,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return kp.get(), nil },
	}
	if c.TLSClientCAFile != "" {
		if cfg.ClientCAs, err = certPool("REDFENCE_TLS_CLIENT_CA_FILE", c.TLSClientCAFile); err != nil {
			return nil, err
		}
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return cfg, nil
}

// redisTLS returns the TLS configuration for the Redis nodes, or nil when
// REDFENCE_REDIS_TLS is off. Each node's certificate must name the host of
// its address in REDFENCE_REDIS_ADDRS.
func (c *Config) redisTLS() (*tls.Config, error) {
	if !c.RedisTLS {
		return nil, nil
	}
	return clientTLS("REDFENCE_REDIS_TLS_CA_FILE", c.RedisTLSCAFile, "REDFENCE_REDIS_TLS_CERT_FILE / _KEY_FILE", c.RedisTLSCertFile, c.RedisTLSKeyFile)
}

// clientTLS is the TLS configuration of a client (TLS 1.2 at least) that
// trusts the CAs of caFile (the system's when empty) and presents the
// certificate of certFile and keyFile (none when empty). Errors name the
// setting that gave the file: caName or certName.
func clientTLS(caName, caFile, certName, certFile, keyFile string) (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pool, err := certPool(caName, caFile)
		if err != nil {
			return nil, err
		}
		cfg.RootCAs = pool
	}
	if certFile != "" || keyFile != "" {
		cert, err := loadKeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", certName, err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

// keyPair is a certificate and key loaded from files, reloaded when either
// file's content changes (checked at most every keyPairCheck, on a
// handshake). A reload that fails (a half-written file, a key that does not
// match, a certificate expired or not valid yet) keeps the previous pair,
// logs why and is tried again at the next check.
type keyPair struct {
	certFile, keyFile string
	log               *slog.Logger

	mu      sync.Mutex
	cert    *tls.Certificate
	sum     [sha256.Size]byte // of the files' contents the pair came from
	checked time.Time
}

const keyPairCheck = 5 * time.Second

func newKeyPair(certFile, keyFile string, log *slog.Logger) (*keyPair, error) {
	kp := &keyPair{certFile: certFile, keyFile: keyFile, log: log}
	if _, err := kp.reload(); err != nil {
		return nil, fmt.Errorf("REDFENCE_TLS_CERT_FILE / REDFENCE_TLS_KEY_FILE: %w", err)
	}
	kp.checked = time.Now()
	if err := validNow(kp.cert, kp.checked); err != nil {
		log.Warn("TLS certificate "+err.Error()+"; serving it until its files are replaced", slog.String("cert_file", certFile))
	}
	return kp, nil
}

// validNow returns an error saying why the leaf of cert is not valid at
// now (expired, or not valid yet), or nil.
func validNow(cert *tls.Certificate, now time.Time) error {
	leaf := cert.Leaf
	if leaf == nil {
		return nil
	}
	if now.Before(leaf.NotBefore) || now.After(leaf.NotAfter) {
		return fmt.Errorf("is not valid now (only from %s to %s): clients that verify it refuse it",
			leaf.NotBefore.UTC().Format(time.RFC3339), leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	return nil
}

// reload reads both files and, if they changed, loads the pair from them.
func (kp *keyPair) reload() (changed bool, err error) {
	certPEM, err := readPEM(kp.certFile)
	if err != nil {
		return false, err
	}
	keyPEM, err := readPEM(kp.keyFile)
	if err != nil {
		return false, err
	}
	h := sha256.New()
	h.Write(certPEM)
	h.Write([]byte{0})
	h.Write(keyPEM)
	var sum [sha256.Size]byte
	h.Sum(sum[:0])
	if kp.cert != nil && sum == kp.sum {
		return false, nil
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return false, err
	}
	if kp.cert != nil {
		// A replacement no client accepts (an old certificate copied back,
		// a new one dated ahead) is broken as much as a half-written one.
		if err := validNow(&cert, time.Now()); err != nil {
			return false, fmt.Errorf("the new certificate %w", err)
		}
	}
	kp.cert, kp.sum = &cert, sum
	return true, nil
}

// get returns the current pair, reloading it first if its files changed.
func (kp *keyPair) get() *tls.Certificate {
	kp.mu.Lock()
	defer kp.mu.Unlock()
	if now := time.Now(); now.Sub(kp.checked) >= keyPairCheck {
		kp.checked = now
		switch changed, err := kp.reload(); {
		case err != nil:
			kp.log.Warn("TLS certificate not reloaded; serving the previous one", slog.String("error", err.Error()))
		case changed:
			kp.log.Info("TLS certificate reloaded", slog.String("cert_file", kp.certFile))
		}
	}
	return kp.cert
}

// serve serves HTTP or HTTPS on the listener until the server closes.
func (s *Server) serve() error {
	if s.tls != nil {
		return s.http.ServeTLS(s.ln, "", "")
	}
	return s.http.Serve(s.ln)
}

// URL returns the server's base URL: https:// when it serves TLS.
func (s *Server) URL() string {
	if s.tls != nil {
		return "https://" + s.Addr()
	}
	return "http://" + s.Addr()
}

// healthClient returns the client and base URL that `redfence healthcheck`
// uses to reach the server listening on host:port on this machine (see
// probeAddr). With TLS it does not verify the server's certificate, which
// cannot name 127.0.0.1 in general: the check only asks a local process
// whether it is alive and sends nothing secret. With mTLS it presents the server's own certificate, which works
// when that certificate is also valid for client authentication under
// REDFENCE_TLS_CLIENT_CA_FILE.
func (c *Config) healthClient(host, port string) (*http.Client, string, error) {
	addr := net.JoinHostPort(host, port)
	if c.TLSCertFile == "" {
		return http.DefaultClient, "http://" + addr, nil
	}
	cfg := &tls.Config{InsecureSkipVerify: true} //nolint:gosec // local liveness probe; see above
	if c.TLSClientCAFile != "" {
		cert, err := loadKeyPair(c.TLSCertFile, c.TLSKeyFile)
		if err != nil {
			return nil, "", fmt.Errorf("REDFENCE_TLS_CERT_FILE / REDFENCE_TLS_KEY_FILE: %w", err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return &http.Client{Transport: &http.Transport{TLSClientConfig: cfg}}, "https://" + addr, nil
}
