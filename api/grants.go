package api

import (
	"sync"
	"time"

	"github.com/redfence/redfence/fencing"
)

// grantCache remembers the grants this Handler made (and extended) that are
// still live, by lock token, so that the audit line of their release names
// the owner and the fencing token without asking Postgres (see grantOf, the
// fallback for grants made elsewhere or before a restart).
//
// It is bounded by the live grants: an entry goes when its lock is
// released, and once its lease expired it is never used again and is
// dropped by the next prune of its shard. A shard prunes when an insert
// finds it at its limit, which is then set to twice what is left (at least
// minGrantLimit): pruning costs O(1) per insert amortised, and a shard holds
// at most about twice its live grants, plus minGrantLimit. A prune that
// leaves a quarter or less of the limit moves the rest to a new, smaller
// map, since Go maps do not shrink.
type grantCache struct {
	shards [grantShards]grantShard
}

const (
	grantShards   = 16
	minGrantLimit = 64
)

type grantShard struct {
	mu    sync.Mutex
	m     map[string]grantEntry // by lock token
	limit int
	_     [40]byte // keep shards' locks on separate cache lines
}

// grantEntry is what the audit log says of a grant: never the lock token.
type grantEntry struct {
	key     string // storage key: a token sent for another lock is a miss
	owner   string
	fencing fencing.Token
	expires time.Time
}

func newGrantCache() *grantCache {
	c := &grantCache{}
	for i := range c.shards {
		c.shards[i].m = make(map[string]grantEntry)
		c.shards[i].limit = minGrantLimit
	}
	return c
}

func (c *grantCache) shard(token string) *grantShard {
	var h byte
	if len(token) > 0 {
		h = token[0] ^ token[len(token)/2]
	}
	return &c.shards[h%grantShards]
}

// put remembers the grant of token, replacing what was known of it (an
// extension moves the expiry).
func (c *grantCache) put(token string, e grantEntry, now time.Time) {
	s := c.shard(token)
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.m[token]; !ok && len(s.m) >= s.limit {
		s.prune(now)
	}
	s.m[token] = e
}

// prune drops expired entries; s.mu is held.
func (s *grantShard) prune(now time.Time) {
	for t, e := range s.m {
		if !now.Before(e.expires) {
			delete(s.m, t)
		}
	}
	if len(s.m)*4 <= s.limit && s.limit > minGrantLimit {
		m := make(map[string]grantEntry, len(s.m))
		for t, e := range s.m {
			m[t] = e
		}
		s.m = m
	}
	s.limit = max(minGrantLimit, 2*len(s.m))
}

// get returns the live grant of token on key.
func (c *grantCache) get(key, token string, now time.Time) (grantEntry, bool) {
	s := c.shard(token)
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.m[token]
	if !ok || e.key != key {
		return grantEntry{}, false
	}
	if !now.Before(e.expires) {
		delete(s.m, token)
		return grantEntry{}, false
	}
	return e, true
}

// drop forgets token's grant (released).
func (c *grantCache) drop(token string) {
	s := c.shard(token)
	s.mu.Lock()
	delete(s.m, token)
	s.mu.Unlock()
}

// len returns the number of entries, expired ones included (for tests).
func (c *grantCache) len() int {
	n := 0
	for i := range c.shards {
		s := &c.shards[i]
		s.mu.Lock()
		n += len(s.m)
		s.mu.Unlock()
	}
	return n
}
