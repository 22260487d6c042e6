package cluster

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"

	dc "github.com/ory/dockertest/v3/docker"
)

// TestRemoveOrphanDirs: only the directories whose creator has exited, and
// on which no Postgres runs, are removed.
func TestRemoveOrphanDirs(t *testing.T) {
	parent := t.TempDir()
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	dead := strconv.Itoa(cmd.ProcessState.Pid()) // exited and reaped
	live := strconv.Itoa(os.Getppid())
	dirs := map[string]struct {
		owner, postmaster string // "" for no file
		kept              bool
	}{
		"redfence-pg-dead":       {owner: dead, kept: false},
		"redfence-pg-live":       {owner: live, kept: true},
		"redfence-pg-mine":       {owner: strconv.Itoa(os.Getpid()), kept: true},
		"redfence-pg-noowner":    {kept: true},
		"redfence-pg-garbage":    {owner: "not a pid", kept: true},
		"redfence-pg-postgres":   {owner: dead, postmaster: live, kept: true},
		"redfence-pg-stalepm":    {owner: dead, postmaster: dead, kept: false},
		"other-prefix-deadowner": {owner: dead, kept: true},
	}
	for name, d := range dirs {
		dir := filepath.Join(parent, name)
		if err := os.MkdirAll(filepath.Join(dir, "data"), 0o755); err != nil {
			t.Fatal(err)
		}
		if d.owner != "" {
			if err := os.WriteFile(filepath.Join(dir, ownerFile), []byte(d.owner+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if d.postmaster != "" {
			if err := os.WriteFile(filepath.Join(dir, "data", "postmaster.pid"), []byte(d.postmaster+"\n/data\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	removeOrphanDirs(parent, "redfence-pg-")
	for name, d := range dirs {
		_, err := os.Stat(filepath.Join(parent, name))
		if kept := err == nil; kept != d.kept {
			t.Errorf("%s: kept = %v; want %v", name, kept, d.kept)
		}
	}
}

// TestOrphanContainers: a container is an orphan when it was created on
// this host by a process that is gone; one of another host (a shared Docker
// engine), of a live process, or not labelled by this package is kept.
func TestOrphanContainers(t *testing.T) {
	gone := func(pid int) bool { return pid == 41 }
	list := []dc.APIContainers{
		{ID: "orphan", Labels: map[string]string{ownerPIDLabel: "41", ownerHostLabel: "h1"}},
		{ID: "live", Labels: map[string]string{ownerPIDLabel: "42", ownerHostLabel: "h1"}},
		{ID: "other-host", Labels: map[string]string{ownerPIDLabel: "41", ownerHostLabel: "h2"}},
		{ID: "unlabelled", Labels: map[string]string{"x": "y"}},
		{ID: "bad-pid", Labels: map[string]string{ownerPIDLabel: "x", ownerHostLabel: "h1"}},
	}
	if got := orphanContainers(list, "h1", gone); len(got) != 1 || got[0] != "orphan" {
		t.Errorf("orphanContainers = %v; want [orphan]", got)
	}
	if l := ownerLabels(); l[ownerPIDLabel] != strconv.Itoa(os.Getpid()) || l[ownerHostLabel] == "" {
		t.Errorf("ownerLabels = %v; want this process's PID and host", l)
	}
}
