//go:build unix

package cluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ory/dockertest/v3"
	dc "github.com/ory/dockertest/v3/docker"
)

// Labels of every container this package creates: the host, PID namespace
// and PID of the process that created it, so that the next start there
// removes the containers of a process that is gone (killed before it could
// remove them, as its local servers would have died with it: see the
// package doc). The namespace keeps a job in another container of the same
// host name from taking a live PID it cannot see for a dead one.
const (
	ownerPIDLabel  = "io.redfence.owner-pid"
	ownerHostLabel = "io.redfence.owner-host"
)

// ownerHost names where this process's PIDs mean something: the host name
// and, on Linux, the PID namespace.
func ownerHost() (string, error) {
	host, err := os.Hostname()
	if err != nil {
		return "", err
	}
	if ns, err := os.Readlink("/proc/self/ns/pid"); err == nil {
		host += " " + ns
	}
	return host, nil
}

// dockerPool connects to the Docker engine named by the environment (or the
// default socket), checks that it answers, and removes, best effort, the
// containers left by processes of this host that are gone.
func dockerPool() (*dockertest.Pool, error) {
	pool, err := dockertest.NewPool("")
	if err != nil {
		return nil, fmt.Errorf("cluster: docker: %w", err)
	}
	if err := pool.Client.Ping(); err != nil {
		return nil, fmt.Errorf("cluster: docker engine does not answer: %w", err)
	}
	removeOrphanContainers(pool.Client)
	return pool, nil
}

// removeOrphanContainers removes, best effort, the containers labelled as
// created on this host by a process that no longer exists. Only on an engine
// reached through a local socket: a remote one may serve other machines of
// the same host name, whose PIDs mean nothing here.
func removeOrphanContainers(client *dc.Client) {
	if !strings.HasPrefix(client.Endpoint(), "unix://") {
		return
	}
	host, err := ownerHost()
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	list, err := client.ListContainers(dc.ListContainersOptions{All: true, Filters: map[string][]string{"label": {ownerPIDLabel}}, Context: ctx})
	if err != nil {
		return
	}
	for _, id := range orphanContainers(list, host, gone) {
		_ = client.RemoveContainer(dc.RemoveContainerOptions{ID: id, Force: true, RemoveVolumes: true, Context: ctx})
	}
}

// orphanContainers returns the IDs of the containers in list that were
// created on host by a process that is gone.
func orphanContainers(list []dc.APIContainers, host string, gone func(pid int) bool) []string {
	var ids []string
	for _, c := range list {
		pid, err := strconv.Atoi(c.Labels[ownerPIDLabel])
		if err != nil || c.Labels[ownerHostLabel] != host || !gone(pid) {
			continue
		}
		ids = append(ids, c.ID)
	}
	return ids
}

// ownerLabels are the labels of a container this process creates.
func ownerLabels() map[string]string {
	host, _ := ownerHost()
	return map[string]string{ownerPIDLabel: strconv.Itoa(os.Getpid()), ownerHostLabel: host}
}

// containerSpec describes a container to run with one published port.
type containerSpec struct {
	repository, tag string
	env, cmd        []string
	port            string // container port, e.g. "6379/tcp"
}

// container is a backend that runs a Docker container whose port is
// published on 127.0.0.1:hostPort. The container (and its anonymous
// volumes) survives stop and start and is removed by remove.
type container struct {
	client *dc.Client
	id     string
	out    *output

	mu   sync.Mutex
	exit chan struct{}
}

// runContainer pulls the image if needed, creates the container and starts
// it with spec.port published on 127.0.0.1:hostPort.
func runContainer(ctx context.Context, pool *dockertest.Pool, spec containerSpec, hostPort int, out *output) (*container, error) {
	client := pool.Client
	image := spec.repository + ":" + spec.tag
	if _, err := client.InspectImage(image); err != nil {
		err := client.PullImage(dc.PullImageOptions{Repository: spec.repository, Tag: spec.tag, Context: ctx}, dc.AuthConfiguration{})
		if err != nil {
			return nil, fmt.Errorf("cluster: docker pull %s: %w", image, err)
		}
	}
	port := dc.Port(spec.port)
	created, err := client.CreateContainer(dc.CreateContainerOptions{
		Context: ctx,
		Config: &dc.Config{
			Image:        image,
			Env:          spec.env,
			Cmd:          spec.cmd,
			ExposedPorts: map[dc.Port]struct{}{port: {}},
			Labels:       ownerLabels(),
		},
		HostConfig: &dc.HostConfig{
			PortBindings: map[dc.Port][]dc.PortBinding{
				port: {{HostIP: "127.0.0.1", HostPort: strconv.Itoa(hostPort)}},
			},
		},
	})
	if err != nil {
		return nil, fmt.Errorf("cluster: docker create %s: %w", image, err)
	}
	exit := make(chan struct{})
	close(exit)
	c := &container{client: client, id: created.ID, out: out, exit: exit}
	if err := c.launch(ctx); err != nil {
		return nil, errors.Join(err, c.remove())
	}
	return c, nil
}

func (c *container) launch(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	select {
	case <-c.exit:
	default:
		return fmt.Errorf("cluster: container %.12s is already running", c.id)
	}
	c.out.reset()
	since := time.Now().Unix()
	if err := c.client.StartContainerWithContext(c.id, nil, ctx); err != nil {
		msg := err.Error()
		if strings.Contains(msg, "address already in use") || strings.Contains(msg, "port is already allocated") {
			return fmt.Errorf("%w: docker start: %v", errPortInUse, err)
		}
		return fmt.Errorf("cluster: docker start %.12s: %w", c.id, err)
	}
	exit := make(chan struct{})
	c.exit = exit
	go func() {
		_ = c.client.Logs(dc.LogsOptions{
			Container:    c.id,
			OutputStream: c.out,
			ErrorStream:  c.out,
			Follow:       true,
			Stdout:       true,
			Stderr:       true,
			Since:        since,
		})
	}()
	go func() {
		// Returns when the container stops or is removed.
		_, _ = c.client.WaitContainer(c.id)
		close(exit)
	}()
	return nil
}

func (c *container) exited() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.exit
}

func (c *container) pid() int { return 0 }

func (c *container) signal(sig syscall.Signal) error {
	if !running(c) {
		return errNotRunning
	}
	if err := c.client.KillContainer(dc.KillContainerOptions{ID: c.id, Signal: dc.Signal(sig)}); err != nil {
		return fmt.Errorf("cluster: docker kill -s %v %.12s: %w", sig, c.id, err)
	}
	return nil
}

func (c *container) pause() error {
	if !running(c) {
		return errNotRunning
	}
	if err := c.client.PauseContainer(c.id); err != nil {
		return fmt.Errorf("cluster: docker pause %.12s: %w", c.id, err)
	}
	return nil
}

func (c *container) resume() error {
	if !running(c) {
		return errNotRunning
	}
	if err := c.client.UnpauseContainer(c.id); err != nil {
		return fmt.Errorf("cluster: docker unpause %.12s: %w", c.id, err)
	}
	return nil
}

func (c *container) kill() error {
	// Docker refuses to kill a paused container.
	_ = c.resume()
	return c.signal(syscall.SIGKILL)
}

func (c *container) output() string { return c.out.String() }

func (c *container) remove() error {
	err := c.client.RemoveContainer(dc.RemoveContainerOptions{ID: c.id, Force: true, RemoveVolumes: true})
	if err != nil {
		return fmt.Errorf("cluster: docker rm %.12s: %w", c.id, err)
	}
	return nil
}
