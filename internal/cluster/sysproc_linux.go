package cluster

import "syscall"

// sysProcAttr puts a child in its own process group (so a terminal's Ctrl-C
// reaches only the parent, which then shuts the child down) and makes the
// kernel kill it when the parent dies. cred, if not nil, switches user.
func sysProcAttr(cred *syscall.Credential) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{
		Setpgid:    true,
		Pdeathsig:  syscall.SIGKILL,
		Credential: cred,
	}
}
