//go:build linux

package childproc_test

import (
	"bufio"
	"io"
	"os/exec"
	"syscall"
	"testing"

	"github.com/redfence/redfence/internal/childproc"
	"github.com/redfence/redfence/internal/testutil"
)

// cat starts cat with SIGKILL as its parent-death signal, from a goroutine
// whose thread then ends, and returns its stdin, stdout and exit channel.
func cat(t *testing.T) (io.WriteCloser, *bufio.Reader, <-chan error) {
	t.Helper()
	cmd := exec.Command("cat")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var exited <-chan error
	testutil.OnEndingThread(t, func() { exited, err = childproc.Start(cmd) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill() }) // Start's goroutine reaps it
	return in, bufio.NewReader(out), exited
}

func TestStart_OutlivesCallersThread(t *testing.T) {
	t.Parallel()
	in, out, exited := cat(t)
	// A child with SIGKILL pending never echoes.
	if _, err := io.WriteString(in, "ping\n"); err != nil {
		t.Fatal(err)
	}
	if line, err := out.ReadString('\n'); err != nil || line != "ping\n" {
		t.Fatalf("echo = %q, %v; want \"ping\\n\" (the child died with the caller's thread)", line, err)
	}
	if err := in.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-exited; err != nil {
		t.Errorf("cat exited with %v; want nil", err)
	}
}

func TestStart_Error(t *testing.T) {
	t.Parallel()
	if _, err := childproc.Start(exec.Command("/nonexistent/redfence-test")); err == nil {
		t.Error("Start of a missing binary: nil error; want one")
	}
}
