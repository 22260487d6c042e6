package main

import (
	"context"
	"errors"
	"io"
)

// cmdLock is not available on Windows: it runs COMMAND in a process group
// of its own and signals the group, which Windows does not have.
func cmdLock(context.Context, []string, io.Writer, io.Writer) error {
	return errors.New("redfence lock runs only on Linux and macOS (it signals COMMAND's process group)")
}
