// Package keyspace derives every storage key Redfence uses from one function of
// (namespace, name), so that a tenant is a namespace and nothing else in the
// protocol changes.
//
// Guarantee: for valid names and namespaces, distinct (namespace, name) pairs map
// to distinct keys. Names are validated by ValidName; namespaces by
// ValidNamespace. Neither may contain '/', which separates them.
package keyspace

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

// MaxNameLen is the longest lock or resource name accepted.
const MaxNameLen = 200

// NodeEpochPrefix prefixes the key of a Redis node's epoch marker (see
// NodeEpochKey).
const NodeEpochPrefix = "redfence:node-epoch:"

// NodeEpochKey is the key of the epoch marker of the Redis node configured
// as addr: a node that lost it restarted without its data. There is one per
// address a node is configured under, so servers that spell one node's
// address differently keep apart markers, as they keep apart registry
// entries, instead of overwriting each other's.
func NodeEpochKey(addr string) string { return NodeEpochPrefix + addr }

// LegacyNodeEpochKey is the key of a node's epoch marker before markers were
// kept per address (one key for all). A node that holds the epoch on record
// there kept its memory; its marker is carried over (see service.Locker.Init).
const LegacyNodeEpochKey = "redfence:node-epoch"

// RedisPrefix prefixes every lock key on the Redis nodes.
const RedisPrefix = "redfence:lock:"

// Key returns the storage key of name in namespace ns: the name itself for the
// default (empty) namespace, otherwise "ns/name". Postgres rows are keyed by it.
func Key(ns, name string) string {
	if ns == "" {
		return name
	}
	return ns + "/" + name
}

// RedisKey returns the Redis key of the lock on key (as returned by Key).
func RedisKey(key string) string { return RedisPrefix + key }

// ProbePrefix prefixes the keys a write probe of a node sets for 1 ms
// (service.RedisNode.ProbeWrites): apart from every lock's key, under the
// same "redfence:" prefix an ACL grants.
const ProbePrefix = "redfence:probe:"

// ReleasedPrefix prefixes the Pub/Sub channel on which a node announces that
// a lock was released: ReleasedPrefix + key (as returned by Key).
const ReleasedPrefix = "redfence:released:"

// ValidName reports why name is not an acceptable lock or resource name, or ""
// when it is: 1 to 200 characters of A-Z a-z 0-9 . _ - :, other than "." and "..".
func ValidName(name string) string {
	if name == "" {
		return "must not be empty"
	}
	if name == "." || name == ".." {
		return "must not be . or .. (URL paths normalise them away)"
	}
	// The alphabet first: every character allowed is one byte, so the
	// length below counts characters.
	for i := 0; i < len(name); i++ {
		if !nameByte(name[i]) {
			r, _ := utf8.DecodeRuneInString(name[i:]) // U+FFFD for a byte that is not UTF-8
			return fmt.Sprintf("character %q at offset %d is not allowed (use A-Z a-z 0-9 . _ - :)", r, i)
		}
	}
	if len(name) > MaxNameLen {
		return fmt.Sprintf("must be at most %d characters, got %d", MaxNameLen, len(name))
	}
	return ""
}

// ValidNamespace reports whether ns can be used as a namespace: empty (the
// default), or the same alphabet as names.
func ValidNamespace(ns string) bool {
	return ns == "" || ValidName(ns) == ""
}

func nameByte(c byte) bool {
	switch {
	case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		return true
	}
	return strings.IndexByte("._-:", c) >= 0
}
