package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"io"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/internal/testutil"
)

// testCA is a certificate authority made for one test.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	file string // its certificate, PEM
}

func newCA(t testing.TB, dir, name string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, strings.ReplaceAll(name, " ", "-")+"-ca.pem")
	writePEM(t, file, "CERTIFICATE", der)
	return &testCA{cert: cert, key: key, file: file}
}

func writePEM(t testing.TB, file, typ string, der []byte) {
	t.Helper()
	if err := os.WriteFile(file, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

// issue makes a certificate for 127.0.0.1 and localhost signed by ca, valid
// for the given uses, and writes it and its key to dir. It returns the two
// file names.
func (ca *testCA) issue(t testing.TB, dir, name string, usage ...x509.ExtKeyUsage) (certFile, keyFile string) {
	t.Helper()
	return ca.issueValid(t, dir, name, time.Now().Add(-time.Hour), time.Now().Add(time.Hour), usage...)
}

// issueValid is issue for a certificate valid from notBefore to notAfter.
func (ca *testCA) issueValid(t testing.TB, dir, name string, notBefore, notAfter time.Time, usage ...x509.ExtKeyUsage) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	sn, err := rand.Int(rand.Reader, big.NewInt(1<<62))
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: sn,
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    notBefore,
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  usage,
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1")},
		DNSNames:     []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, name+".pem"), filepath.Join(dir, name+"-key.pem")
	writePEM(t, certFile, "CERTIFICATE", der)
	writePEM(t, keyFile, "PRIVATE KEY", kder)
	return certFile, keyFile
}

// tlsClient returns a client trusting roots (nil: the system's) and
// presenting the certificate in certFile/keyFile, if given.
func tlsClient(t testing.TB, roots *testCA, certFile, keyFile string) *http.Client {
	t.Helper()
	cfg := &tls.Config{}
	if roots != nil {
		cfg.RootCAs = x509.NewCertPool()
		cfg.RootCAs.AddCert(roots.cert)
	}
	if certFile != "" {
		c, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Certificates = []tls.Certificate{c}
	}
	tr := &http.Transport{TLSClientConfig: cfg}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: waitTimeout}
}

// get sends GET url with c and returns the status, or the error.
func get(t testing.TB, c *http.Client, url string) (int, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, nil
}

var (
	serverAuth = x509.ExtKeyUsageServerAuth
	clientAuth = x509.ExtKeyUsageClientAuth
)

func TestTLS_Serve(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	nodes := clustertest.Redis(t, 1, cluster.RedisOptions{})
	url := clustertest.Database(t)
	serverCA := newCA(t, dir, "server")
	clientCA := newCA(t, dir, "client")
	strangerCA := newCA(t, dir, "stranger")
	srvCert, srvKey := serverCA.issue(t, dir, "redfence", serverAuth)
	cliCert, cliKey := clientCA.issue(t, dir, "alice", clientAuth)
	strCert, strKey := strangerCA.issue(t, dir, "mallory", clientAuth)

	t.Run("HTTPS", func(t *testing.T) {
		t.Parallel()
		cfg := testConfig(t, addrs(nodes), url)
		cfg.TLSCertFile, cfg.TLSKeyFile = srvCert, srvKey
		s, _ := open(t, cfg, discard)
		if !strings.HasPrefix(s.URL(), "https://") {
			t.Errorf("URL() = %s; want https://", s.URL())
		}
		if code, err := get(t, tlsClient(t, serverCA, "", ""), s.URL()+"/v1/locks/x"); err != nil || code != 200 {
			t.Errorf("GET over HTTPS = %d, %v; want 200", code, err)
		}
		if _, err := get(t, tlsClient(t, strangerCA, "", ""), s.URL()+"/healthz"); err == nil {
			t.Error("a client that does not trust the server's CA connected; want a verification error")
		}
		if code, err := get(t, http.DefaultClient, "http://"+s.Addr()+"/healthz"); err != nil || code != http.StatusBadRequest {
			t.Errorf("plain HTTP to the HTTPS port = %d, %v; want 400", code, err)
		}
		hc, base, err := cfg.healthClient("127.0.0.1", port(t, s.Addr()))
		if err != nil {
			t.Fatal(err)
		}
		if code, err := get(t, hc, base+"/healthz"); err != nil || code != 200 {
			t.Errorf("healthcheck over HTTPS = %d, %v; want 200", code, err)
		}
	})

	t.Run("MutualTLS", func(t *testing.T) {
		t.Parallel()
		cfg := testConfig(t, addrs(nodes), url)
		cfg.TLSCertFile, cfg.TLSKeyFile, cfg.TLSClientCAFile = srvCert, srvKey, clientCA.file
		s, _ := open(t, cfg, discard)
		if code, err := get(t, tlsClient(t, serverCA, cliCert, cliKey), s.URL()+"/v1/locks/x"); err != nil || code != 200 {
			t.Errorf("GET with a client certificate = %d, %v; want 200", code, err)
		}
		if code, err := get(t, tlsClient(t, serverCA, "", ""), s.URL()+"/healthz"); err == nil {
			t.Errorf("GET without a client certificate = %d; want the handshake refused", code)
		} else if !strings.Contains(err.Error(), "certificate") {
			t.Errorf("GET without a client certificate: %v; want a certificate error", err)
		}
		if code, err := get(t, tlsClient(t, serverCA, strCert, strKey), s.URL()+"/healthz"); err == nil {
			t.Errorf("GET with a certificate from another CA = %d; want the handshake refused", code)
		}
		// redfence lock, with the CA and a client certificate, and without.
		r := startLock(t.Context(), "--server", s.URL(), "--cacert", serverCA.file, "--cert", cliCert, "--key", cliKey, "mtls", "--", "true")
		if code := r.wait(t); code != 0 {
			t.Errorf("redfence lock over mTLS exited %d; want 0; stderr:\n%s", code, r.stderr.String())
		}
		r = startLock(t.Context(), "--server", s.URL(), "--cacert", serverCA.file, "mtls", "--", "true")
		if code := r.wait(t); code == 0 {
			t.Error("redfence lock without a client certificate exited 0; want the handshake refused")
		}
		r = startLock(t.Context(), "--server", s.URL(), "--cacert", cliKey, "mtls", "--", "true")
		if code := r.wait(t); code == 0 || r.err == nil || !strings.Contains(r.err.Error(), "--cacert") {
			t.Errorf("redfence lock with a CA file that is not one exited %d (%v); want an error naming --cacert", code, r.err)
		}
	})

	t.Run("HealthcheckWithMutualTLS", func(t *testing.T) {
		t.Parallel()
		// A server certificate that is also a client certificate under the
		// client CA lets `redfence healthcheck` pass mTLS.
		both, bothKey := clientCA.issue(t, dir, "redfence-both", serverAuth, clientAuth)
		cfg := testConfig(t, addrs(nodes), url)
		cfg.TLSCertFile, cfg.TLSKeyFile, cfg.TLSClientCAFile = both, bothKey, clientCA.file
		s, _ := open(t, cfg, discard)
		hc, base, err := cfg.healthClient("127.0.0.1", port(t, s.Addr()))
		if err != nil {
			t.Fatal(err)
		}
		if code, err := get(t, hc, base+"/healthz"); err != nil || code != 200 {
			t.Errorf("healthcheck with mTLS = %d, %v; want 200", code, err)
		}
	})

	t.Run("BadFiles", func(t *testing.T) {
		t.Parallel()
		for _, tc := range []struct {
			name      string
			cert, key string
			ca        string
			want      string
		}{
			{"MissingCert", filepath.Join(dir, "nope.pem"), srvKey, "", "REDFENCE_TLS_CERT_FILE"},
			{"KeyOfAnotherCert", srvCert, cliKey, "", "REDFENCE_TLS_CERT_FILE"},
			{"ClientCANotPEM", srvCert, srvKey, srvKey, "REDFENCE_TLS_CLIENT_CA_FILE"},
		} {
			cfg := testConfig(t, addrs(nodes), url)
			cfg.TLSCertFile, cfg.TLSKeyFile, cfg.TLSClientCAFile = tc.cert, tc.key, tc.ca
			s, err := Open(t.Context(), cfg, discard, ServerOptions{})
			if err == nil {
				_ = s.Close(context.Background())
				t.Errorf("%s: Open succeeded; want an error naming %s", tc.name, tc.want)
			} else if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: Open = %v; want an error naming %s", tc.name, err, tc.want)
			}
		}
	})
}

func port(t testing.TB, addr string) string {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestTLS_Reload replaces the certificate files and checks that the next
// handshake after a check serves the new certificate, and that a broken
// replacement keeps the old one.
func TestTLS_Reload(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca := newCA(t, dir, "ca")
	certFile, keyFile := ca.issue(t, dir, "one", serverAuth)
	var logs testutil.Buffer
	kp, err := newKeyPair(certFile, keyFile, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	first := kp.get().Certificate[0]

	two, twoKey := ca.issue(t, dir, "two", serverAuth)
	for _, f := range [][2]string{{two, certFile}, {twoKey, keyFile}} {
		if err := os.Rename(f[0], f[1]); err != nil {
			t.Fatal(err)
		}
	}
	if got := kp.get().Certificate[0]; !bytes.Equal(got, first) {
		t.Error("the certificate changed before the check interval passed")
	}
	kp.mu.Lock()
	kp.checked = time.Time{} // as if keyPairCheck had passed
	kp.mu.Unlock()
	second := kp.get().Certificate[0]
	if bytes.Equal(second, first) {
		t.Fatal("the replaced certificate was not reloaded")
	}

	if err := os.WriteFile(certFile, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	kp.mu.Lock()
	kp.checked = time.Time{}
	kp.mu.Unlock()
	if got := kp.get().Certificate[0]; !bytes.Equal(got, second) {
		t.Error("a broken replacement was served; want the previous certificate kept")
	}
	if !strings.Contains(logs.String(), "not reloaded") {
		t.Errorf("no warning about the failed reload; logs:\n%s", logs.String())
	}
}

// TestTLS_ReloadRefusesExpired: a replacement certificate that has
// expired, or is not valid yet, is refused as a broken one is: the
// previous certificate is kept and the reason logged. It was served (and
// "TLS certificate reloaded" logged), so an old certificate copied back by
// mistake failed every new client's handshake until the files were fixed.
// A certificate not valid at start is served, with a warning.
func TestTLS_ReloadRefusesExpired(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca := newCA(t, dir, "ca")
	certFile, keyFile := ca.issue(t, dir, "current", serverAuth)
	var logs testutil.Buffer
	kp, err := newKeyPair(certFile, keyFile, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	current := kp.get().Certificate[0]
	for _, tc := range []struct {
		name                string
		notBefore, notAfter time.Time
	}{
		{"expired", time.Now().Add(-2 * time.Hour), time.Now().Add(-time.Hour)},
		{"not-yet-valid", time.Now().Add(time.Hour), time.Now().Add(2 * time.Hour)},
	} {
		c, k := ca.issueValid(t, dir, tc.name, tc.notBefore, tc.notAfter, serverAuth)
		for _, f := range [][2]string{{c, certFile}, {k, keyFile}} {
			if err := os.Rename(f[0], f[1]); err != nil {
				t.Fatal(err)
			}
		}
		kp.mu.Lock()
		kp.checked = time.Time{} // as if keyPairCheck had passed
		kp.mu.Unlock()
		if got := kp.get().Certificate[0]; !bytes.Equal(got, current) {
			t.Errorf("%s replacement: served; want the previous certificate kept", tc.name)
		}
	}
	if n := strings.Count(logs.String(), "is not valid now"); n != 2 || strings.Contains(logs.String(), "TLS certificate reloaded") {
		t.Errorf("want two warnings naming the validity and no reload; logs:\n%s", logs.String())
	}

	c, k := ca.issueValid(t, dir, "expired-at-start", time.Now().Add(-2*time.Hour), time.Now().Add(-time.Hour), serverAuth)
	logs = testutil.Buffer{}
	if _, err := newKeyPair(c, k, slog.New(slog.NewTextHandler(&logs, nil))); err != nil {
		t.Fatalf("newKeyPair with an expired certificate: %v; want it served, with a warning", err)
	}
	if !strings.Contains(logs.String(), "is not valid now") {
		t.Errorf("no warning about an expired certificate at start; logs:\n%s", logs.String())
	}
}

// startTLSRedis starts a redis-server that accepts only TLS connections with
// a client certificate signed by ca, and returns its address.
func startTLSRedis(t testing.TB, dir string, ca *testCA) string {
	t.Helper()
	certFile, keyFile := ca.issue(t, dir, "redis", serverAuth)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	cmd := exec.Command("redis-server", "--port", "0", "--tls-port", port(t, addr), "--bind", "127.0.0.1",
		"--tls-cert-file", certFile, "--tls-key-file", keyFile, "--tls-ca-cert-file", ca.file,
		"--tls-auth-clients", "yes", "--save", "", "--appendonly", "no", "--dir", dir)
	var out testutil.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = testutil.KillWithParent(nil)
	if err := cmd.Start(); err != nil {
		t.Fatalf("redis-server: %v", err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
	})

	cliCert, cliKey := ca.issue(t, dir, "redis-probe", clientAuth)
	c, err := tls.LoadX509KeyPair(cliCert, cliKey)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca.cert)
	probe := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1,
		TLSConfig: &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{c}}})
	defer probe.Close()
	testutil.WaitFor(t, waitTimeout, "redis-server to answer over TLS", func() (bool, error) {
		select {
		case <-exited:
			return false, errors.New("redis-server exited:\n" + out.String())
		default:
		}
		return probe.Ping(t.Context()).Err() == nil, nil
	})
	return addr
}

// TestTLS_Redis connects to a Redis node that requires TLS and a client
// certificate.
func TestTLS_Redis(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca := newCA(t, dir, "redis")
	addr := startTLSRedis(t, dir, ca)
	certFile, keyFile := ca.issue(t, dir, "redfence-client", clientAuth)
	url := clustertest.Database(t)

	for _, tc := range []struct {
		name   string
		change func(*Config)
		want   int
	}{
		{"TLSWithClientCert", func(c *Config) {
			c.RedisTLS, c.RedisTLSCAFile, c.RedisTLSCertFile, c.RedisTLSKeyFile = true, ca.file, certFile, keyFile
		}, http.StatusCreated},
		{"Plaintext", func(c *Config) {}, http.StatusServiceUnavailable},
		{"NoClientCert", func(c *Config) { c.RedisTLS, c.RedisTLSCAFile = true, ca.file }, http.StatusServiceUnavailable},
		{"UntrustedServer", func(c *Config) {
			c.RedisTLS, c.RedisTLSCertFile, c.RedisTLSKeyFile = true, certFile, keyFile
		}, http.StatusServiceUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(t, []string{addr}, url)
			cfg.NodeTimeout = 5 * time.Second
			tc.change(cfg)
			s, _ := open(t, cfg, discard)
			r := call(t, http.MethodPost, s.Addr(), "/v1/locks/"+tc.name, `{"ttl_ms":10000}`)
			if r.status != tc.want {
				t.Errorf("acquire through %s = %d %s; want %d", tc.name, r.status, r.body, tc.want)
			}
		})
	}
}

// TestTLS_KeyGivenInline: a private key pasted into a setting that names
// its file (REDFENCE_TLS_KEY_FILE, REDFENCE_REDIS_TLS_KEY_FILE) is refused
// without quoting it: the error of opening a file of that name would put
// the whole key in the log.
func TestTLS_KeyGivenInline(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca := newCA(t, dir, "inline")
	certFile, keyFile := ca.issue(t, dir, "server", x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth)
	keyPEM, err := os.ReadFile(keyFile)
	if err != nil {
		t.Fatal(err)
	}
	inline := string(keyPEM)
	secret := strings.Split(inline, "\n")[1][:20] // the key's first base64 line
	check := func(what string, err error) {
		t.Helper()
		if err == nil || strings.Contains(err.Error(), secret) || !strings.Contains(err.Error(), "not a file name") {
			t.Errorf("%s with the key inline = %v; want an error saying it is not a file name, without the key", what, err)
		}
	}
	c := testConfig(t, nil, "")
	c.TLSCertFile, c.TLSKeyFile = certFile, inline
	_, err = c.serverTLS(slog.New(slog.DiscardHandler))
	check("serverTLS", err)
	c.TLSClientCAFile = ca.file
	_, _, err = c.healthClient("127.0.0.1", "8080")
	check("healthClient", err)
	c = testConfig(t, nil, "")
	c.RedisTLS, c.RedisTLSCertFile, c.RedisTLSKeyFile = true, certFile, inline
	_, err = c.redisTLS()
	check("redisTLS", err)
	// A missing file is still named.
	c.RedisTLSKeyFile = filepath.Join(dir, "missing.pem")
	if _, err := c.redisTLS(); err == nil || !strings.Contains(err.Error(), "missing.pem") {
		t.Errorf("redisTLS with a missing key file = %v; want an error naming it", err)
	}
}
