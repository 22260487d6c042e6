package main

// A lean HTTP/1.1 load generator, in the manner of wrk: every worker owns
// one keep-alive connection and writes each request with one write from a
// reused buffer, then reads the response on the same goroutine. net/http's
// client costs about three goroutine hand-offs and ~30 µs of CPU per request
// (its connection's read and write loops), which on a 2-core machine is CPU
// taken from the server under test; -systems http-nethttp keeps it for
// comparison.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"time"
)

// rawHTTPSystem drives `redfence serve` over HTTP/1.1 with rawConn workers.
type rawHTTPSystem struct {
	label string
	srv   *redfenceServer
	addr  string // host:port
	ttlMS int64
	auth  string // "Bearer <API key>", or ""
}

func newRawHTTPSystem(label string, srv *redfenceServer, apiKey string, ttl time.Duration) *rawHTTPSystem {
	s := &rawHTTPSystem{label: label, srv: srv, addr: strings.TrimPrefix(srv.base, "http://"), ttlMS: ttl.Milliseconds()}
	if apiKey != "" {
		s.auth = "Bearer " + apiKey
	}
	return s
}

func (s *rawHTTPSystem) name() string   { return s.label }
func (s *rawHTTPSystem) serverPID() int { return s.srv.pid() }
func (s *rawHTTPSystem) close()         {}

func (s *rawHTTPSystem) worker(context.Context, int) (worker, error) {
	return &rawConn{sys: s}, nil
}

// rawConn is one worker's connection. It is used by one goroutine.
type rawConn struct {
	sys  *rawHTTPSystem
	conn net.Conn
	r    *bufio.Reader
	wbuf []byte
	body []byte
}

func (c *rawConn) close() {
	if c.conn != nil {
		_ = c.conn.Close()
		c.conn = nil
	}
}

// response is the part of a response the load generator looks at.
type response struct {
	status int
	body   []byte // valid until the next request
}

// do sends one request and reads its response. A connection that fails or
// that the server closes is dropped and redialled by the next request.
func (c *rawConn) do(ctx context.Context, method, path string, hdr func([]byte) []byte, body []byte) (response, error) {
	if err := ctx.Err(); err != nil {
		return response{}, err
	}
	if c.conn == nil {
		var d net.Dialer
		conn, err := d.DialContext(ctx, "tcp", c.sys.addr)
		if err != nil {
			return response{}, err
		}
		c.conn, c.r = conn, bufio.NewReaderSize(conn, 4096)
	}
	b := c.wbuf[:0]
	b = append(b, method...)
	b = append(b, ' ')
	b = append(b, path...)
	b = append(b, " HTTP/1.1\r\nHost: "...)
	b = append(b, c.sys.addr...)
	b = append(b, "\r\n"...)
	if c.sys.auth != "" {
		b = append(b, "Authorization: "...)
		b = append(b, c.sys.auth...)
		b = append(b, "\r\n"...)
	}
	if hdr != nil {
		b = hdr(b)
	}
	if body != nil {
		b = append(b, "Content-Type: application/json\r\nContent-Length: "...)
		b = strconv.AppendInt(b, int64(len(body)), 10)
		b = append(b, "\r\n"...)
	}
	b = append(b, "\r\n"...)
	b = append(b, body...)
	c.wbuf = b

	// A cancelled ctx interrupts the exchange through the deadline.
	if dl, ok := ctx.Deadline(); ok {
		_ = c.conn.SetDeadline(dl)
	} else {
		_ = c.conn.SetDeadline(time.Time{})
	}
	conn := c.conn
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	resp, keep, err := c.exchange(b)
	if !stop() || err != nil || !keep {
		c.close()
	}
	if err != nil {
		if cerr := ctx.Err(); cerr != nil {
			return response{}, cerr
		}
		return response{}, err
	}
	return resp, nil
}

// exchange writes req and reads the response: status line, headers and a
// body framed by Content-Length or chunked. keep is false when the server
// closes the connection after this response.
func (c *rawConn) exchange(req []byte) (resp response, keep bool, err error) {
	if _, err := c.conn.Write(req); err != nil {
		return resp, false, err
	}
	line, err := c.line()
	if err != nil {
		return resp, false, err
	}
	// "HTTP/1.1 201 Created"
	if len(line) < 12 || !bytes.HasPrefix(line, []byte("HTTP/1.")) {
		return resp, false, fmt.Errorf("bad status line %q", line)
	}
	resp.status, err = strconv.Atoi(string(line[9:12]))
	if err != nil {
		return resp, false, fmt.Errorf("bad status line %q", line)
	}
	keep = line[7] == '1'
	length, chunked := -1, false
	for {
		line, err := c.line()
		if err != nil {
			return resp, false, err
		}
		if len(line) == 0 {
			break
		}
		k, v, ok := bytes.Cut(line, []byte(":"))
		if !ok {
			return resp, false, fmt.Errorf("bad header line %q", line)
		}
		v = bytes.TrimSpace(v)
		switch {
		case bytes.EqualFold(k, []byte("Content-Length")):
			if length, err = strconv.Atoi(string(v)); err != nil || length < 0 {
				return resp, false, fmt.Errorf("bad Content-Length %q", v)
			}
		case bytes.EqualFold(k, []byte("Transfer-Encoding")):
			chunked = bytes.EqualFold(v, []byte("chunked"))
		case bytes.EqualFold(k, []byte("Connection")):
			if bytes.EqualFold(v, []byte("close")) {
				keep = false
			}
		}
	}
	c.body = c.body[:0]
	switch {
	case resp.status == 204 || resp.status == 304 || resp.status/100 == 1:
	case chunked:
		if err := c.chunks(); err != nil {
			return resp, false, err
		}
	case length >= 0:
		c.body = append(c.body, make([]byte, length)...)
		if _, err := io.ReadFull(c.r, c.body); err != nil {
			return resp, false, err
		}
	default: // delimited by the end of the connection
		all, err := io.ReadAll(c.r)
		if err != nil {
			return resp, false, err
		}
		c.body, keep = append(c.body, all...), false
	}
	resp.body = c.body
	return resp, keep, nil
}

// chunks reads a chunked body into c.body.
func (c *rawConn) chunks() error {
	for {
		line, err := c.line()
		if err != nil {
			return err
		}
		size, _, _ := bytes.Cut(line, []byte(";"))
		n, err := strconv.ParseInt(string(bytes.TrimSpace(size)), 16, 32)
		if err != nil || n < 0 {
			return fmt.Errorf("bad chunk size %q", line)
		}
		if n == 0 {
			for { // trailers, up to the empty line
				line, err := c.line()
				if err != nil {
					return err
				}
				if len(line) == 0 {
					return nil
				}
			}
		}
		at := len(c.body)
		c.body = append(c.body, make([]byte, n)...)
		if _, err := io.ReadFull(c.r, c.body[at:]); err != nil {
			return err
		}
		if crlf, err := c.line(); err != nil || len(crlf) != 0 {
			return errors.Join(errors.New("bad chunk end"), err)
		}
	}
}

// line reads one CRLF-terminated line (without the CRLF). It is valid until
// the next read.
func (c *rawConn) line() ([]byte, error) {
	l, err := c.r.ReadSlice('\n')
	if err != nil {
		return nil, err
	}
	l = bytes.TrimSuffix(l[:len(l)-1], []byte("\r"))
	return l, nil
}

func (c *rawConn) acquire(ctx context.Context, name string, wait time.Duration) (releaseFunc, error) {
	body := fmt.Appendf(nil, `{"ttl_ms":%d,"wait_ms":%d}`, c.sys.ttlMS, wait.Milliseconds())
	resp, err := c.do(ctx, "POST", "/v1/locks/"+name, nil, body)
	if err != nil {
		return nil, err
	}
	switch resp.status {
	case 201:
	case 409:
		var p problemBody
		_ = json.Unmarshal(resp.body, &p)
		if strings.HasSuffix(p.Type, ":wait-timeout") {
			return nil, errWaitTimeout
		}
		return nil, errHeld
	default:
		return nil, fmt.Errorf("acquire: HTTP %d: %s", resp.status, bytes.TrimSpace(resp.body))
	}
	var g grantBody
	if err := json.Unmarshal(resp.body, &g); err != nil || g.LockToken == "" || g.FencingToken < 1 {
		return nil, fmt.Errorf("acquire: bad 201 body %q (%v)", resp.body, err)
	}
	return func(ctx context.Context) error {
		resp, err := c.do(ctx, "DELETE", "/v1/locks/"+name, func(b []byte) []byte {
			b = append(b, "Lock-Token: "...)
			b = append(b, g.LockToken...)
			return append(b, "\r\n"...)
		}, nil)
		if err != nil {
			return err
		}
		if resp.status != 204 {
			return fmt.Errorf("release: HTTP %d: %s", resp.status, bytes.TrimSpace(resp.body))
		}
		return nil
	}, nil
}
