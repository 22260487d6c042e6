//go:build unix && !linux

package cluster

import "syscall"

// sysProcAttr puts a child in its own process group (so a terminal's Ctrl-C
// reaches only the parent, which then shuts the child down). cred, if not
// nil, switches user. Only Linux has a parent-death signal: here a child
// whose parent was killed (SIGKILL, a crash) outlives it and must be
// stopped by hand; a parent that exits normally stops its children.
func sysProcAttr(cred *syscall.Credential) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{
		Setpgid:    true,
		Credential: cred,
	}
}
