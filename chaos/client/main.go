// Command client is a chaos-suite client process: it runs workload cycles
// (acquire, read, write with the fencing token, release) against Redfence
// servers, so that a test can pause it with SIGSTOP while it holds a lock,
// the way a GC pause, swap or VM migration stops a real client.
//
// It prints one JSON line per event on stdout: {"op": ...} for every
// operation once it returned (a chaos.Op), and {"pause": ...} when a cycle
// has read the document and is about to write it. After a pause line it
// reads one line from stdin before writing, so a test can stop it at exactly
// that point; a test that does not want to pause answers at once.
//
// It is test tooling: it trusts its flags and exits on the first I/O error.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	mathrand "math/rand/v2"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/redfence/redfence/chaos"
)

func main() {
	var (
		servers = flag.String("servers", "", "comma-separated base URLs of the servers")
		names   = flag.String("names", "", "comma-separated names to contend for")
		id      = flag.String("id", "c", "client id (prefix of the elements written)")
		ttl     = flag.Duration("ttl", 300*time.Millisecond, "lease asked for")
		wait    = flag.Duration("wait", time.Second, "wait_ms of each acquire")
		cycles  = flag.Int("cycles", 10, "cycles to run")
		seed    = flag.Uint64("seed", 1, "seed of the name choices")
		timeout = flag.Duration("timeout", 10*time.Second, "HTTP client timeout")
	)
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, strings.Split(*servers, ","), strings.Split(*names, ","), *id, *ttl, *wait, *cycles, *seed, *timeout); err != nil {
		fmt.Fprintln(os.Stderr, "chaos client:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, servers, names []string, id string, ttl, wait time.Duration, cycles int, seed uint64, timeout time.Duration) error {
	var mu sync.Mutex
	enc := json.NewEncoder(os.Stdout)
	emit := func(l chaos.ClientLine) {
		mu.Lock()
		defer mu.Unlock()
		if err := enc.Encode(l); err != nil {
			fmt.Fprintln(os.Stderr, "chaos client: stdout:", err)
			os.Exit(1)
		}
	}
	in := bufio.NewScanner(os.Stdin)
	c := &chaos.Client{
		ID:     id,
		HTTP:   &http.Client{Timeout: timeout},
		Record: func(op chaos.Op) { emit(chaos.ClientLine{Op: &op}) },
	}
	rng := mathrand.New(mathrand.NewPCG(seed, 0))
	opts := chaos.CycleOptions{
		TTL: ttl, Wait: wait,
		Pause: func(ctx context.Context, g *chaos.Grant) (*chaos.Link, bool) {
			emit(chaos.ClientLine{Pause: g})
			if !in.Scan() {
				fmt.Fprintln(os.Stderr, "chaos client: stdin closed")
				os.Exit(1)
			}
			// "paused" says the test stopped this process here.
			return nil, strings.TrimSpace(in.Text()) == "paused"
		},
	}
	for n := range cycles {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		c.Cycle(ctx, chaos.Link{Base: servers[n%len(servers)]}, names[rng.IntN(len(names))], opts)
	}
	return nil
}
