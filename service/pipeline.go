package service

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// errNodeClosed is returned by calls to a closed RedisNode.
var errNodeClosed = errors.New("redis node closed")

// maxBatch bounds how many commands one pipelined write carries.
const maxBatch = 512

// call is one command waiting for a pipelined write.
type call struct {
	ctx context.Context
	cmd *redis.Cmd
	// src, when set, is the Lua source of an EVALSHA cmd: the writer
	// resends it as EVAL after NOSCRIPT (the node restarted or its script
	// cache was flushed).
	src string
	// done receives once when cmd has its answer (buffered: the writer
	// never blocks, even for a caller that gave up).
	done chan struct{}
}

// answer tells c's caller that c.cmd has its answer.
func (c *call) answer() { c.done <- struct{}{} }

// pipeliner sends a node's commands in batches: a writer takes every command
// queued while the previous batch was on the wire and sends them as one
// pipeline, one write and one read for the lot (auto-pipelining, as rueidis
// does). Commands are sent in queue order. A caller that gives up (its
// context ends) returns at once; a command still queued then is dropped
// rather than sent.
type pipeliner struct {
	client *redis.Client
	queue  chan *call
	closed chan struct{}
	once   sync.Once
	wg     sync.WaitGroup
	// calls recycles the calls whose callers saw the answer.
	calls sync.Pool
}

func newPipeliner(client *redis.Client, writers int) *pipeliner {
	p := &pipeliner{client: client, queue: make(chan *call, 4*maxBatch), closed: make(chan struct{})}
	p.wg.Add(writers)
	for range writers {
		go p.run()
	}
	return p
}

// do queues cmd and waits for its answer or for ctx to end. It returns the
// command that answered (cmd, or the EVAL that replaced it).
func (p *pipeliner) do(ctx context.Context, cmd *redis.Cmd, src string) (*redis.Cmd, error) {
	c, _ := p.calls.Get().(*call)
	if c == nil {
		c = &call{done: make(chan struct{}, 1)}
	}
	c.ctx, c.cmd, c.src = ctx, cmd, src
	select {
	case p.queue <- c:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-p.closed:
		return nil, errNodeClosed
	}
	select {
	case <-c.done:
		cmd := c.cmd
		*c = call{done: c.done}
		p.calls.Put(c) // the writer is done with it
		return cmd, cmd.Err()
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-p.closed:
		return nil, errNodeClosed
	}
}

func (p *pipeliner) close() {
	p.once.Do(func() { close(p.closed) })
	p.wg.Wait()
}

func (p *pipeliner) run() {
	defer p.wg.Done()
	batch := make([]*call, 0, maxBatch)
	for {
		select {
		case c := <-p.queue:
			batch = append(batch[:0], c)
		case <-p.closed:
			p.fail()
			return
		}
	more:
		for len(batch) < maxBatch {
			select {
			case c := <-p.queue:
				batch = append(batch, c)
			default:
				break more
			}
		}
		p.send(batch)
		clear(batch)
	}
}

// fail answers every call still queued after close.
func (p *pipeliner) fail() {
	for {
		select {
		case c := <-p.queue:
			c.cmd.SetErr(errNodeClosed)
			c.answer()
		default:
			return
		}
	}
}

// send writes batch as one pipeline, bounded by the latest of its callers'
// deadlines, and answers every call.
func (p *pipeliner) send(batch []*call) {
	pipe := p.client.Pipeline()
	var deadline time.Time
	live := batch[:0]
	for _, c := range batch {
		if err := c.ctx.Err(); err != nil { // its caller is gone: do not send it
			c.cmd.SetErr(err)
			c.answer()
			continue
		}
		d, ok := c.ctx.Deadline()
		if !ok {
			d = time.Now().Add(time.Minute)
		}
		if d.After(deadline) {
			deadline = d
		}
		_ = pipe.Process(c.ctx, c.cmd)
		live = append(live, c)
	}
	if len(live) == 0 {
		return
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	_, _ = pipe.Exec(ctx) // each command carries its own error
	var retry []*call
	for _, c := range live {
		if err := c.cmd.Err(); err != nil && c.src != "" && redis.HasErrorPrefix(err, "NOSCRIPT") {
			retry = append(retry, c)
			continue
		}
		c.answer()
	}
	if len(retry) == 0 {
		return
	}
	// EVAL loads the script again; later batches find it by its hash.
	pipe = p.client.Pipeline()
	for _, c := range retry {
		args := c.cmd.Args()
		eval := make([]any, len(args))
		copy(eval, args)
		eval[0], eval[1] = "eval", c.src
		c.cmd = redis.NewCmd(c.ctx, eval...)
		_ = pipe.Process(c.ctx, c.cmd)
	}
	_, _ = pipe.Exec(ctx)
	for _, c := range retry {
		c.answer()
	}
}
