// Package childproc starts child processes whose parent-death signal
// (Linux's Pdeathsig) follows the life of the command rather than the
// accident of which thread forked it.
//
// The kernel sends the parent-death signal when the thread that started
// the child ends, not when the process does, and the Go runtime ends a
// thread whose goroutine exits locked to it. Start forks from a goroutine
// locked to its thread until the child is reaped, then unlocks it, so
// neither the caller's goroutine nor the waiting goroutine can end that
// thread early, and no other child is signalled when it ends.
package childproc

import (
	"os/exec"
	"runtime"
)

// Start starts cmd and returns a channel that receives the result of
// cmd.Wait once the command has exited and been reaped. cmd.Wait must not
// be called by anyone else.
func Start(cmd *exec.Cmd) (<-chan error, error) {
	started := make(chan error, 1)
	exited := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		exited <- cmd.Wait()
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return exited, nil
}
