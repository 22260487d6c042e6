package main

import (
	"context"
	"errors"
)

// startLocal cannot start servers on Windows: redfence dev runs there only
// with REDFENCE_REDIS_ADDRS and REDFENCE_DATABASE_URL both set.
func startLocal(context.Context, localOptions) (localServers, error) {
	return nil, errors.New("redfence dev starts its own Redis nodes and Postgres only on Linux and macOS: on Windows set REDFENCE_REDIS_ADDRS and REDFENCE_DATABASE_URL to servers of your own")
}
