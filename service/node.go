package service

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/redfence/redfence/internal/keyspace"
)

// Node is one independent Redis master as the Locker uses it. Every method is
// bounded by ctx, which carries the per-node timeout.
type Node interface {
	// Addr identifies the node in errors and status.
	Addr() string
	// Acquire sets key to token with a TTL if key is absent. When another
	// value holds key it returns false and the holder's remaining TTL. If
	// epoch is not empty, it first checks, atomically with the set, that the
	// node still holds epoch as its marker, and returns ErrMemoryLost if not.
	Acquire(ctx context.Context, key, token string, ttl time.Duration, epoch string) (ok bool, remaining time.Duration, err error)
	// Mark sets the node's epoch marker if it has none, and reports whether it did.
	Mark(ctx context.Context, epoch string) (bool, error)
	// Extend sets key's TTL if key holds token, and reports whether it did.
	Extend(ctx context.Context, key, token string, ttl time.Duration) (bool, error)
	// Release deletes key if it holds token, and reports whether it did.
	Release(ctx context.Context, key, token string) (bool, error)
	// TTL returns key's remaining TTL, or 0 if key does not exist.
	TTL(ctx context.Context, key string) (time.Duration, error)
	// Ping checks that the node answers.
	Ping(ctx context.Context) error
}

// Lua scripts. Each runs atomically on one node.
var (
	// acquireScript: SET NX PX; on refusal return the holder's PTTL (>= 1).
	// With an epoch (ARGV[3]), first check the node's marker (KEYS[2]): -1
	// means the node lost its memory.
	acquireScript = redis.NewScript(`
if ARGV[3] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[3] then return -1 end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
local t = redis.call('PTTL', KEYS[1])
if t < 1 then return 1 end
return t`)
	// extendScript: compare-and-pexpire; never creates the key.
	extendScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0`)
	// markScript: set the epoch marker if there is none.
	markScript = redis.NewScript(`
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('SET', KEYS[1], ARGV[1]) return 1 end
return 0`)
	// releaseScript: compare-and-delete.
	releaseScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0`)
)

// RedisNode is a Node backed by one Redis server through go-redis.
type RedisNode struct {
	addr   string
	client *redis.Client
}

var _ Node = (*RedisNode)(nil)

// RedisOptions configures NewRedisNode. The zero value is usable.
type RedisOptions struct {
	// Username and Password authenticate to the node (ACL user or requirepass).
	Username, Password string
	// PoolSize is the connection pool size. The default is 10 per CPU.
	PoolSize int
	// TLSConfig, if set, connects over TLS.
	TLSConfig *tls.Config
	// DialTimeout bounds connecting. The default is 1s; each call's own
	// context deadline still applies.
	DialTimeout time.Duration
}

// NewRedisNode returns a node for the Redis server at addr ("host:port"). It
// does not connect until first use. Context deadlines reach the socket
// (ContextTimeoutEnabled) and commands are never retried, so a per-node timeout
// is a real bound.
func NewRedisNode(addr string, opts RedisOptions) *RedisNode {
	if opts.DialTimeout <= 0 {
		opts.DialTimeout = time.Second
	}
	return &RedisNode{
		addr: addr,
		client: redis.NewClient(&redis.Options{
			Addr:                  addr,
			Username:              opts.Username,
			Password:              opts.Password,
			PoolSize:              opts.PoolSize,
			DialTimeout:           opts.DialTimeout,
			TLSConfig:             opts.TLSConfig,
			ContextTimeoutEnabled: true,
			MaxRetries:            -1,
			DialerRetries:         1,
			DisableIdentity:       true,
		}),
	}
}

// Addr returns the node's address.
func (n *RedisNode) Addr() string { return n.addr }

// Close closes the node's connections.
func (n *RedisNode) Close() error { return n.client.Close() }

// Acquire implements Node.
func (n *RedisNode) Acquire(ctx context.Context, key, token string, ttl time.Duration, epoch string) (bool, time.Duration, error) {
	v, err := acquireScript.Run(ctx, n.client, []string{key, keyspace.NodeEpochKey}, token, ttl.Milliseconds(), epoch).Int64()
	if err != nil {
		return false, 0, fmt.Errorf("acquire: %w", err)
	}
	if v < 0 {
		return false, 0, ErrMemoryLost
	}
	if v == 0 {
		return true, 0, nil
	}
	return false, time.Duration(v) * time.Millisecond, nil
}

// Mark implements Node.
func (n *RedisNode) Mark(ctx context.Context, epoch string) (bool, error) {
	v, err := markScript.Run(ctx, n.client, []string{keyspace.NodeEpochKey}, epoch).Int64()
	if err != nil {
		return false, fmt.Errorf("mark: %w", err)
	}
	return v == 1, nil
}

// Extend implements Node.
func (n *RedisNode) Extend(ctx context.Context, key, token string, ttl time.Duration) (bool, error) {
	v, err := extendScript.Run(ctx, n.client, []string{key}, token, ttl.Milliseconds()).Int64()
	if err != nil {
		return false, fmt.Errorf("extend: %w", err)
	}
	return v == 1, nil
}

// Release implements Node.
func (n *RedisNode) Release(ctx context.Context, key, token string) (bool, error) {
	v, err := releaseScript.Run(ctx, n.client, []string{key}, token).Int64()
	if err != nil {
		return false, fmt.Errorf("release: %w", err)
	}
	return v == 1, nil
}

// TTL implements Node.
func (n *RedisNode) TTL(ctx context.Context, key string) (time.Duration, error) {
	d, err := n.client.PTTL(ctx, key).Result()
	if err != nil {
		return 0, fmt.Errorf("pttl: %w", err)
	}
	if d < 0 { // -2: no key; -1: no expiry (never set by Redfence)
		if d == -1 {
			return 0, errors.New("pttl: key has no expiry")
		}
		return 0, nil
	}
	return d, nil
}

// Ping implements Node.
func (n *RedisNode) Ping(ctx context.Context) error {
	if err := n.client.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("ping: %w", err)
	}
	return nil
}
