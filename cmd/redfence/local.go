package main

// localOptions says which servers redfence dev starts itself: nodes Redis
// nodes unless withoutRedis, and a Postgres unless withoutPostgres.
type localOptions struct {
	nodes                         int
	withoutRedis, withoutPostgres bool
}

// localServers are the servers redfence dev started.
type localServers interface {
	// Addrs are the Redis nodes' addresses (none when withoutRedis).
	Addrs() []string
	// PostgresURL is the Postgres connection URL ("" when withoutPostgres).
	PostgresURL() string
	// Close stops them and removes their data.
	Close() error
}
