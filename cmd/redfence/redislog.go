package main

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/redis/go-redis/v9"
)

// redisLogger routes go-redis' internal messages (dial retries and the like,
// which repeat for every request while a node is down) to slog at debug level.
// Node failures are reported where they matter: per-node outcomes in errors,
// GET /v1/nodes and /readyz.
type redisLogger struct{ log *slog.Logger }

func (l redisLogger) Printf(ctx context.Context, format string, v ...any) {
	l.log.DebugContext(ctx, "go-redis", slog.String("message", fmt.Sprintf(format, v...)))
}

// quietRedis installs redisLogger. go-redis keeps its logger in a package
// variable, so this is process-wide; only main calls it.
func quietRedis(log *slog.Logger) { redis.SetLogger(redisLogger{log}) }
