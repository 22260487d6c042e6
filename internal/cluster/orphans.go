//go:build unix

package cluster

import (
	"bufio"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// ownerFile, in every temporary directory this package creates, holds the
// PID of the process that created it. A process killed with SIGKILL cannot
// remove its directories (its servers die with it: see the package doc), so
// the next start removes those whose creator is gone.
const ownerFile = ".redfence-owner"

// claimDir records this process as dir's creator.
func claimDir(dir string) error {
	return os.WriteFile(filepath.Join(dir, ownerFile), []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644)
}

// removeOrphanDirs removes, best effort, the directories under parent
// ("" is os.TempDir()) named prefix* whose creator process no longer
// exists and that no running Postgres uses. A directory without an owner
// file (another tool's, or one being created) is left alone.
func removeOrphanDirs(parent, prefix string) {
	if parent == "" {
		parent = os.TempDir()
	}
	matches, _ := filepath.Glob(filepath.Join(parent, prefix+"*"))
	for _, m := range matches {
		if !gone(pidIn(filepath.Join(m, ownerFile))) {
			continue
		}
		if pm := pidIn(filepath.Join(m, "data", "postmaster.pid")); pm > 0 && !gone(pm) {
			continue // a Postgres still runs on it
		}
		_ = os.RemoveAll(m)
	}
}

// OwnerHost names where this process's PIDs mean something: the host name
// and, on Linux, the PID namespace. With a PID, it names a process that
// Gone can check, as the container and directory sweeps do.
func OwnerHost() (string, error) { return ownerHost() }

// Gone reports whether no process of this host has pid (false for 0 and
// for this process).
func Gone(pid int) bool { return gone(pid) }

// pidIn returns the PID on the first line of file, or 0.
func pidIn(file string) int {
	f, err := os.Open(file)
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	if !sc.Scan() {
		return 0
	}
	pid, err := strconv.Atoi(strings.TrimSpace(sc.Text()))
	if err != nil || pid <= 0 {
		return 0
	}
	return pid
}

// gone reports whether no process has pid (false for 0 and for this
// process).
func gone(pid int) bool {
	if pid <= 0 || pid == os.Getpid() {
		return false
	}
	return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
}
