package main

import (
	"bufio"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redfence/redfence/internal/cluster"
	"github.com/redfence/redfence/internal/cluster/clustertest"
)

// TestServer_Hardening runs the real server with its http.Server limits and
// shows hostile clients are cut off or refused while others are served.
func TestServer_Hardening(t *testing.T) {
	t.Parallel()
	nodes := clustertest.Redis(t, 3, cluster.RedisOptions{})
	cfg := testConfig(t, addrs(nodes), clustertest.Database(t))
	cfg.ReadHeaderTimeout = 500 * time.Millisecond
	s, _ := open(t, cfg, discard)
	addr := s.Addr()

	t.Run("Slowloris", func(t *testing.T) {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		// Headers that never end, trickled in to keep the connection busy.
		if _, err := io.WriteString(conn, "GET /healthz HTTP/1.1\r\nHost: x\r\n"); err != nil {
			t.Fatal(err)
		}
		stop := make(chan struct{})
		defer close(stop)
		go func() {
			tick := time.NewTicker(50 * time.Millisecond) // the slow client's pace: the fault
			defer tick.Stop()
			for {
				select {
				case <-stop:
					return
				case <-tick.C:
					if _, err := io.WriteString(conn, "X-Slow: 1\r\n"); err != nil {
						return
					}
				}
			}
		}()
		// Meanwhile other clients are served.
		for range 5 {
			expect(t, "healthz during slowloris", call(t, http.MethodGet, addr, "/healthz", ""), http.StatusOK, nil)
		}
		// The server closes the slow connection (ReadHeaderTimeout); a read
		// deadline far beyond it only guards against a hang.
		if err := conn.SetReadDeadline(time.Now().Add(waitTimeout)); err != nil {
			t.Fatal(err)
		}
		_, err = io.ReadAll(conn)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatal("the server never closed a connection whose headers did not end")
		}
	})

	t.Run("OptionsStar", func(t *testing.T) {
		resp := rawRequest(t, addr, "OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
		if resp.StatusCode < 400 || resp.Header.Get("Content-Type") != "application/problem+json" || resp.Header.Get("X-Request-Id") == "" {
			t.Errorf("OPTIONS * = %d %v; want a problem+json error with a request ID", resp.StatusCode, resp.Header)
		}
	})

	t.Run("HeadersTooLarge", func(t *testing.T) {
		r := call(t, http.MethodGet, addr, "/v1/locks/x", "", "X-Big", strings.Repeat("b", 70<<10))
		if r.status != http.StatusRequestHeaderFieldsTooLarge || r.header.Get("Content-Type") != "application/problem+json" {
			t.Errorf("70 KiB of headers = %d %s; want 431 problem+json", r.status, r.header.Get("Content-Type"))
		}
	})

	// The limit counts every byte of the request line and headers as sent
	// in the usual form (Host and the blank line that ends them included).
	t.Run("HeadersAtLimit", func(t *testing.T) {
		raw := func(size int, chunked bool) *http.Response {
			t.Helper()
			head, tail, body := "GET /v1/locks/x HTTP/1.1\r\nHost: redfence.test\r\nX-Pad: ", "\r\nConnection: close\r\n\r\n", ""
			if chunked { // net/http moves these headers out of Header
				head = "POST /v1/locks/x HTTP/1.1\r\nHost: redfence.test\r\nTransfer-Encoding: chunked\r\nTrailer: X-A, X-B\r\nContent-Type: application/json\r\nX-Pad: "
				body = "2\r\n{}\r\n0\r\n\r\n"
			}
			req := head + strings.Repeat("p", size-len(head)-len(tail)) + tail
			if len(req) != size {
				t.Fatalf("request of %d bytes; want %d", len(req), size)
			}
			return rawRequest(t, addr, req+body)
		}
		for _, chunked := range []bool{false, true} {
			if r := raw(cfg.MaxHeaderBytes, chunked); r.StatusCode == http.StatusRequestHeaderFieldsTooLarge {
				t.Errorf("chunked %v: headers of exactly REDFENCE_MAX_HEADER_BYTES (%d) = %d; want them served", chunked, cfg.MaxHeaderBytes, r.StatusCode)
			}
			if r := raw(cfg.MaxHeaderBytes+1, chunked); r.StatusCode != http.StatusRequestHeaderFieldsTooLarge || r.Header.Get("Content-Type") != "application/problem+json" {
				t.Errorf("chunked %v: headers of REDFENCE_MAX_HEADER_BYTES + 1 = %d %s; want 431 problem+json", chunked, r.StatusCode, r.Header.Get("Content-Type"))
			}
		}
	})

	// What net/http refuses before Redfence sees the request, as
	// openapi.yaml's Conventions say: in plain text, without a problem.
	t.Run("GoPlainText", func(t *testing.T) {
		for _, tc := range []struct {
			name, req string
			status    int
		}{
			{"ControlInValue", "GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\x01b\r\nConnection: close\r\n\r\n", http.StatusBadRequest},
			{"HeadersTwiceTheLimit", "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + strings.Repeat("b", 2*cfg.MaxHeaderBytes+8<<10) + "\r\nConnection: close\r\n\r\n",
				http.StatusRequestHeaderFieldsTooLarge},
		} {
			if r := rawRequest(t, addr, tc.req); r.StatusCode != tc.status || !strings.HasPrefix(r.Header.Get("Content-Type"), "text/plain") {
				t.Errorf("%s = %d %s; want Go's plain-text %d", tc.name, r.StatusCode, r.Header.Get("Content-Type"), tc.status)
			}
		}
	})

	t.Run("BodyTooLarge", func(t *testing.T) {
		r := call(t, http.MethodPost, addr, "/v1/locks/x", `{"owner":"`+strings.Repeat("o", 2<<20)+`"}`)
		if r.status != http.StatusRequestEntityTooLarge || r.header.Get("Content-Type") != "application/problem+json" {
			t.Errorf("2 MiB body = %d %s; want 413 problem+json", r.status, r.header.Get("Content-Type"))
		}
	})

	t.Run("StillServing", func(t *testing.T) {
		acquire(t, addr, "after-hostile-clients")
	})
}

// rawRequest sends req as written to the server at addr on a connection of
// its own and returns the answer (its body closed).
func rawRequest(t *testing.T, addr, req string) *http.Response {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := io.WriteString(conn, req); err != nil {
		t.Fatal(err)
	}
	if err := conn.SetReadDeadline(time.Now().Add(waitTimeout)); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp
}
