package api

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/redis/go-redis/v9"
)

// TestNodeErrorText: a node's error reaches clients as one sentence per
// kind of failure, without this server's socket addresses or Go's
// wording; the node's own replies are kept.
func TestNodeErrorText(t *testing.T) {
	addr := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 36228}
	peer := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 33987}
	op := func(o string, err error) error {
		return fmt.Errorf("acquire: %w", &net.OpError{Op: o, Net: "tcp", Source: addr, Addr: peer, Err: err})
	}
	for _, tc := range []struct {
		err  error
		want string
	}{
		{op("read", os.ErrDeadlineExceeded), "no answer within the per-node timeout"},
		{fmt.Errorf("ttl: %w", context.DeadlineExceeded), "no answer within the per-node timeout"},
		{fmt.Errorf("acquire: %w", io.EOF), "the node closed the connection"},
		{op("read", os.NewSyscallError("read", syscall.ECONNRESET)), "the node closed the connection"},
		{op("dial", os.NewSyscallError("connect", syscall.ECONNREFUSED)), "connection refused (is the node running?)"},
		{op("dial", os.NewSyscallError("connect", syscall.EHOSTUNREACH)), "connection failed: dial: connect: no route to host"},
		{fmt.Errorf("acquire: %w", redis.ErrClosed), "acquire: redis: client is closed"},
		{errors.New("acquire: NOPERM this user has no permissions to run the 'evalsha' command"), "acquire: NOPERM this user has no permissions to run the 'evalsha' command"},
	} {
		got := nodeErrorText(tc.err)
		if got != tc.want {
			t.Errorf("nodeErrorText(%v) = %q; want %q", tc.err, got, tc.want)
		}
		if strings.Contains(got, "36228") || strings.Contains(got, "33987") {
			t.Errorf("nodeErrorText(%v) = %q names a socket address", tc.err, got)
		}
	}
}
