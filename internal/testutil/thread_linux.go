package testutil

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"runtime"
	"syscall"
	"testing"
	"time"
)

// OnEndingThread runs f on a goroutine locked to an OS thread that is not
// the main thread, lets that goroutine exit locked (so the Go runtime ends
// the thread) and returns once the thread is gone from /proc. By then the
// kernel has sent the parent-death signal (Pdeathsig) of every child the
// thread started: a child with SIGKILL pending never runs again. Linux only.
func OnEndingThread(tb testing.TB, f func()) {
	tb.Helper()
	tids := make(chan int, 1)
	var run func(held chan<- struct{})
	run = func(held chan<- struct{}) {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		if held != nil {
			close(held)
		}
		if syscall.Gettid() == os.Getpid() {
			// The runtime never ends the main thread: hold it until
			// another goroutine holds another thread.
			h := make(chan struct{})
			go run(h)
			<-h
			runtime.UnlockOSThread()
			return
		}
		defer func() { tids <- syscall.Gettid() }()
		f()
	}
	go run(nil)
	task := fmt.Sprintf("/proc/self/task/%d", <-tids)
	WaitFor(tb, time.Minute, "the thread to end", func() (bool, error) {
		_, err := os.Stat(task)
		if errors.Is(err, fs.ErrNotExist) {
			return true, nil
		}
		return false, err
	})
}

// KillWithParent returns attr (a new one if nil) set so that the kernel
// kills the child when the thread that started it ends (Pdeathsig: with the
// test binary, as no test ends a thread that started a child). Only Linux
// has it; elsewhere attr is returned as it is.
func KillWithParent(attr *syscall.SysProcAttr) *syscall.SysProcAttr {
	if attr == nil {
		attr = &syscall.SysProcAttr{}
	}
	attr.Pdeathsig = syscall.SIGKILL
	return attr
}
