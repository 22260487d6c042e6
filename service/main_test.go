package service

import (
	"context"
	"os"
	"testing"

	"github.com/redis/go-redis/v9"
)

// quietRedis drops go-redis's internal log lines (as redfence serve keeps
// them at debug level): closing a node while a release finishes in the
// background makes its pool print one, which would garble benchmark output.
type quietRedis struct{}

func (quietRedis) Printf(context.Context, string, ...any) {}

func TestMain(m *testing.M) {
	redis.SetLogger(quietRedis{})
	os.Exit(m.Run())
}
