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

	"github.com/redfence/redfence/service"
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

// TestQuorumDetail: a 503 quorum-unavailable says whether nodes failed to
// answer, or every node answered and the votes split (quarantined nodes'
// answers not counting).
func TestQuorumDetail(t *testing.T) {
	t.Parallel()
	n := func(os ...service.Outcome) []service.NodeResult {
		rs := make([]service.NodeResult, len(os))
		for i, o := range os {
			rs[i].Outcome = o
		}
		return rs
	}
	for _, tc := range []struct {
		nodes []service.NodeResult
		want  string
	}{
		{nil, "fewer Redis nodes than a majority answered"},
		{n(service.Yes, service.Yes, service.Timeout, service.Failed, service.No), "of 5 nodes, 2 did not answer"},
		{n(service.Yes, service.Timeout, service.Timeout, service.Failed, service.No), "fewer Redis nodes than a majority answered"},
		{n(service.Yes, service.Quarantined, service.Timeout, service.No, service.No), "of 5 nodes, 1 did not answer and 1 are quarantined"},
		{n(service.Yes, service.Yes, service.Timeout, service.No, service.No), "of 5 nodes, 1 did not answer and 0 are quarantined"},
		{n(service.Yes, service.Yes, service.Quarantined, service.No, service.No), "0 did not answer and 1 are quarantined"},
		{n(service.Yes, service.Yes, service.No, service.No), "the nodes' answers split"},
		{n(service.Yes, service.Yes, service.Quarantined, service.Quarantined, service.Quarantined), "fewer Redis nodes than a majority count: of 5 nodes, 3 are quarantined"},
		{n(service.Yes, service.Timeout, service.Quarantined, service.Quarantined, service.Yes), "2 are quarantined"},
	} {
		if got := quorumDetail(tc.nodes); !strings.Contains(got, tc.want) {
			t.Errorf("quorumDetail(%v) = %q; want it to say %q", tc.nodes, got, tc.want)
		}
	}
}
