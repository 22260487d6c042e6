//go:build !linux

package testutil

import "syscall"

// KillWithParent returns attr (a new one if nil): only Linux can have the
// kernel kill a child when its parent dies (see the Linux version).
func KillWithParent(attr *syscall.SysProcAttr) *syscall.SysProcAttr {
	if attr == nil {
		attr = &syscall.SysProcAttr{}
	}
	return attr
}
