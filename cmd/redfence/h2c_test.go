package main

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/internal/testutil"
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

// TestServer_H2StreamResetMidBody: an HTTP/2 client that resets its stream
// (RST_STREAM CANCEL: its request was cancelled) while sending the body
// has left; the request is logged and counted as 499 cancelled, as any
// request whose client left. It was 400 invalid-request ("the body could
// not be read: stream error: ... CANCEL"): a reset flood showed up as
// thousands of client errors in the metrics and the log.
func TestServer_H2StreamResetMidBody(t *testing.T) {
	t.Parallel()
	nodes := clustertest.Redis(t, 3, cluster.RedisOptions{})
	cfg := testConfig(t, addrs(nodes), clustertest.Database(t))
	cfg.H2C = true
	var logs testutil.Buffer
	s, _ := open(t, cfg, slog.New(slog.NewJSONHandler(&logs, nil)))
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	h2 := &http.Client{Transport: &http.Transport{Protocols: &p}}
	t.Cleanup(h2.CloseIdleConnections)

	ctx, cancel := context.WithCancel(t.Context())
	pr, pw := io.Pipe()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+s.Addr()+"/v1/locks/reset-mid-body", pr)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	done := make(chan error, 1)
	go func() {
		resp, err := h2.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	// The transport takes the body's first bytes once it has sent the
	// request's headers.
	if _, err := io.WriteString(pw, `{"ttl_ms":`); err != nil {
		t.Fatal(err)
	}
	cancel() // RST_STREAM
	if err := <-done; err == nil {
		t.Fatal("the cancelled request got an answer")
	}
	pw.Close()
	var line struct {
		Msg     string `json:"msg"`
		Problem string `json:"problem"`
		Error   string `json:"error"`
		Path    string `json:"path"`
		Status  int    `json:"status"`
	}
	testutil.WaitFor(t, waitTimeout, "the access line of the reset request", func() (bool, error) {
		for l := range strings.Lines(logs.String()) {
			if json.Unmarshal([]byte(l), &line) == nil && line.Msg == "http request" && line.Path == "/v1/locks/reset-mid-body" {
				return true, nil
			}
		}
		return false, nil
	})
	if line.Status != 499 {
		t.Errorf("access line of a request whose client reset its stream mid-body: status %d; want 499", line.Status)
	}
	for l := range strings.Lines(logs.String()) {
		if json.Unmarshal([]byte(l), &line) == nil && line.Msg == "request failed" && line.Problem != "cancelled" {
			t.Errorf("request failed as %q (%s); want cancelled", line.Problem, line.Error)
		}
	}
}
