package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// pprofSource is added to cmd/redfence at build time (go build -overlay) in
// profile mode only, so the profiled server is the real binary with its real
// wiring, and the source tree stays untouched.
const pprofSource = `package main

import (
	_ "expvar"
	"net/http"
	_ "net/http/pprof"
	"os"
)

// Added by bench -profile only (go build -overlay): pprof and expvar on a
// separate loopback listener.
func init() {
	if addr := os.Getenv("REDFENCE_BENCH_PPROF_ADDR"); addr != "" {
		go func() { _ = http.ListenAndServe(addr, nil) }()
	}
}
`

// pprofOverlay writes the overlay file and returns the -overlay JSON path.
func (e *env) pprofOverlay() (string, error) {
	src, err := filepath.Abs(filepath.Join(e.cfg.src, "cmd", "redfence"))
	if err != nil {
		return "", err
	}
	file := filepath.Join(e.tmp, "zz_bench_pprof.go")
	if err := os.WriteFile(file, []byte(pprofSource), 0o644); err != nil {
		return "", err
	}
	b, _ := json.Marshal(map[string]map[string]string{"Replace": {filepath.Join(src, "zz_bench_pprof.go"): file}})
	overlay := filepath.Join(e.tmp, "overlay.json")
	return overlay, os.WriteFile(overlay, b, 0o644)
}

var pprofPort int

func (e *env) pprofAddr() string {
	if pprofPort == 0 {
		pprofPort, _ = freePort()
	}
	return fmt.Sprintf("127.0.0.1:%d", pprofPort)
}

// enableStatements restarts Postgres with pg_stat_statements loaded (profile
// mode only: it counts the statements per grant).
func (e *env) enableStatements(ctx context.Context) error {
	if _, err := e.pgAdmin.Exec(ctx, "ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'"); err != nil {
		return err
	}
	_ = e.pgAdmin.Close(ctx)
	if err := e.cl.Postgres.Stop(ctx, false); err != nil {
		return err
	}
	if err := e.cl.Postgres.Start(ctx); err != nil {
		return err
	}
	var err error
	if e.pgAdmin, err = pgx.Connect(ctx, e.dbURL); err != nil {
		return err
	}
	_, err = e.pgAdmin.Exec(ctx, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
	return err
}

type stmt struct {
	calls int64
	query string
}

func (e *env) statements(ctx context.Context) []stmt {
	rows, err := e.pgAdmin.Query(ctx, `SELECT calls, regexp_replace(query, '\s+', ' ', 'g') FROM pg_stat_statements
		WHERE query NOT LIKE '%pg_stat_statements%' AND query NOT LIKE '%pg_current_snapshot%' ORDER BY calls DESC LIMIT 12`)
	if err != nil {
		return []stmt{{0, "pg_stat_statements: " + err.Error()}}
	}
	defer rows.Close()
	var out []stmt
	for rows.Next() {
		var s stmt
		if err := rows.Scan(&s.calls, &s.query); err == nil {
			out = append(out, s)
		}
	}
	return out
}

type memStats struct {
	Mallocs, TotalAlloc, NumGC uint64
	PauseTotalNs               uint64
}

func (e *env) serverMem(ctx context.Context) memStats {
	var v struct {
		Memstats memStats `json:"memstats"`
	}
	if b, err := e.pprofGet(ctx, "/debug/vars"); err == nil {
		_ = json.Unmarshal(b, &v)
	}
	return v.Memstats
}

func (e *env) pprofGet(ctx context.Context, path string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+e.pprofAddr()+path, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("%s: %s", path, resp.Status)
	}
	return b, err
}

// profile runs the HTTP case and the in-process case at the largest worker
// count on distinct names and records what each cycle costs.
func (e *env) profile(ctx context.Context) error {
	dir := e.cfg.profileDir
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	w := slices.Max(e.cfg.workers)
	secs := max(1, int(e.cfg.duration.Seconds()))
	e.cfg.duration = time.Duration(secs) * time.Second
	var rep strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&rep, format, args...) }
	p("# Profile: %d workers, distinct names, %v\n\n%s\n", w, e.cfg.duration, e.versions)

	// 1. Over HTTP: profile the server process.
	var m0, m1 memStats
	var a0, a1, cpu []byte
	var stmts []stmt
	cpuDone := make(chan error, 1)
	r := e.run(ctx, cell{kind: distinct, workers: w, sys: e.systems["http"]}, hooks{
		start: func(ctx context.Context) {
			m0 = e.serverMem(ctx)
			a0, _ = e.pprofGet(ctx, "/debug/pprof/allocs")
			_, _ = e.pgAdmin.Exec(ctx, "SELECT pg_stat_statements_reset()")
			go func() {
				var err error
				cpu, err = e.pprofGet(ctx, fmt.Sprintf("/debug/pprof/profile?seconds=%d", secs))
				cpuDone <- err
			}()
			go func() {
				tr, err := e.pprofGet(ctx, "/debug/pprof/trace?seconds=2")
				if err == nil {
					_ = os.WriteFile(filepath.Join(dir, "server.trace"), tr, 0o644)
				}
			}()
		},
		stop: func(ctx context.Context) {
			m1 = e.serverMem(ctx)
			a1, _ = e.pprofGet(ctx, "/debug/pprof/allocs")
			stmts = e.statements(ctx)
		},
	})
	if err := <-cpuDone; err != nil {
		return fmt.Errorf("server CPU profile: %w", err)
	}
	files := map[string][]byte{"server-cpu.pprof": cpu, "server-allocs-0.pprof": a0, "server-allocs-1.pprof": a1}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			return err
		}
	}
	e.profileSection(&rep, "redfence http/1.1 (server process)", r, m1.Mallocs-m0.Mallocs, m1.TotalAlloc-m0.TotalAlloc, m1.NumGC-m0.NumGC, stmts)
	p("%s", pprofTop(dir, "server-cpu.pprof", "", "CPU, flat", "-top"))
	p("%s", pprofTop(dir, "server-cpu.pprof", "", "CPU, cumulative", "-top", "-cum"))
	p("%s", pprofTop(dir, "server-allocs-1.pprof", "server-allocs-0.pprof", "allocations (objects) in the window", "-top", "-sample_index=alloc_objects"))
	p("%s", pprofTop(dir, "server-allocs-1.pprof", "server-allocs-0.pprof", "allocations (bytes) in the window", "-top", "-sample_index=alloc_space"))

	// 2. In-process: profile this process.
	var ms0, ms1 runtime.MemStats
	cpuFile, err := os.Create(filepath.Join(dir, "inproc-cpu.pprof"))
	if err != nil {
		return err
	}
	var ia0 bytes.Buffer
	r = e.run(ctx, cell{kind: distinct, workers: w, sys: e.systems["inproc"]}, hooks{
		start: func(ctx context.Context) {
			_, _ = e.pgAdmin.Exec(ctx, "SELECT pg_stat_statements_reset()")
			_ = pprof.Lookup("allocs").WriteTo(&ia0, 0)
			runtime.ReadMemStats(&ms0)
			_ = pprof.StartCPUProfile(cpuFile)
		},
		stop: func(ctx context.Context) {
			pprof.StopCPUProfile()
			runtime.ReadMemStats(&ms1)
			stmts = e.statements(ctx)
			var ia1 bytes.Buffer
			_ = pprof.Lookup("allocs").WriteTo(&ia1, 0)
			_ = os.WriteFile(filepath.Join(dir, "inproc-allocs-0.pprof"), ia0.Bytes(), 0o644)
			_ = os.WriteFile(filepath.Join(dir, "inproc-allocs-1.pprof"), ia1.Bytes(), 0o644)
		},
	})
	cpuFile.Close()
	e.profileSection(&rep, "redfence in-proc (this process: service.Locker + go-redis + pgx)", r, ms1.Mallocs-ms0.Mallocs, ms1.TotalAlloc-ms0.TotalAlloc, uint64(ms1.NumGC-ms0.NumGC), stmts)
	p("%s", pprofTop(dir, "inproc-cpu.pprof", "", "CPU, flat", "-top"))
	p("%s", pprofTop(dir, "inproc-cpu.pprof", "", "CPU, cumulative", "-top", "-cum"))
	p("%s", pprofTop(dir, "inproc-allocs-1.pprof", "inproc-allocs-0.pprof", "allocations (objects) in the window", "-top", "-sample_index=alloc_objects"))

	out := rep.String()
	fmt.Print(out)
	return os.WriteFile(filepath.Join(dir, "report.md"), []byte(out), 0o644)
}

func (e *env) profileSection(w io.Writer, title string, r *result, mallocs, bytes, gcs uint64, stmts []stmt) {
	p := func(format string, args ...any) { fmt.Fprintf(w, format, args...) }
	n := float64(max(r.cycles, 1))
	p("\n## %s\n\n", title)
	p("- %.0f cycles/s, acquire p50 %s p99 %s, %d errors\n", r.rate(), fmtDur(r.pct(0.5)), fmtDur(r.pct(0.99)), r.errs)
	p("- CPU per cycle: client %.0fµs, server %.0fµs, redis %.0fµs (5 nodes), postgres %.0fµs\n",
		r.client.Seconds()/n*1e6, r.server.Seconds()/n*1e6, r.redis.Seconds()/n*1e6, r.pg.Seconds()/n*1e6)
	p("- Go heap per cycle (profiled process): %.0f allocations, %.1f KiB; %d GCs in the window\n", float64(mallocs)/n, float64(bytes)/n/1024, gcs)
	p("- Redis round trips per cycle (socket reads, 5 nodes): %.2f\n", float64(r.redisReads)/n)
	var cmds []string
	for k, v := range e.lastCmds {
		cmds = append(cmds, fmt.Sprintf("%s %.2f", k, float64(v)/n))
	}
	slices.Sort(cmds)
	p("- Redis commands per cycle, all nodes (INFO commandstats; commands run inside scripts count too): %s\n", strings.Join(cmds, ", "))
	p("- Postgres write transactions per cycle: %.2f\n", float64(r.pgXacts)/n)
	p("- Postgres statements per cycle (pg_stat_statements):\n")
	for _, s := range stmts {
		p("  - %.2f × `%.140s`\n", float64(s.calls)/n, s.query)
	}
}

// pprofTop runs go tool pprof -top and returns its first lines.
func pprofTop(dir, file, base, title string, args ...string) string {
	args = append([]string{"tool", "pprof", "-nodecount=30"}, args...)
	if base != "" {
		args = append(args, "-base", filepath.Join(dir, base))
	}
	args = append(args, filepath.Join(dir, file))
	out, err := exec.Command("go", args...).CombinedOutput()
	if err != nil {
		return fmt.Sprintf("\n(go tool pprof %s: %v)\n", file, err)
	}
	slug := strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			return r
		}
		return '-'
	}, strings.ToLower(title))
	_ = os.WriteFile(filepath.Join(dir, strings.TrimSuffix(file, ".pprof")+"-"+slug+".txt"), out, 0o644)
	return fmt.Sprintf("\n### %s (%s)\n\n```\n%s```\n", title, file, out)
}
