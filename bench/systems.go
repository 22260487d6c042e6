package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strings"
	"time"

	"github.com/go-redsync/redsync/v4"
	rsredis "github.com/go-redsync/redsync/v4/redis"
	"github.com/go-redsync/redsync/v4/redis/goredis/v9"
	"github.com/redis/go-redis/v9"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"

	"github.com/redfence/redfence/internal/keyspace"
	"github.com/redfence/redfence/service"
)

// Outcomes of one acquire that are not failures of the system under test.
var (
	// errHeld: a try-lock found the lock held (contended case).
	errHeld = errors.New("held")
	// errWaitTimeout: a blocking acquire's wait ran out.
	errWaitTimeout = errors.New("wait timed out")
)

// releaseFunc releases what an acquire granted.
type releaseFunc func(ctx context.Context) error

// system is one lock implementation under test.
type system interface {
	// name is the label in the table.
	name() string
	// worker returns the client of worker i (most systems share one).
	worker(ctx context.Context, i int) (worker, error)
	// serverPID is the process charged as "server" (0: none, the lock
	// logic runs in this process).
	serverPID() int
	close()
}

// worker acquires locks for one load-generating goroutine.
type worker interface {
	// acquire takes the lock on name. wait 0 tries once (errHeld when held);
	// otherwise it blocks up to wait (errWaitTimeout).
	acquire(ctx context.Context, name string, wait time.Duration) (releaseFunc, error)
	close()
}

// acquirer is what a worker does; shared wraps one that all workers share
// (closing a worker must not close the system).
type acquirer interface {
	acquire(ctx context.Context, name string, wait time.Duration) (releaseFunc, error)
}

type shared struct{ acquirer }

func (shared) close() {}

// ---- Redfence over HTTP ---------------------------------------------------

// httpSystem drives a `redfence serve` process over HTTP/1.1 keep-alive
// connections (one per worker at most: MaxIdleConnsPerHost >= workers), or
// over HTTP/2 cleartext with prior knowledge (h2c: every worker's requests
// multiplexed on one connection).
type httpSystem struct {
	label  string
	srv    *redfenceServer
	client *http.Client
	ttlMS  int64
	auth   string // "Bearer <API key>", or "" when the server runs without auth
}

func newHTTPSystem(label string, srv *redfenceServer, apiKey string, maxWorkers int, ttl time.Duration, h2c bool) *httpSystem {
	tr := &http.Transport{
		MaxIdleConns:        2*maxWorkers + 16,
		MaxIdleConnsPerHost: 2*maxWorkers + 16,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
		ForceAttemptHTTP2:   false,
	}
	if h2c {
		var p http.Protocols
		p.SetUnencryptedHTTP2(true)
		tr.Protocols = &p
	}
	s := &httpSystem{label: label, srv: srv, client: &http.Client{Transport: tr, Timeout: 2 * time.Minute}, ttlMS: ttl.Milliseconds()}
	if apiKey != "" {
		s.auth = "Bearer " + apiKey
	}
	return s
}

func (s *httpSystem) name() string                                { return s.label }
func (s *httpSystem) worker(context.Context, int) (worker, error) { return shared{s}, nil }
func (s *httpSystem) serverPID() int                              { return s.srv.pid() }
func (s *httpSystem) close()                                      { s.client.CloseIdleConnections() }

// grantBody is the part of the 201 body the load generator needs.
type grantBody struct {
	LockToken    string `json:"lock_token"`
	FencingToken int64  `json:"fencing_token"`
}

type problemBody struct {
	Type string `json:"type"`
}

func (s *httpSystem) acquire(ctx context.Context, name string, wait time.Duration) (releaseFunc, error) {
	body := fmt.Sprintf(`{"ttl_ms":%d,"wait_ms":%d}`, s.ttlMS, wait.Milliseconds())
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.srv.base+"/v1/locks/"+name, strings.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if s.auth != "" {
		req.Header.Set("Authorization", s.auth)
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return nil, err
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return nil, err
	}
	switch resp.StatusCode {
	case http.StatusCreated:
	case http.StatusConflict:
		var p problemBody
		_ = json.Unmarshal(b, &p)
		if strings.HasSuffix(p.Type, ":wait-timeout") {
			return nil, errWaitTimeout
		}
		return nil, errHeld
	default:
		return nil, fmt.Errorf("acquire: %s: %s", resp.Status, bytes.TrimSpace(b))
	}
	var g grantBody
	if err := json.Unmarshal(b, &g); err != nil || g.LockToken == "" || g.FencingToken < 1 {
		return nil, fmt.Errorf("acquire: bad 201 body %q (%v)", b, err)
	}
	return func(ctx context.Context) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodDelete, s.srv.base+"/v1/locks/"+name, nil)
		if err != nil {
			return err
		}
		req.Header.Set("Lock-Token", g.LockToken)
		if s.auth != "" {
			req.Header.Set("Authorization", s.auth)
		}
		resp, err := s.client.Do(req)
		if err != nil {
			return err
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusNoContent {
			return fmt.Errorf("release: %s: %s", resp.Status, bytes.TrimSpace(b))
		}
		return nil
	}, nil
}

// ---- Redfence's service in-process ----------------------------------------

// inprocSystem calls service.Locker directly: the same nodes, the same
// Postgres issuer, no HTTP.
type inprocSystem struct {
	locker *service.Locker
	closeF func()
	ttl    time.Duration
}

func (s *inprocSystem) name() string                                { return "redfence in-proc" }
func (s *inprocSystem) worker(context.Context, int) (worker, error) { return shared{s}, nil }
func (s *inprocSystem) serverPID() int                              { return 0 }
func (s *inprocSystem) close()                                      { s.closeF() }

func (s *inprocSystem) acquire(ctx context.Context, name string, wait time.Duration) (releaseFunc, error) {
	key := keyspace.Key("", name)
	g, err := s.locker.Acquire(ctx, key, service.Request{TTL: s.ttl, Wait: wait})
	switch {
	case errors.Is(err, service.ErrWaitTimeout):
		return nil, errWaitTimeout
	case errors.Is(err, service.ErrHeld):
		return nil, errHeld
	case err != nil:
		return nil, err
	}
	if g.Fencing < 1 {
		return nil, fmt.Errorf("grant without a fencing token")
	}
	return func(ctx context.Context) error { return s.locker.Release(ctx, key, g.Token) }, nil
}

// ---- redsync v4 -----------------------------------------------------------

// redsyncSystem is go-redsync/redsync v4 over go-redis v9 clients with
// their default options, one per node (the library's documented setup).
type redsyncSystem struct {
	rs      *redsync.Redsync
	clients []*redis.Client
	ttl     time.Duration
}

func newRedsyncSystem(addrs []string, ttl time.Duration) *redsyncSystem {
	s := &redsyncSystem{ttl: ttl}
	var pools []rsredis.Pool
	for _, a := range addrs {
		c := redis.NewClient(&redis.Options{Addr: a})
		s.clients = append(s.clients, c)
		pools = append(pools, goredis.NewPool(c))
	}
	s.rs = redsync.New(pools...)
	return s
}

func (s *redsyncSystem) name() string                                { return "redsync" }
func (s *redsyncSystem) worker(context.Context, int) (worker, error) { return shared{s}, nil }
func (s *redsyncSystem) serverPID() int                              { return 0 }
func (s *redsyncSystem) close() {
	for _, c := range s.clients {
		_ = c.Close()
	}
}

func (s *redsyncSystem) acquire(ctx context.Context, name string, wait time.Duration) (releaseFunc, error) {
	var err error
	var m *redsync.Mutex
	if wait == 0 {
		m = s.rs.NewMutex("rs:"+name, redsync.WithExpiry(s.ttl), redsync.WithTries(1))
		err = m.TryLockContext(ctx)
	} else {
		// Retry (at redsync's default 50-250 ms random delay) until wait.
		m = s.rs.NewMutex("rs:"+name, redsync.WithExpiry(s.ttl), redsync.WithTries(math.MaxInt32))
		wctx, cancel := context.WithTimeout(ctx, wait)
		err = m.LockContext(wctx)
		if err != nil && wctx.Err() != nil && ctx.Err() == nil {
			err = errWaitTimeout
		}
		cancel()
	}
	var taken *redsync.ErrTaken
	var nodeTaken *redsync.ErrNodeTaken
	switch {
	case err == nil:
	case errors.Is(err, errWaitTimeout):
		return nil, err
	case errors.Is(err, redsync.ErrFailed), errors.As(err, &taken), errors.As(err, &nodeTaken):
		return nil, errHeld
	default:
		return nil, err
	}
	return func(ctx context.Context) error {
		ok, err := m.UnlockContext(ctx)
		if err == nil && !ok {
			err = errors.New("redsync: unlock reached no quorum")
		}
		return err
	}, nil
}

// ---- etcd concurrency.Mutex -----------------------------------------------

// etcdSystem is etcd's concurrency.Mutex, one Session (lease) per worker as
// the package requires (a session is one holder), over one shared client.
type etcdSystem struct {
	srv    *etcd
	client *clientv3.Client
	ttl    time.Duration
}

func newEtcdSystem(srv *etcd, ttl time.Duration) (*etcdSystem, error) {
	c, err := clientv3.New(clientv3.Config{Endpoints: []string{srv.endpoint}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		return nil, fmt.Errorf("etcd client: %w", err)
	}
	return &etcdSystem{srv: srv, client: c, ttl: ttl}, nil
}

func (s *etcdSystem) name() string   { return "etcd" }
func (s *etcdSystem) serverPID() int { return s.srv.pid() }
func (s *etcdSystem) close()         { _ = s.client.Close() }

func (s *etcdSystem) worker(ctx context.Context, i int) (worker, error) {
	sess, err := concurrency.NewSession(s.client, concurrency.WithTTL(int(math.Ceil(s.ttl.Seconds()))), concurrency.WithContext(ctx))
	if err != nil {
		return nil, fmt.Errorf("etcd session: %w", err)
	}
	return &etcdWorker{sess: sess}, nil
}

type etcdWorker struct{ sess *concurrency.Session }

func (w *etcdWorker) close() { _ = w.sess.Close() }

func (w *etcdWorker) acquire(ctx context.Context, name string, wait time.Duration) (releaseFunc, error) {
	m := concurrency.NewMutex(w.sess, "/bench/"+name)
	var err error
	if wait == 0 {
		err = m.TryLock(ctx)
		if errors.Is(err, concurrency.ErrLocked) {
			return nil, errHeld
		}
	} else {
		wctx, cancel := context.WithTimeout(ctx, wait)
		err = m.Lock(wctx)
		if err != nil && wctx.Err() != nil && ctx.Err() == nil {
			err = errWaitTimeout
		}
		cancel()
	}
	if err != nil {
		return nil, err
	}
	return func(ctx context.Context) error { return m.Unlock(ctx) }, nil
}

// ---- one Redis node: the single-instance ceiling --------------------------

// singleSystem is the textbook single-instance lock: SET key value NX PX ttl,
// released by a compare-and-delete Lua script (EVALSHA).
type singleSystem struct {
	client *redis.Client
	ttl    time.Duration
}

var singleRelease = redis.NewScript(`if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0`)

func (s *singleSystem) name() string                                { return "1 redis node" }
func (s *singleSystem) worker(context.Context, int) (worker, error) { return shared{s}, nil }
func (s *singleSystem) serverPID() int                              { return 0 }
func (s *singleSystem) close()                                      { _ = s.client.Close() }

func (s *singleSystem) acquire(ctx context.Context, name string, wait time.Duration) (releaseFunc, error) {
	if wait != 0 {
		return nil, errors.New("single node: blocking acquire not measured")
	}
	var b [16]byte
	_, _ = rand.Read(b[:])
	val := base64.RawURLEncoding.EncodeToString(b[:])
	key := "single:" + name
	ok, err := s.client.SetArgs(ctx, key, val, redis.SetArgs{Mode: "NX", TTL: s.ttl}).Result()
	if errors.Is(err, redis.Nil) {
		return nil, errHeld
	}
	if err != nil {
		return nil, err
	}
	if ok != "OK" {
		return nil, errHeld
	}
	return func(ctx context.Context) error {
		n, err := singleRelease.Run(ctx, s.client, []string{key}, val).Int64()
		if err == nil && n != 1 {
			err = errors.New("single node: release found another value")
		}
		return err
	}, nil
}
