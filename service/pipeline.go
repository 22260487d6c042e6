package service

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
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
	// script, when set, is the script cmd runs by EVALSHA: the writer
	// resends it as EVAL after NOSCRIPT (the node restarted or its script
	// cache was flushed), and merges it with other calls of the script.
	script *luaScript
	// done receives once when cmd has its answer (buffered: the writer
	// never blocks, even for a caller that gave up).
	done chan struct{}
	// cb, when set, is called with the answer instead (see doAsync).
	cb func(cmd *redis.Cmd, err error)
}

// answer tells c's caller that c.cmd has its answer: it calls c.cb, or
// signals c.done.
func (c *call) answer() {
	if cb := c.cb; cb != nil {
		c.cb = nil
		cb(c.cmd, c.cmd.Err())
		return
	}
	c.done <- struct{}{}
}

// pipeliner sends a node's commands in batches, one batch on the wire at a
// time: every command queued while a batch is on the wire goes out in the
// next one, one write and one read for the lot (auto-pipelining, as rueidis
// does). A blocking caller (do) that finds no batch on the wire sends its
// command (and whatever is queued) itself, on its own goroutine, so an idle
// node costs no hand-off; otherwise it queues the command for the writer
// goroutine. An asynchronous caller (doAsync, the Locker's rounds) always
// queues, and the writer delivers the answer to its callback. A caller that
// gives up (its context ends) returns at once; a command still queued then is
// dropped rather than sent.
type pipeliner struct {
	client *redis.Client
	conn   *connector
	queue  chan *call
	closed chan struct{}
	once   sync.Once
	wg     sync.WaitGroup
	// sending is held while a batch is on the wire; buf is its batch and
	// pipe the pipeline that sends it (Exec leaves it empty for reuse).
	sending sync.Mutex
	buf     []*call
	pipe    redis.Pipeliner
	// units is the reused list of a batch's commands (see send).
	units []unit
	// calls recycles the calls whose callers saw the answer.
	calls sync.Pool
	// queued counts the calls handed to the writer goroutine (for tests).
	queued atomic.Int64
	// yield is what the writer does before writing to a busy node:
	// runtime.Gosched (tests count the calls).
	yield func()
	// mu orders doAsync's enqueues before close: once shut is set nothing
	// is queued any more, so close's last drain answers every call.
	mu   sync.RWMutex
	shut bool
	// blocking, if set (tests), is called when an enqueue waits for room.
	blocking func()
}

func newPipeliner(client *redis.Client, conn *connector) *pipeliner {
	p := &pipeliner{client: client, conn: conn, queue: make(chan *call, 4*maxBatch), closed: make(chan struct{}),
		buf: make([]*call, 0, maxBatch), pipe: client.Pipeline(), yield: runtime.Gosched}
	p.wg.Add(1)
	go p.run()
	return p
}

// do sends cmd, or queues it, and waits for its answer or for ctx to end.
// It returns the command that answered (cmd, or the EVAL that replaced it).
func (p *pipeliner) do(ctx context.Context, cmd *redis.Cmd, s *luaScript) (*redis.Cmd, error) {
	select {
	case <-p.closed:
		return nil, errNodeClosed
	default:
	}
	c, _ := p.calls.Get().(*call)
	if c == nil {
		c = &call{done: make(chan struct{}, 1)}
	}
	c.ctx, c.cmd, c.script = ctx, cmd, s
	if p.sending.TryLock() {
		// Nothing on the wire: send now, with whatever is queued.
		p.buf, _ = p.sendLocked(append(p.buf[:0], c))
		p.sending.Unlock()
		<-c.done // answered by the send
		return p.recycle(c)
	}
	select {
	case p.queue <- c:
		p.queued.Add(1)
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-p.closed:
		return nil, errNodeClosed
	}
	select {
	case <-c.done:
		return p.recycle(c)
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-p.closed:
		return nil, errNodeClosed
	}
}

// doAsync queues cmd for the writer goroutine and returns at once; cb is
// called exactly once with the command that answered (cmd, or the EVAL that
// replaced it) and its error, on the goroutine that sent the batch (or on
// the caller's when the node is closed). cb must not block: it runs where
// the node's next batch waits. A command whose ctx has ended when its batch
// is sent is dropped unsent (cb gets ctx.Err()).
//
// It spares a caller that asks several nodes at once a goroutine per node:
// the writer delivers the answer.
func (p *pipeliner) doAsync(ctx context.Context, cmd *redis.Cmd, s *luaScript, cb func(*redis.Cmd, error)) {
	c := &call{ctx: ctx, cmd: cmd, script: s, cb: cb}
	if !p.enqueue(c, false) {
		// Full: wait for room elsewhere, never here (the caller may be a
		// writer answering a batch).
		go p.enqueue(c, true)
	}
}

// enqueue queues c for the writer, or answers it with errNodeClosed once the
// pipeliner is closed. Unless wait, it gives up (false) on a full queue;
// with wait, it waits for room until c's context ends (then answers c with
// the context's error).
func (p *pipeliner) enqueue(c *call, wait bool) bool {
	p.mu.RLock()
	if p.shut {
		p.mu.RUnlock()
		c.cmd.SetErr(errNodeClosed)
		c.answer()
		return true
	}
	if wait {
		if p.blocking != nil {
			p.blocking()
		}
		select {
		case p.queue <- c:
		case <-p.closed:
			// close waits for this read lock to be released: waiting
			// here for room the writer no longer makes would hang it.
			p.mu.RUnlock()
			c.cmd.SetErr(errNodeClosed)
			c.answer()
			return true
		case <-c.ctx.Done():
			// Its caller is gone: the writer would drop it unsent
			// anyway. Waiting for room regardless kept a goroutine
			// per overflowing call alive for as long as the node was
			// overloaded, long after every caller had given up.
			p.mu.RUnlock()
			c.cmd.SetErr(c.ctx.Err())
			c.answer()
			return true
		}
	} else {
		select {
		case p.queue <- c:
		default:
			p.mu.RUnlock()
			return false
		}
	}
	p.mu.RUnlock()
	p.queued.Add(1)
	return true
}

// recycle returns c's command and puts c back in the pool: its answer was
// received, so nothing refers to it any more.
func (p *pipeliner) recycle(c *call) (*redis.Cmd, error) {
	cmd := c.cmd
	*c = call{done: c.done}
	p.calls.Put(c)
	return cmd, cmd.Err()
}

// close stops the writer and answers every call not sent with
// errNodeClosed. Closing p.closed first releases the enqueues waiting for
// room (they hold mu's read lock); then shut is set, after which nothing is
// queued, and what is still queued is answered.
func (p *pipeliner) close() {
	p.once.Do(func() { close(p.closed) })
	p.mu.Lock()
	p.shut = true
	p.mu.Unlock()
	p.wg.Wait()
	p.fail() // queued after the writer's own last drain, before shut was set
}

// run is the writer goroutine: it sends what callers queued while a batch
// was on the wire.
//
// While the node is busy (the last batch carried more than one command), the
// writer yields once before each write: the goroutines that are ready run
// first, and what they queue goes out in this write rather than the next.
// On an idle node it writes at once: a lone request has nobody to wait for,
// and a yield would put it behind every runnable goroutine of the process.
func (p *pipeliner) run() {
	defer p.wg.Done()
	busy := false
	for {
		var c *call
		select {
		case c = <-p.queue:
		case <-p.closed:
			p.fail()
			return
		}
		if busy {
			p.yield()
		}
		p.sending.Lock()
		var n int
		p.buf, n = p.sendLocked(append(p.buf[:0], c))
		p.sending.Unlock()
		busy = n > 1
	}
}

// sendLocked adds to batch what is queued, sends it and answers every call.
// It returns batch emptied, for reuse, and how many calls it carried.
// p.sending is held.
func (p *pipeliner) sendLocked(batch []*call) ([]*call, int) {
	select {
	case <-p.closed:
		for _, c := range batch {
			c.cmd.SetErr(errNodeClosed)
			c.answer()
		}
		clear(batch)
		return batch[:0], 0
	default:
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
	n := len(batch)
	p.send(batch)
	clear(batch)
	return batch[:0], n
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
// deadlines, and answers every call. The calls of one script that can be
// batched go out as one EVALSHA of its batch form, in the place of the
// first of them: the calls of a batch are concurrent (none has its answer
// yet), so any order of them is one they could have run in.
func (p *pipeliner) send(batch []*call) {
	pipe := p.pipe
	var deadline time.Time
	units := p.units[:0]
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
		units = addCall(units, c)
	}
	defer func() {
		clear(units)
		p.units = units[:0]
	}()
	if len(units) == 0 {
		return
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	// Not on a connection set up under this batch's deadline (see
	// connector).
	cerr := p.conn.ready(ctx)
	for i := range units {
		u := &units[i]
		if len(u.calls) > 1 {
			u.cmd, u.script = u.mergedCmd(), u.calls[0].script.batch
		} else {
			u.cmd, u.script = u.calls[0].cmd, u.calls[0].script
		}
		if cerr == nil {
			_ = pipe.Process(u.calls[0].ctx, u.cmd)
		}
	}
	if cerr != nil {
		unanswered(units, cerr)
		for i := range units {
			units[i].answer()
		}
		return
	}
	if _, err := pipe.Exec(ctx); err != nil {
		unanswered(units, err)
	}
	retry := false
	for i := range units {
		p.conn.failed(units[i].cmd.Err())
		if u := &units[i]; noScript(u.cmd, u.script) {
			retry = true
		} else {
			u.answer()
			u.calls = nil // answered: its calls may be reused already
		}
	}
	if !retry {
		return
	}
	// EVAL loads the script again; later batches find it by its hash.
	pipe = p.client.Pipeline()
	for i := range units {
		if u := &units[i]; u.calls != nil {
			u.cmd = evalOf(u.calls[0].ctx, u.cmd, u.script)
			_ = pipe.Process(u.calls[0].ctx, u.cmd)
		}
	}
	if _, err := pipe.Exec(ctx); err != nil {
		unanswered(units, err)
	}
	for i := range units {
		if u := &units[i]; u.calls != nil {
			p.conn.failed(u.cmd.Err())
			u.answer()
		}
	}
}

// unanswered gives err, the error of a pipeline's Exec, to the commands of
// units that got neither an answer nor an error of their own: when no
// connection could be had (a dial or its OnConnect hook failed), go-redis
// leaves them untouched. Each command answered carries its own error.
func unanswered(units []unit, err error) {
	for i := range units {
		if c := units[i].cmd; c != nil && c.Err() == nil && c.Val() == nil {
			c.SetErr(err)
		}
	}
}

// unit is what one command of a pipeline answers: one call, or the calls of
// one script merged into an EVALSHA of its batch form.
type unit struct {
	calls  []*call
	cmd    *redis.Cmd
	script *luaScript // what cmd runs, if it is an EVALSHA
	// nk and na are the numbers of keys and of arguments of each of the
	// merged calls (all the same).
	nk, na int
}

// addCall adds c to units: to the unit of the calls of its script with as
// many keys and arguments if there is one, else as a unit of its own.
func addCall(units []unit, c *call) []unit {
	if c.script == nil || c.script.batch == nil {
		return append(units, unit{calls: []*call{c}})
	}
	args := c.cmd.Args()
	nk, ok := args[2].(int)
	if !ok || len(args) < 3+nk {
		return append(units, unit{calls: []*call{c}})
	}
	na := len(args) - 3 - nk
	for i := range units {
		if u := &units[i]; u.calls[0].script == c.script && u.nk == nk && u.na == na {
			u.calls = append(u.calls, c)
			return units
		}
	}
	return append(units, unit{calls: []*call{c}, nk: nk, na: na})
}

// mergedCmd is the EVALSHA of the batch form of the script of u's calls
// (see batchSource) that runs each of them.
func (u *unit) mergedCmd() *redis.Cmd {
	nk, na := u.nk, u.na
	args := make([]any, 0, 6+len(u.calls)*(nk+na))
	args = append(args, "evalsha", u.calls[0].script.batch.sha, len(u.calls)*nk)
	for _, c := range u.calls {
		args = append(args, c.cmd.Args()[3:3+nk]...)
	}
	args = append(args, len(u.calls), nk, na)
	for _, c := range u.calls {
		args = append(args, c.cmd.Args()[3+nk:]...)
	}
	return redis.NewCmd(u.calls[0].ctx, args...)
}

// answer gives every call of u its answer from u.cmd.
func (u *unit) answer() {
	if len(u.calls) == 1 {
		c := u.calls[0]
		c.cmd = u.cmd
		c.answer()
		return
	}
	vals, err := u.cmd.Slice()
	if err == nil && len(vals) != len(u.calls) {
		err = fmt.Errorf("redfence batch: %d answers to %d calls", len(vals), len(u.calls))
	}
	for i, c := range u.calls {
		if err != nil {
			c.cmd.SetErr(err)
			c.answer()
			continue
		}
		switch v := vals[i].(type) {
		case int64:
			c.cmd.SetVal(v)
		case error:
			c.cmd.SetErr(v)
		default:
			c.cmd.SetErr(fmt.Errorf("redfence batch: answer %T, not an integer", v))
		}
		c.answer()
	}
}
