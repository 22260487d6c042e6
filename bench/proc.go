package main

import (
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// clockTicks is USER_HZ, the unit of the times in /proc/<pid>/stat. Linux
// fixes it at 100 for user space whatever the kernel's HZ.
const clockTicks = 100

// procTable is one scan of /proc: for each process its parent and the CPU
// time (user+system) of itself and of its children that it has reaped.
type procTable struct {
	parent map[int]int
	cpu    map[int]time.Duration
}

// scanProcs reads /proc/<pid>/stat of every process. Processes that exit
// during the scan are skipped.
func scanProcs() procTable {
	t := procTable{parent: map[int]int{}, cpu: map[int]time.Duration{}}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return t
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		ppid, cpu, ok := readStat(pid)
		if !ok {
			continue
		}
		t.parent[pid] = ppid
		t.cpu[pid] = cpu
	}
	return t
}

// readStat parses /proc/<pid>/stat: "pid (comm) state ppid ... utime stime
// cutime cstime ...". comm may hold spaces and ')'.
func readStat(pid int) (ppid int, cpu time.Duration, ok bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0, false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, 0, false
	}
	f := strings.Fields(s[i+1:])
	// f[0] is field 3 (state): field n is f[n-3].
	if len(f) < 15 {
		return 0, 0, false
	}
	ppid, _ = strconv.Atoi(f[1])
	var ticks int64
	for _, k := range []int{11, 12, 13, 14} { // utime stime cutime cstime
		v, _ := strconv.ParseInt(f[k], 10, 64)
		ticks += v
	}
	return ppid, time.Duration(ticks) * time.Second / clockTicks, true
}

// tree returns the CPU time of pid and all its descendants (including
// children they reaped). 0 when pid is 0 or gone.
func (t procTable) tree(pid int) time.Duration {
	if pid <= 0 {
		return 0
	}
	if _, ok := t.cpu[pid]; !ok {
		return 0
	}
	kids := map[int][]int{}
	for c, p := range t.parent {
		kids[p] = append(kids[p], c)
	}
	var sum time.Duration
	queue := []int{pid}
	for len(queue) > 0 {
		p := queue[0]
		queue = queue[1:]
		sum += t.cpu[p]
		queue = append(queue, kids[p]...)
	}
	return sum
}

// selfCPU returns the CPU time (user+system, all threads) of this process.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
