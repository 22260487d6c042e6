package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
)

// TestServer_CloseCleansUpCutShortAcquires: acquires that won their quorum
// and are still at issuance when the grace period ends are cut short; each
// deletes what its try set on the nodes before it returns. Close waits for
// that before it closes the nodes: otherwise the deletes meet closed
// connections, and the keys refuse the names to everyone until their TTL,
// with nobody holding them and no token issued.
func TestServer_CloseCleansUpCutShortAcquires(t *testing.T) {
	t.Parallel()
	nodes := clustertest.Redis(t, 5, cluster.RedisOptions{})
	cfg := testConfig(t, addrs(nodes), clustertest.Database(t))
	cfg.NodeTimeout = 500 * time.Millisecond
	const n = 12
	reached := make(chan string, n)
	s, err := Open(t.Context(), cfg, discard, ServerOptions{AfterQuorum: func(ctx context.Context, key string) {
		reached <- key
		<-ctx.Done() // held at issuance until the shutdown cuts the request short
	}})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			req, err := http.NewRequest(http.MethodPost, "http://"+s.Addr()+fmt.Sprintf("/v1/locks/cut-%d", i), strings.NewReader(`{"ttl_ms":60000}`))
			if err != nil {
				t.Error(err)
				return
			}
			req.Header.Set("Content-Type", "application/json")
			resp, err := httpClient.Do(req)
			if err != nil {
				return // cut short: no answer
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			t.Errorf("acquire of cut-%d answered %d %s; want it cut short at issuance", i, resp.StatusCode, b)
			reached <- "" // not held: do not wait for it
		})
	}
	for range n {
		select {
		case <-reached:
		case <-time.After(waitTimeout):
			t.Fatal("the acquires did not reach issuance")
		}
	}
	ended, cancel := context.WithCancel(context.Background())
	cancel() // the grace period is over at once
	if err := s.Close(ended); err == nil {
		t.Error("Close with its grace period over = nil; want the shutdown's error")
	}
	wg.Wait()
	for _, node := range nodes {
		c := redis.NewClient(&redis.Options{Addr: node.Addr(), MaxRetries: -1})
		keys, err := c.Keys(t.Context(), "redfence:lock:*").Result()
		c.Close()
		if err != nil {
			t.Fatal(err)
		}
		if len(keys) > 0 {
			t.Errorf("node %s holds %d lock keys after the shutdown (%q...); want none: the cut-short tries' deletes must land before the nodes close", node.Addr(), len(keys), keys[0])
		}
	}
}

// TestServer_CutShortGetsNoAnswer: when the grace period ends, the server
// cancels the requests still running; each is cut short and gets no answer,
// over HTTP/1.1 and HTTP/2. It got a 499 cancelled ("the client closed the
// request", which openapi.yaml says the client never sees) whenever its
// handler wrote before the connection closed, as an h2c load test saw for
// writes and extends held up by a stopped Postgres: a client that did not
// leave was told it did, and a write whose commit may have been sent was
// answered as a client error. The cut is applied here without closing the
// connections (s.stop, as Close does before it closes them), so that an
// answer, if one is written, reaches the client.
func TestServer_CutShortGetsNoAnswer(t *testing.T) {
	t.Parallel()
	nodes := clustertest.Redis(t, 3, cluster.RedisOptions{})
	cfg := testConfig(t, addrs(nodes), clustertest.Database(t))
	cfg.H2C = true
	reached := make(chan string, 2)
	s, err := Open(t.Context(), cfg, discard, ServerOptions{AfterQuorum: func(ctx context.Context, key string) {
		reached <- key
		<-ctx.Done() // held until the server cuts the request short
	}})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Close(context.Background()); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	h2 := &http.Client{Transport: &http.Transport{Protocols: &p}, Timeout: waitTimeout}
	t.Cleanup(h2.CloseIdleConnections)
	type answer struct {
		proto  string
		status int
		body   []byte
		err    error
	}
	answers := make(chan answer, 2)
	for i, c := range []*http.Client{httpClient, h2} {
		go func() {
			req, err := http.NewRequest(http.MethodPost, "http://"+s.Addr()+fmt.Sprintf("/v1/locks/cut-%d", i), strings.NewReader(`{"ttl_ms":60000}`))
			if err != nil {
				answers <- answer{err: err}
				return
			}
			req.Header.Set("Content-Type", "application/json")
			resp, err := c.Do(req)
			if err != nil {
				answers <- answer{err: err}
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			answers <- answer{resp.Proto, resp.StatusCode, b, nil}
		}()
	}
	for range 2 {
		select {
		case <-reached:
		case a := <-answers:
			t.Fatalf("an acquire answered before the cut: %s %d %s %v", a.proto, a.status, a.body, a.err)
		case <-time.After(waitTimeout):
			t.Fatal("the acquires did not reach issuance")
		}
	}
	s.stop() // the grace period is over
	for range 2 {
		select {
		case a := <-answers:
			if a.err == nil {
				t.Errorf("an acquire cut short by the shutdown answered %s %d %s; want no answer (a connection or stream error)", a.proto, a.status, a.body)
			}
		case <-time.After(waitTimeout):
			t.Fatal("an acquire cut short still runs")
		}
	}
}
