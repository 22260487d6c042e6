//go:build unix && !linux

package main

import "syscall"

// commandAttr runs redfence lock's COMMAND in a process group of its own.
// (Only Linux can have COMMAND killed when redfence lock dies.)
func commandAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
