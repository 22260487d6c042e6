package main

import (
	"context"
	"errors"

	"github.com/redfence/redfence/store"
)

// startLocal cannot start servers on Windows: redfence dev runs there only
// with REDFENCE_REDIS_ADDRS and REDFENCE_DATABASE_URL both set.
func startLocal(context.Context, localOptions) (localServers, error) {
	return nil, errors.New("redfence dev starts its own Redis nodes and Postgres only on Linux and macOS: on Windows set REDFENCE_REDIS_ADDRS and REDFENCE_DATABASE_URL to servers of your own")
}

// keyCreator cannot name a process that a later run could check on Windows:
// redfence dev's key there is revoked only when it stops.
func keyCreator() (store.KeyCreator, bool) { return store.KeyCreator{}, false }

// processGone is never called on Windows (see keyCreator).
func processGone(int) bool { return false }
