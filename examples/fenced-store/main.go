// Command fenced-store is an example storage service that enforces
// Redfence fencing tokens itself: a small HTTP/JSON document store on its
// own Postgres table, where every write must carry the Fencing-Token of the
// lock that protects it, and a write with a token older than the last one
// applied is refused (409). See README.md for the SQL recipe.
//
//	PUT /documents/{id}   Fencing-Token: N, optional If-Match: "<version>" or If-None-Match: *, body: any JSON
//	GET /documents/{id}
//
// Guarantees: the token check and the write are one SQL statement, so no
// older token can land after a newer one. Not guaranteed: a paused holder's
// write that lands before the next holder's first write is accepted (the
// ">=" rule cannot know a newer token exists); read-modify-write clients
// close that gap with If-Match (a version compare-and-set), or, when they
// read no document, If-None-Match: * (create only).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/redfence/redfence/fencing"
)

func main() {
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, "fenced-store:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("fenced-store", flag.ContinueOnError)
	fs.SetOutput(stderr)
	addr := fs.String("addr", "127.0.0.1:8090", "HTTP listen address")
	dbURL := fs.String("database-url", os.Getenv("DATABASE_URL"),
		"Postgres URL (default $DATABASE_URL; if empty, a throwaway local Postgres is started)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil // -h asked for the usage, which Parse printed
		}
		return err
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	if *dbURL == "" {
		url, stop, err := throwawayPostgres(ctx)
		if err != nil {
			return err
		}
		defer stop()
		*dbURL = url
	}
	pool, err := pgxpool.New(ctx, *dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	st := &Store{pool: pool}
	if err := st.Migrate(ctx); err != nil {
		return fmt.Errorf("create table: %w", err)
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: newHandler(st, log), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	fmt.Fprintf(stdout, "fenced-store serving on http://%s\n", ln.Addr())
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return srv.Shutdown(sctx)
}

// newHandler serves the documents API over st.
func newHandler(st *Store, log *slog.Logger) http.Handler {
	mux := http.NewServeMux()
	// Require refuses a PUT without one valid Fencing-Token (400) before the
	// handler runs; the handler's single statement does the real check.
	mux.Handle("PUT /documents/{id}", fencing.Require(fencing.RequireOptions{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token, _ := fencing.TokenFrom(r.Context())
		var ifVersion *int64
		match, noneMatch := r.Header.Get("If-Match"), r.Header.Get("If-None-Match")
		switch {
		case match != "" && noneMatch != "":
			problem(w, r, http.StatusBadRequest, "invalid-request", "send If-Match or If-None-Match, not both")
			return
		case noneMatch == "*":
			ifVersion = new(int64) // version 0: no document yet; only create it
		case noneMatch != "":
			problem(w, r, http.StatusBadRequest, "invalid-request", `If-None-Match must be *: create the document only if there is none`)
			return
		case match != "":
			n, err := strconv.ParseInt(strings.Trim(match, `"`), 10, 64)
			if err != nil || n < 1 {
				problem(w, r, http.StatusBadRequest, "invalid-request", `If-Match must be one version the store sent, e.g. "3" (no * and no weak W/ tags)`)
				return
			}
			ifVersion = &n
		}
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 1<<20))
		if tooLarge := (*http.MaxBytesError)(nil); errors.As(err, &tooLarge) {
			problem(w, r, http.StatusRequestEntityTooLarge, "request-too-large", fmt.Sprintf("the body is over %d bytes", tooLarge.Limit))
			return
		}
		if err != nil || !json.Valid(body) {
			problem(w, r, http.StatusBadRequest, "invalid-request", "the body must be JSON")
			return
		}
		d, err := st.Put(r.Context(), r.PathValue("id"), body, token, ifVersion)
		var stale *fencing.StaleError
		switch {
		case errors.As(err, &stale):
			log.Info("write refused: stale fencing token", "id", r.PathValue("id"), "fencing_token", int64(token), "current", int64(stale.Current))
			fencing.Refuse(w, r, err, stale.Current)
		case errors.Is(err, ErrVersion):
			problem(w, r, http.StatusPreconditionFailed, "version-changed", err.Error())
		case dataError(err):
			// JSON that jsonb cannot hold (a \u0000, a number beyond its
			// range): asking again cannot help.
			problem(w, r, http.StatusBadRequest, "invalid-request", "Postgres cannot store this JSON (jsonb refuses \\u0000 and numbers beyond its range)")
		case err != nil:
			log.Error("write failed", "id", r.PathValue("id"), "error", err.Error())
			fencing.Refuse(w, r, err, 0)
		default:
			writeDoc(w, d)
		}
	})))
	mux.HandleFunc("GET /documents/{id}", func(w http.ResponseWriter, r *http.Request) {
		d, err := st.Get(r.Context(), r.PathValue("id"))
		switch {
		case errors.Is(err, ErrNotFound):
			problem(w, r, http.StatusNotFound, "not-found", "no such document")
		case err != nil:
			log.Error("read failed", "id", r.PathValue("id"), "error", err.Error())
			problem(w, r, http.StatusServiceUnavailable, "unavailable", "the store did not answer")
		default:
			writeDoc(w, d)
		}
	})
	return mux
}

// dataError reports whether err is Postgres refusing the data itself
// (SQLSTATE class 22, data exception), not an outage.
func dataError(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && strings.HasPrefix(pe.Code, "22")
}

// problem answers with an RFC 9457 problem+json document, as
// fencing.Refuse does for the fencing check.
func problem(w http.ResponseWriter, r *http.Request, status int, slug, detail string) {
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{
		"type": "urn:fenced-store:problem:" + slug, "title": http.StatusText(status),
		"status": status, "detail": detail, "instance": r.URL.EscapedPath(),
	})
}

func writeDoc(w http.ResponseWriter, d *Document) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("ETag", strconv.Quote(strconv.FormatInt(d.Version, 10)))
	_ = json.NewEncoder(w).Encode(d)
}
