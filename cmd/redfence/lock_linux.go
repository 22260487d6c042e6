package main

import "syscall"

// commandAttr runs redfence lock's COMMAND in a process group of its own,
// and has the kernel kill it (Pdeathsig) if redfence lock dies (SIGKILL, the
// OOM killer) rather than let it run on with the token unwatched. Pdeathsig
// fires when the thread that started COMMAND exits: runLocked starts and
// waits for COMMAND on a goroutine locked to its thread. (The kernel drops
// it for a set-user-ID or file-capability COMMAND.)
func commandAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
