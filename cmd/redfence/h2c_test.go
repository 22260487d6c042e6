package main

import (
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
)

// TestServer_H2C: with REDFENCE_H2C=true and no TLS the server speaks HTTP/2
// to a client with prior knowledge (and HTTP/1.1 to everyone else), and a
// lock taken over HTTP/2 is released over HTTP/1.1; by default it serves
// HTTP/1.1 only.
func TestServer_H2C(t *testing.T) {
	t.Parallel()
	nodes := clustertest.Redis(t, 3, cluster.RedisOptions{})
	db := clustertest.Database(t)
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	h2 := &http.Client{Transport: &http.Transport{Protocols: &p}}
	t.Cleanup(h2.CloseIdleConnections)

	t.Run("On", func(t *testing.T) {
		cfg := testConfig(t, addrs(nodes), db)
		cfg.H2C = true
		s, _ := open(t, cfg, discard)
		req, _ := http.NewRequest(http.MethodPost, "http://"+s.Addr()+"/v1/locks/h2c", strings.NewReader(`{"ttl_ms":10000}`))
		req.Header.Set("Content-Type", "application/json")
		resp, err := h2.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.ProtoMajor != 2 || resp.StatusCode != http.StatusCreated {
			t.Fatalf("acquire over h2c: %s %s %s", resp.Proto, resp.Status, body)
		}
		var g struct {
			LockToken string `json:"lock_token"`
		}
		expect(t, "acquire body", response{status: resp.StatusCode, header: resp.Header, body: body}, http.StatusCreated, &g)
		expect(t, "release over HTTP/1.1", call(t, http.MethodDelete, s.Addr(), "/v1/locks/h2c", "", "Lock-Token", g.LockToken), http.StatusNoContent, nil)
	})

	t.Run("Off", func(t *testing.T) {
		cfg := testConfig(t, addrs(nodes), db)
		if cfg.H2C {
			t.Fatal("REDFENCE_H2C is on by default")
		}
		s, _ := open(t, cfg, discard)
		_, err := h2.Get("http://" + s.Addr() + "/healthz")
		if err == nil {
			t.Fatal("an HTTP/2 prior-knowledge request was served without REDFENCE_H2C")
		}
		var ne interface{ Timeout() bool }
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatalf("h2c request: %v; want a refusal, not a hang", err)
		}
		expect(t, "healthz over HTTP/1.1", call(t, http.MethodGet, s.Addr(), "/healthz", ""), http.StatusOK, nil)
	})
}
