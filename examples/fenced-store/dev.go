package main

import (
	"context"

	"github.com/redfence/redfence/internal/cluster"
)

// throwawayPostgres starts a local Postgres (from this module's test
// harness) so the example runs without setup; stop removes it. A real
// service takes its database URL from its configuration instead.
func throwawayPostgres(ctx context.Context) (url string, stop func(), err error) {
	pg, err := cluster.StartPostgres(ctx, cluster.PostgresOptions{})
	if err != nil {
		return "", nil, err
	}
	return pg.URL(), func() { _ = pg.Close() }, nil
}
