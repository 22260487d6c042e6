package service

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
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
	// Mark sets the node's epoch marker if it has none (with replace: in
	// any case), and reports whether it did.
	Mark(ctx context.Context, epoch string, replace bool) (bool, error)
	// Extend renews key to at least ttl from now (never shorter than it
	// is) if key holds token. It returns the lease the key has from now on
	// (at least ttl) and the one it had before, or 0 and 0 if key does not
	// hold token. If epoch is not empty, it first checks, atomically with
	// the renewal, that the node still holds epoch as its marker, and
	// returns ErrMemoryLost if not.
	Extend(ctx context.Context, key, token string, ttl time.Duration, epoch string) (lease, prev time.Duration, err error)
	// Restore shortens key's lease to at most lease from now if key holds
	// token (it undoes a renewal that failed elsewhere), and reports
	// whether key held token.
	Restore(ctx context.Context, key, token string, lease time.Duration) (bool, error)
	// Release deletes key if it holds token, and reports whether it did.
	Release(ctx context.Context, key, token string) (bool, error)
	// TTL returns key's remaining TTL, or 0 if key does not exist.
	TTL(ctx context.Context, key string) (time.Duration, error)
	// Ping checks that the node answers.
	Ping(ctx context.Context) error
}

// luaScript is a Lua script sent by its SHA-1 (EVALSHA), and by its source
// when the node does not know it yet.
type luaScript struct {
	src string
	sha any // the SHA-1 as a string, boxed once
	// batch, when set, runs the script once for each of many calls in one
	// EVALSHA (see batchSource): the pipeline merges the calls of one
	// batch that run the script into one command.
	batch *luaScript
}

func newLuaScript(src string) *luaScript {
	batch := batchSource(src)
	return &luaScript{src: src, sha: redis.NewScript(src).Hash(),
		batch: &luaScript{src: batch, sha: redis.NewScript(batch).Hash()}}
}

// batchSource is the Lua source of a script that runs the script src for
// each of n calls, in order, and returns their answers as an array. ARGV[1]
// is n, ARGV[2] and ARGV[3] the number of keys and of arguments of each
// call; call i's keys and arguments follow, in KEYS and in ARGV after those
// three. Each call runs in a protected call: one call's error is its own
// answer (an error reply in the array) and does not stop the others.
//
// One EVALSHA of many calls costs a node far less than as many EVALSHAs:
// each command costs its parsing, its dispatch and its reply, and each
// script call also sets up the script's KEYS and ARGV.
func batchSource(src string) string {
	return `local n, nk, na = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local function call(KEYS, ARGV)
` + src + `
end
local out = {}
for i = 0, n - 1 do
  local k, a = {}, {}
  for j = 1, nk do k[j] = KEYS[i * nk + j] end
  for j = 1, na do a[j] = ARGV[3 + i * na + j] end
  local ok, r = pcall(call, k, a)
  if not ok then
    r = redis.error_reply(type(r) == 'table' and r.err or tostring(r))
  elseif type(r) ~= 'number' then
    r = redis.error_reply('ERR redfence batch: the script answered a ' .. type(r) .. ', not a number')
  end
  out[i + 1] = r
end
return out`
}

// Lua scripts. Each runs atomically on one node.
var (
	// acquireScript: SET NX PX; on refusal return the holder's PTTL (>= 1).
	// With an epoch (ARGV[3]), first check the node's marker (KEYS[2]): -1
	// means the node lost its memory.
	acquireScript = newLuaScript(`
if ARGV[3] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[3] then return -1 end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
local t = redis.call('PTTL', KEYS[1])
if t < 1 then return 1 end
return t`)
	// extendScript: compare-and-pexpire; never creates the key and never
	// shortens its lease (a renewal that failed elsewhere must not cut short
	// the deadline its client still relies on). With an epoch (ARGV[3]),
	// first check the node's marker (KEYS[2]): -1 means the node lost its
	// memory. It returns the lease in milliseconds from now (at least
	// ARGV[2]) and the one before in units of 4 ms rounded up, as
	// lease * 2^25 + before (exact in a Lua number, a double: leases are at
	// most a day, under 2^27 ms), or 0 if the key does not hold the token.
	// A longer lease (a key left by a server with a longer MaxTTL) is
	// reported as 2^27-4 ms, less than it has, and so is the one before:
	// the renewal did not lengthen it, so it is never restored.
	extendScript = newLuaScript(`
if ARGV[3] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[3] then return -1 end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local ttl = tonumber(ARGV[2])
local t = redis.call('PTTL', KEYS[1])
if t < 0 then t = 0 end
local lease = t
if t < ttl then redis.call('PEXPIRE', KEYS[1], ttl) lease = ttl end
if lease > 134217724 then lease = 134217724 end
local before = math.ceil(t / 4)
if before > 33554431 then before = 33554431 end
return lease * 33554432 + before`)
	// restoreScript: compare-and-shorten: if the key holds the token and
	// its lease is longer than ARGV[2] ms, set it to ARGV[2] (a positive
	// number); 1 if the key held the token.
	restoreScript = newLuaScript(`
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if redis.call('PTTL', KEYS[1]) > tonumber(ARGV[2]) then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1`)
	// adoptScript: carry a node's marker over from the legacy key (KEYS[1])
	// to its per-address key (KEYS[2]) if it has none there and the legacy
	// one holds the epoch ARGV[1]: 1 if it did.
	adoptScript = newLuaScript(`
if redis.call('EXISTS', KEYS[2]) == 0 and redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('SET', KEYS[2], ARGV[1]) return 1 end
return 0`)
	// markScript: set the epoch marker if there is none, or in any case
	// when ARGV[2] is '1'.
	markScript = newLuaScript(`
if ARGV[2] == '1' or redis.call('EXISTS', KEYS[1]) == 0 then redis.call('SET', KEYS[1], ARGV[1]) return 1 end
return 0`)
	// releaseScript: compare-and-delete. A release is announced on the
	// lock's channel (ARGV[2]; '' announces nothing: a failed try's
	// clean-up, see withdrawArgs) with the SHA-1 of the token (not the
	// token, which is a secret), so servers with waiters for it wake them.
	// The announcement is best effort (pcall): a script is not rolled back,
	// so a refused PUBLISH (an ACL without the channel) must not turn the
	// delete that happened into an error.
	releaseScript = newLuaScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if ARGV[2] ~= '' then redis.pcall('PUBLISH', ARGV[2], redis.sha1hex(ARGV[1])) end
  return 1
end
return 0`)
)

// RedisNode is a Node backed by one Redis server through go-redis.
type RedisNode struct {
	addr string
	// epochKey is the key of the node's epoch marker (keyspace.NodeEpochKey),
	// boxed once for the commands that name it.
	epochKey any
	client   *redis.Client
	// conn and mconn set up connections of the client's pool of pipelines
	// (the node's pipeline, its INFO reads) and of its pool of single
	// commands (PING, GET of the marker).
	conn, mconn *connector
	pipe        *pipeliner
	watch       *watcher
	// onConnect, if set (WatchRestarts), learns the run_id of the server
	// behind every new connection before the connection is used.
	onConnect atomic.Pointer[func(ctx context.Context, runID string, durable bool) error]
	// watchMu guards watcher, the owner of onConnect (see WatchRestarts).
	watchMu sync.Mutex
	watcher any
}

var (
	_ Node             = (*RedisNode)(nil)
	_ serverIdentifier = (*RedisNode)(nil)
	_ restartWatcher   = (*RedisNode)(nil)
	_ writeProber      = (*RedisNode)(nil)
)

// RedisACL is the least a Redis ACL user needs for Redfence, in ACL
// SETUSER syntax (add "on" and a password): its keys and Pub/Sub channels,
// the commands of the connection, the lock scripts and the commands they
// call, the epoch marker, and INFO and CONFIG GET, which find restarts,
// durability and an evicting maxmemory-policy.
const RedisACL = "resetkeys ~redfence:* resetchannels &redfence:released:* -@all " +
	"+hello +auth +ping +subscribe +unsubscribe " +
	"+evalsha +eval +get +set +del +exists +incr +pexpire +pttl +publish " +
	"+info +config|get"

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
	// Unpipelined sends every command on its own round trip from a pool of
	// connections instead. It exists to measure what the pipeline buys.
	Unpipelined bool
}

// NewRedisNode returns a node for the Redis server at addr ("host:port"). It
// does not connect until first use. Context deadlines reach the socket
// (ContextTimeoutEnabled) and commands are never retried, so a per-node timeout
// is a real bound.
func NewRedisNode(addr string, opts RedisOptions) *RedisNode {
	if opts.DialTimeout <= 0 {
		opts.DialTimeout = time.Second
	}
	n := &RedisNode{addr: addr, epochKey: keyspace.NodeEpochKey(addr)}
	client := redis.NewClient(&redis.Options{
		Addr:                  addr,
		Dialer:                dialer(opts),
		Username:              opts.Username,
		Password:              opts.Password,
		PoolSize:              opts.PoolSize,
		DialTimeout:           opts.DialTimeout,
		TLSConfig:             opts.TLSConfig,
		ContextTimeoutEnabled: true,
		MaxRetries:            -1,
		DialerRetries:         1,
		DisableIdentity:       true,
		OnConnect:             n.connected,
	})
	n.client, n.watch = client, newWatcher(client, opts.DialTimeout)
	n.conn, n.mconn = newConnector(pingPipelined(client), opts.DialTimeout), newConnector(pingMain(client), opts.DialTimeout)
	if !opts.Unpipelined {
		n.pipe = newPipeliner(client, n.conn)
	}
	return n
}

// dialer connects as go-redis' default dialer does (same keep-alive and TLS),
// on sockets with SO_LINGER 0: closing one resets it and discards what it had
// not delivered. go-redis closes a connection whose command timed out; on a
// lossy or partitioned link the kernel would otherwise go on retransmitting
// that command (the SET of a try that has failed since) for minutes, and it
// could land long after the try's clean-up (see sweeper).
func dialer(opts RedisOptions) func(ctx context.Context, network, addr string) (net.Conn, error) {
	d := &net.Dialer{
		Timeout:         opts.DialTimeout,
		KeepAliveConfig: net.KeepAliveConfig{Enable: true, Idle: 30 * time.Second, Interval: 5 * time.Second, Count: 3},
		Control: func(_, _ string, c syscall.RawConn) error {
			var serr error
			if err := c.Control(func(fd uintptr) { serr = lingerZero(fd) }); err != nil {
				return err
			}
			return serr
		},
	}
	if opts.TLSConfig == nil {
		return d.DialContext
	}
	// The handshake, too, is bounded by ctx (the per-node timeout).
	td := &tls.Dialer{NetDialer: d, Config: opts.TLSConfig}
	return td.DialContext
}

// Addr returns the node's address.
func (n *RedisNode) Addr() string { return n.addr }

// WatchRestarts has f called with the run_id of the server behind every new
// connection, before the connection carries anything else: a Redis server
// that restarted has dropped every connection, so f learns of the restart
// before any command reaches the new process. durable reports that the
// server fsyncs every write before answering (see fsyncsAll); false when
// CONFIG is refused. An error from f fails the connection. If the run_id cannot be
// read (INFO refused), f is not called. A node reports to one watcher, owner
// (its Locker): a call by another owner fails with ErrNodeShared; the same
// owner's replaces its f.
func (n *RedisNode) WatchRestarts(owner any, f func(ctx context.Context, runID string, durable bool) error) error {
	n.watchMu.Lock()
	defer n.watchMu.Unlock()
	if n.watcher != nil && n.watcher != owner {
		return ErrNodeShared
	}
	n.watcher = owner
	n.onConnect.Store(&f)
	return nil
}

// connected is the client's OnConnect hook (see WatchRestarts).
func (n *RedisNode) connected(ctx context.Context, cn *redis.Conn) error {
	f := n.onConnect.Load()
	if f == nil {
		return nil
	}
	// A connection whose server process is unknown is not used (the
	// command that opened it fails): it could carry votes of a server
	// restarted from a snapshot.
	info, err := cn.Info(ctx, "server").Result()
	if err != nil {
		return fmt.Errorf("%w: info server: %w", errConnectHook, refusal(err))
	}
	id := runID(info)
	if id == "" {
		return fmt.Errorf("%w: info server: no run_id", errConnectHook)
	}
	durable, err := fsyncsAll(ctx, cn)
	if err != nil {
		// Not an answer: a node that cannot say now is not recorded as
		// having stopped fsyncing (see seen).
		return fmt.Errorf("%w: %w", errConnectHook, err)
	}
	return (*f)(ctx, id, durable)
}

// fsyncsAll reports whether the server behind c fsyncs every write before
// answering (appendonly yes, appendfsync always, and no-appendfsync-on-rewrite
// no: with it on, writes are not fsynced while a save or rewrite runs);
// false if CONFIG is refused. Other errors (a timeout) are returned.
func fsyncsAll(ctx context.Context, c redis.Cmdable) (bool, error) {
	cfg, err := c.ConfigGet(ctx, "*append*").Result()
	if err != nil {
		if err = refusal(err); errors.Is(err, ErrCommandRefused) {
			return false, nil
		}
		return false, fmt.Errorf("config get *append*: %w", err)
	}
	return fsyncConfig(cfg, nil), nil
}

// fsyncConfig is fsyncsAll on the answer to CONFIG GET *append*.
func fsyncConfig(cfg map[string]string, err error) bool {
	return err == nil && cfg["appendonly"] == "yes" && cfg["appendfsync"] == "always" && cfg["no-appendfsync-on-rewrite"] == "no"
}

// refusal returns err, matching ErrCommandRefused too if it is the node's
// error reply (not a network error or a timeout), or ErrAuth instead if
// that reply refused the credentials (then no command ran at all).
func refusal(err error) error {
	if rerr, ok := errors.AsType[redis.Error](err); ok && !errors.Is(err, redis.Nil) {
		if redis.IsAuthError(rerr) {
			return fmt.Errorf("%w: %w", ErrAuth, rerr)
		}
		return fmt.Errorf("%w: %w", ErrCommandRefused, rerr)
	}
	return err
}

// runID returns the run_id of an INFO server answer, or "".
func runID(info string) string {
	for line := range strings.Lines(info) {
		if id, ok := strings.CutPrefix(strings.TrimSpace(line), "run_id:"); ok {
			return id
		}
	}
	return ""
}

// Close stops the node's writers and closes its connections.
func (n *RedisNode) Close() error {
	if n.pipe != nil {
		n.pipe.close()
	}
	n.watch.close()
	return n.client.Close()
}

// do runs cmd through the node's pipeline, or on its own round trip when
// the node is unpipelined. It returns the command that answered.
func (n *RedisNode) do(ctx context.Context, cmd *redis.Cmd, s *luaScript) (*redis.Cmd, error) {
	if n.pipe != nil {
		return n.pipe.do(ctx, cmd, s)
	}
	if err := n.mconn.ready(ctx); err != nil {
		cmd.SetErr(err)
		return cmd, err
	}
	_ = n.client.Process(ctx, cmd)
	if noScript(cmd, s) {
		cmd = evalOf(ctx, cmd, s)
		_ = n.client.Process(ctx, cmd)
	}
	n.mconn.failed(cmd.Err())
	return cmd, cmd.Err()
}

// noScript reports whether cmd, an EVALSHA of the script s (nil: cmd is
// not one), failed because the node does not know the script (it
// restarted, or its script cache was flushed).
func noScript(cmd *redis.Cmd, s *luaScript) bool {
	err := cmd.Err()
	return err != nil && s != nil && redis.HasErrorPrefix(err, "NOSCRIPT")
}

// evalOf returns cmd, an EVALSHA of s, as the EVAL of its source with the
// same keys and arguments: it runs the script and loads it for later
// EVALSHAs.
func evalOf(ctx context.Context, cmd *redis.Cmd, s *luaScript) *redis.Cmd {
	args := slices.Clone(cmd.Args())
	args[0], args[1] = "eval", s.src
	return redis.NewCmd(ctx, args...)
}

// eval runs script with a's keys and arguments (and last, when not nil,
// after them) through the node's pipeline and returns its integer answer.
func (n *RedisNode) eval(ctx context.Context, s *luaScript, a *scriptArgs, last any) (int64, error) {
	cmd, err := n.do(ctx, evalCmd(ctx, s, a, n.epochKey, last), s)
	if err != nil {
		return 0, err
	}
	return cmd.Int64()
}

// evalCmd is the EVALSHA of script s with a's keys (then marker, the node's
// epoch marker key, if a.marker) and arguments, and last after them when it
// is not nil.
func evalCmd(ctx context.Context, s *luaScript, a *scriptArgs, marker, last any) *redis.Cmd {
	cmdArgs := make([]any, 0, 5+len(a.keys)+len(a.argv))
	nkeys := len(a.keys)
	if a.marker {
		nkeys++
	}
	cmdArgs = append(cmdArgs, "evalsha", s.sha, nkeys)
	cmdArgs = append(cmdArgs, a.keys...)
	if a.marker {
		cmdArgs = append(cmdArgs, marker)
	}
	cmdArgs = append(cmdArgs, a.argv...)
	if last != nil {
		cmdArgs = append(cmdArgs, last)
	}
	return redis.NewCmd(ctx, cmdArgs...)
}

// asyncNode is a Node that can answer through a callback, sparing the
// Locker a goroutine per node and request: the node's pipeline writer
// delivers the answer. done is called exactly once, possibly on the
// caller's goroutine, and must not block.
type asyncNode interface {
	Node
	// async reports whether the node answers asynchronously (a pipelined
	// RedisNode does; otherwise the Locker uses a goroutine).
	async() bool
	// acquireAsync is Acquire with the round's shared arguments (see
	// acquireArgs) and the node's epoch.
	acquireAsync(ctx context.Context, args *scriptArgs, epoch string, done func(ok bool, remaining time.Duration, err error))
	// releaseAsync is Release with the round's shared arguments (see
	// releaseArgs).
	releaseAsync(ctx context.Context, args *scriptArgs, done func(ok bool, err error))
}

var _ asyncNode = (*RedisNode)(nil)

// scriptArgs are the keys and arguments of one round's script, boxed once
// and shared by its command to every node (commands only read them).
type scriptArgs struct {
	keys, argv []any
	// marker appends the node's epoch marker key to keys (it differs by
	// node).
	marker bool
}

// acquireArgs are the arguments of the acquire script, but the epoch.
func acquireArgs(key, token string, ttl time.Duration) *scriptArgs {
	return &scriptArgs{keys: []any{key}, marker: true, argv: []any{token, ttl.Milliseconds()}}
}

// releaseArgs are the arguments of the release script.
func releaseArgs(key, token string) *scriptArgs {
	return &scriptArgs{keys: []any{key}, argv: []any{token, releasedChannel(key)}}
}

// withdrawArgs are the arguments of the release script deleting what a
// failed try set, unannounced: the lock was never granted, and waiters
// woken by it (the try's own among them) would try again at once, not
// after their random delay, for as long as tries keep failing.
func withdrawArgs(key, token string) *scriptArgs {
	return &scriptArgs{keys: []any{key}, argv: []any{token, ""}}
}

func (n *RedisNode) async() bool { return n.pipe != nil }

// evalAsync runs script with a's keys and arguments (and last, when not
// nil, after them) through the node's pipeline and calls done with its
// integer answer. The node must be pipelined.
func (n *RedisNode) evalAsync(ctx context.Context, s *luaScript, a *scriptArgs, last any, done func(int64, error)) {
	n.pipe.doAsync(ctx, evalCmd(ctx, s, a, n.epochKey, last), s, func(cmd *redis.Cmd, err error) {
		if err != nil {
			done(0, err)
			return
		}
		done(cmd.Int64())
	})
}

func (n *RedisNode) acquireAsync(ctx context.Context, a *scriptArgs, epoch string, done func(bool, time.Duration, error)) {
	n.evalAsync(ctx, acquireScript, a, epoch, func(v int64, err error) {
		done(acquireResult(v, err))
	})
}

func (n *RedisNode) releaseAsync(ctx context.Context, a *scriptArgs, done func(bool, error)) {
	n.evalAsync(ctx, releaseScript, a, nil, func(v int64, err error) {
		done(releaseResult(v, err))
	})
}

// acquireResult interprets the acquire script's answer.
func acquireResult(v int64, err error) (bool, time.Duration, error) {
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

// releaseResult interprets the release script's answer.
func releaseResult(v int64, err error) (bool, error) {
	if err != nil {
		return false, fmt.Errorf("release: %w", err)
	}
	return v == 1, nil
}

// Acquire implements Node.
func (n *RedisNode) Acquire(ctx context.Context, key, token string, ttl time.Duration, epoch string) (bool, time.Duration, error) {
	return acquireResult(n.eval(ctx, acquireScript, acquireArgs(key, token, ttl), epoch))
}

// Mark implements Node.
func (n *RedisNode) Mark(ctx context.Context, epoch string, replace bool) (bool, error) {
	flag := "0"
	if replace {
		flag = "1"
	}
	v, err := n.eval(ctx, markScript, &scriptArgs{marker: true, argv: []any{epoch, flag}}, nil)
	if err != nil {
		return false, fmt.Errorf("mark: %w", err)
	}
	return v == 1, nil
}

// Extend implements Node.
func (n *RedisNode) Extend(ctx context.Context, key, token string, ttl time.Duration, epoch string) (lease, prev time.Duration, err error) {
	v, err := n.eval(ctx, extendScript, &scriptArgs{keys: []any{key}, marker: true, argv: []any{token, ttl.Milliseconds()}}, epoch)
	return extendResult(v, err)
}

// extendPack is the factor that packs the extend script's two leases into
// one integer (see extendScript).
const extendPack = 1 << 25

// extendResult interprets the extend script's answer.
func extendResult(v int64, err error) (lease, prev time.Duration, _ error) {
	if err != nil {
		return 0, 0, fmt.Errorf("extend: %w", err)
	}
	if v < 0 {
		return 0, 0, ErrMemoryLost
	}
	return time.Duration(v/extendPack) * time.Millisecond, time.Duration(v%extendPack) * 4 * time.Millisecond, nil
}

// Restore implements Node.
func (n *RedisNode) Restore(ctx context.Context, key, token string, lease time.Duration) (bool, error) {
	v, err := n.eval(ctx, restoreScript, &scriptArgs{keys: []any{key}, argv: []any{token, max(lease.Milliseconds(), 1)}}, nil)
	if err != nil {
		return false, fmt.Errorf("restore: %w", err)
	}
	return v == 1, nil
}

// Release implements Node.
func (n *RedisNode) Release(ctx context.Context, key, token string) (bool, error) {
	return releaseResult(n.eval(ctx, releaseScript, releaseArgs(key, token), nil))
}

// Withdraw is Release without the announcement of the release, for what a
// failed try set (see withdrawArgs).
func (n *RedisNode) Withdraw(ctx context.Context, key, token string) (bool, error) {
	return releaseResult(n.eval(ctx, releaseScript, withdrawArgs(key, token), nil))
}

// TTL implements Node.
func (n *RedisNode) TTL(ctx context.Context, key string) (time.Duration, error) {
	cmd, err := n.do(ctx, redis.NewCmd(ctx, "pttl", key), nil)
	var d int64
	if err == nil {
		d, err = cmd.Int64()
	}
	if err != nil {
		return 0, fmt.Errorf("pttl: %w", err)
	}
	if d < 0 { // -2: no key; -1: no expiry (never set by Redfence)
		if d == -1 {
			return 0, errors.New("pttl: key has no expiry")
		}
		return 0, nil
	}
	return time.Duration(d) * time.Millisecond, nil
}

// AdoptLegacyMarker carries the node's marker over from the key used before
// markers were kept per address, if it holds epoch there and has no marker
// of its own yet; it reports whether it did (see legacyAdopter).
func (n *RedisNode) AdoptLegacyMarker(ctx context.Context, epoch string) (bool, error) {
	v, err := n.eval(ctx, adoptScript, &scriptArgs{keys: []any{keyspace.LegacyNodeEpochKey}, marker: true, argv: []any{epoch}}, nil)
	if err != nil {
		return false, fmt.Errorf("adopt marker: %w", err)
	}
	return v == 1, nil
}

// ProbeWrites checks that the node takes an acquire's write, as it does
// for a lock (see writeProber): it runs the acquire script through the
// node's pipeline, checking its marker against epoch (if not ""), on a key
// of its own (keyspace.ProbePrefix) with a 1 ms lease. A node that answers
// reads but refuses writes fails it: its memory full under noeviction, its
// persistence failing under stop-writes-on-bgsave-error, a read-only
// replica, an ACL without the scripts or the keys, CLIENT PAUSE WRITE (no
// answer).
func (n *RedisNode) ProbeWrites(ctx context.Context, epoch string) error {
	var b [8]byte
	_, _ = rand.Read(b[:]) // never fails
	key := keyspace.ProbePrefix + hex.EncodeToString(b[:])
	_, _, err := n.Acquire(ctx, key, "probe", time.Millisecond, epoch)
	var re redis.Error
	switch {
	case err == nil:
		return nil
	case errors.As(err, &re):
		return fmt.Errorf("refuses lock writes: %w", re)
	}
	return fmt.Errorf("probe write: %w", err)
}

// Epoch returns the node's epoch marker, or "" if it has none (see
// epochReader).
func (n *RedisNode) Epoch(ctx context.Context) (string, error) {
	if err := n.mconn.ready(ctx); err != nil {
		return "", fmt.Errorf("epoch: %w", err)
	}
	v, err := n.client.Get(ctx, keyspace.NodeEpochKey(n.addr)).Result()
	n.mconn.failed(err)
	if errors.Is(err, redis.Nil) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("epoch: %w", err)
	}
	return v, nil
}

// ServerID returns the run_id of the Redis server behind the node (INFO
// server), which names one run of one server process, and whether that
// process fsyncs every write before answering (appendonly yes, appendfsync
// always; false if CONFIG is refused).
func (n *RedisNode) ServerID(ctx context.Context) (id string, durable bool, err error) {
	// One pipeline, one connection: both answers come from the same
	// process, even if the node restarts meanwhile.
	if err := n.conn.ready(ctx); err != nil {
		return "", false, fmt.Errorf("info server: %w", refusal(err))
	}
	var info *redis.StringCmd
	var cfg *redis.MapStringStringCmd
	_, perr := n.client.Pipelined(ctx, func(p redis.Pipeliner) error {
		info, cfg = p.Info(ctx, "server"), p.ConfigGet(ctx, "*append*")
		return nil
	})
	n.conn.failed(errors.Join(info.Err(), perr))
	// A connection that could not be opened (refused credentials, say)
	// fails the pipeline, not its commands. (CONFIG's own refusal fails
	// it too, with INFO answered.)
	err = info.Err()
	if err == nil && info.Val() == "" && perr != nil {
		err = perr
	}
	if err != nil {
		return "", false, fmt.Errorf("info server: %w", refusal(err))
	}
	if id = runID(info.Val()); id == "" {
		return "", false, errors.New("info server: no run_id")
	}
	return id, fsyncConfig(cfg.Result()), nil
}

// Ping implements Node.
func (n *RedisNode) Ping(ctx context.Context) error {
	if err := n.mconn.ready(ctx); err != nil {
		return fmt.Errorf("ping: %w", err)
	}
	err := n.client.Ping(ctx).Err()
	n.mconn.failed(err)
	if err != nil {
		return fmt.Errorf("ping: %w", err)
	}
	return nil
}
