package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/redfence/redfence/client"
	"github.com/redfence/redfence/client/clienttest"
	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/cluster/clustertest"
)

// docs is the example service on a fresh database of the shared Postgres.
type docs struct {
	t   *testing.T
	url string
}

func newDocs(t *testing.T) *docs {
	t.Helper()
	pool, err := pgxpool.New(t.Context(), clustertest.Database(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	st := &Store{pool: pool}
	if err := st.Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(newHandler(st, slog.New(slog.DiscardHandler)))
	t.Cleanup(srv.Close)
	return &docs{t: t, url: srv.URL}
}

// put writes body to the document id with token (0: no Fencing-Token),
// ifMatch (empty: none) and headers (name, value pairs); it returns the
// status and the decoded answer.
func (d *docs) put(id string, token fencing.Token, ifMatch, body string, headers ...string) (int, map[string]any) {
	d.t.Helper()
	req, err := http.NewRequest(http.MethodPut, d.url+"/documents/"+id, strings.NewReader(body))
	if err != nil {
		d.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if token != 0 {
		fencing.SetHeader(req.Header, token)
	}
	if ifMatch != "" {
		req.Header.Set("If-Match", ifMatch)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Add(headers[i], headers[i+1])
	}
	return d.do(req)
}

func (d *docs) get(id string) (int, map[string]any) {
	d.t.Helper()
	req, err := http.NewRequest(http.MethodGet, d.url+"/documents/"+id, nil)
	if err != nil {
		d.t.Fatal(err)
	}
	return d.do(req)
}

func (d *docs) do(req *http.Request) (int, map[string]any) {
	d.t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		d.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		d.t.Fatal(err)
	}
	var v map[string]any
	_ = json.Unmarshal(b, &v)
	return resp.StatusCode, v
}

func body(t *testing.T, v map[string]any) string {
	t.Helper()
	b, err := json.Marshal(v["body"])
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// pause is a holder that stops running (GC, swap, VM migration) until its
// lease has run out, without knowing it: it waits for its own lease's
// deadline, which it would not notice if it were really paused.
func pause(t *testing.T, l *client.Lease) {
	t.Helper()
	select {
	case <-l.Done():
	case <-time.After(time.Minute):
		t.Fatal("the paused holder's lease never ran out")
	}
}

// TestPausedHolder shows the recipe refusing the write of a holder whose
// lease ran out while it was paused, once the next holder has written.
func TestPausedHolder(t *testing.T) {
	t.Parallel()
	rf := clienttest.Start(t, clienttest.Options{})
	c, err := client.New(rf.URL, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	d := newDocs(t)
	ctx := t.Context()

	// A holds the lock and writes twice with its token (">=": allowed).
	a, err := c.Acquire(ctx, "invoice-7", &client.LockOptions{TTL: time.Second, NoRenew: true})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if code, v := d.put("invoice-7", a.FencingToken(), "", fmt.Sprintf(`{"total":%d}`, 40+i)); code != 200 {
			t.Fatalf("A's write %d = %d %v; want 200", i, code, v)
		}
	}
	// A pauses; its lease runs out and B is granted the lock, with a newer token.
	pause(t, a)
	b, err := c.Acquire(ctx, "invoice-7", &client.LockOptions{TTL: 30 * time.Second, Wait: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Release(context.Background())
	if b.FencingToken() <= a.FencingToken() {
		t.Fatalf("B's token %d is not above A's %d", b.FencingToken(), a.FencingToken())
	}
	if code, v := d.put("invoice-7", b.FencingToken(), "", `{"total":99}`); code != 200 {
		t.Fatalf("B's write = %d %v; want 200", code, v)
	}
	// A wakes up and writes with its old token: refused, nothing changes.
	code, v := d.put("invoice-7", a.FencingToken(), "", `{"total":0}`)
	if code != http.StatusConflict || v["type"] != "urn:redfence:problem:stale-token" || v["current_fencing_token"] != float64(b.FencingToken()) {
		t.Errorf("paused A's write = %d %v; want 409 stale-token with current_fencing_token %d", code, v, b.FencingToken())
	}
	if code, v := d.get("invoice-7"); code != 200 || body(t, v) != `{"total":99}` || v["fencing_token"] != float64(b.FencingToken()) {
		t.Errorf("GET = %d %v; want B's document", code, v)
	}
	// No token at all, or a malformed one: 400 from the middleware.
	if code, v := d.put("invoice-7", 0, "", `{"total":1}`); code != http.StatusBadRequest || v["type"] != "urn:redfence:problem:invalid-request" {
		t.Errorf("write without a token = %d %v; want 400 invalid-request", code, v)
	}
}

// TestPausedHolder_ReadModifyWrite shows the limit of the ">=" rule, and
// its remedy: A's stale write lands if B has not written yet; B's
// read-modify-write with If-Match then detects it instead of silently
// overwriting it.
func TestPausedHolder_ReadModifyWrite(t *testing.T) {
	t.Parallel()
	rf := clienttest.Start(t, clienttest.Options{})
	c, err := client.New(rf.URL, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	d := newDocs(t)
	ctx := t.Context()

	a, err := c.Acquire(ctx, "account-1", &client.LockOptions{TTL: time.Second, NoRenew: true})
	if err != nil {
		t.Fatal(err)
	}
	if code, v := d.put("account-1", a.FencingToken(), "", `{"balance":100}`); code != 200 {
		t.Fatalf("A's first write = %d %v", code, v)
	}
	pause(t, a)
	b, err := c.Acquire(ctx, "account-1", &client.LockOptions{TTL: 30 * time.Second, Wait: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Release(context.Background())
	_, read := d.get("account-1") // B reads version 1
	// A wakes and writes before B: accepted, since nothing newer was applied.
	if code, v := d.put("account-1", a.FencingToken(), "", `{"balance":50}`); code != 200 {
		t.Fatalf("A's late write before B's = %d %v; the >= rule accepts it", code, v)
	}
	// B writes what it computed from its read, conditional on that version.
	ifMatch := fmt.Sprintf(`"%v"`, read["version"])
	if code, v := d.put("account-1", b.FencingToken(), ifMatch, `{"balance":110}`); code != http.StatusPreconditionFailed || v["type"] != "urn:fenced-store:problem:version-changed" {
		t.Fatalf("B's conditional write = %d %v; want 412 version-changed: A's write is detected, not lost", code, v)
	}
	_, read = d.get("account-1") // B reads again (balance 50, version 2) and retries
	if code, v := d.put("account-1", b.FencingToken(), fmt.Sprintf(`"%v"`, read["version"]), `{"balance":60}`); code != 200 {
		t.Fatalf("B's retried write = %d %v; want 200", code, v)
	}
	// From now on A is refused.
	if code, v := d.put("account-1", a.FencingToken(), "", `{"balance":0}`); code != http.StatusConflict {
		t.Errorf("A's write after B's = %d %v; want 409", code, v)
	}
}

// TestUnstorableJSON: valid JSON that jsonb refuses is a 400 (asking again
// cannot help), not a 503, and stores nothing.
func TestUnstorableJSON(t *testing.T) {
	t.Parallel()
	d := newDocs(t)
	for _, body := range []string{`{"a":"\u0000"}`, `{"a":1e1000000}`} {
		if code, v := d.put("unstorable", 5, "", body); code != http.StatusBadRequest {
			t.Errorf("PUT %s = %d %v; want 400", body, code, v)
		}
	}
	if code, v := d.get("unstorable"); code != http.StatusNotFound {
		t.Errorf("GET after the refused writes = %d %v; want 404", code, v)
	}
}

// TestCreateOnly: If-None-Match: * creates a document that does not exist
// and is refused (412) once one does: a read-modify-write that read no
// document is protected like one that read a version.
func TestCreateOnly(t *testing.T) {
	t.Parallel()
	d := newDocs(t)
	// A holder that read 404 (token 33) and a paused one that read 404 too
	// (token 32): the first create wins, the second is refused.
	if code, v := d.put("new", 33, "", `{"a":1}`, "If-None-Match", "*"); code != http.StatusOK || v["version"] != float64(1) {
		t.Fatalf("create-only write of a new document = %d %v; want 200 at version 1", code, v)
	}
	if code, v := d.put("new", 34, "", `{"a":2}`, "If-None-Match", "*"); code != http.StatusPreconditionFailed {
		t.Fatalf("create-only write of an existing document = %d %v; want 412", code, v)
	}
	if code, v := d.put("new", 32, "", `{"a":3}`, "If-None-Match", "*"); code != http.StatusConflict {
		t.Fatalf("create-only write with an older token = %d %v; want 409 stale", code, v)
	}
	for _, hdr := range [][]string{{"If-None-Match", `"1"`}, {"If-Match", "*"}, {"If-Match", `W/"1"`}, {"If-Match", `"1"`, "If-None-Match", "*"}} {
		if code, v := d.put("new", 35, "", `{"a":4}`, hdr...); code != http.StatusBadRequest {
			t.Errorf("PUT with %q = %d %v; want 400", hdr, code, v)
		}
	}
	if code, v := d.get("new"); code != http.StatusOK || body(t, v) != `{"a": 1}` && body(t, v) != `{"a":1}` {
		t.Errorf("GET after the refused writes = %d %v; want the first create", code, v)
	}
}

// TestTooLarge: a body over 1 MiB is refused with 413, not as bad JSON, and
// a token Redfence never issues (above fencing.MaxToken) with 400: either
// way nothing is stored.
func TestTooLarge(t *testing.T) {
	t.Parallel()
	d := newDocs(t)
	if code, v := d.put("big", 5, "", `"`+strings.Repeat("x", 1<<20)+`"`); code != http.StatusRequestEntityTooLarge || v["type"] != "urn:fenced-store:problem:request-too-large" {
		t.Errorf("PUT of a 1 MiB body = %d %v; want 413 request-too-large", code, v)
	}
	if code, v := d.put("big", fencing.MaxToken+1, "", `{}`); code != http.StatusBadRequest {
		t.Errorf("PUT with token MaxToken+1 = %d %v; want 400", code, v)
	}
	if code, v := d.get("big"); code != http.StatusNotFound {
		t.Errorf("GET after the refused writes = %d %v; want 404", code, v)
	}
}

// TestIfMatchOnMissingDocument: a version compare-and-set on a document that
// does not exist is refused (412, RFC 9110) and creates nothing.
func TestIfMatchOnMissingDocument(t *testing.T) {
	t.Parallel()
	d := newDocs(t)
	if code, v := d.put("fresh", 5, `"7"`, `{"a":1}`); code != http.StatusPreconditionFailed {
		t.Fatalf("conditional write of a new document = %d %v; want 412", code, v)
	}
	if code, v := d.get("fresh"); code != http.StatusNotFound {
		t.Fatalf("after a refused conditional write GET = %d %v; want 404", code, v)
	}
	if code, v := d.put("fresh", 5, "", `{"a":1}`); code != http.StatusOK || v["version"] != float64(1) {
		t.Fatalf("unconditional first write = %d %v; want 200 at version 1", code, v)
	}
	if code, v := d.put("fresh", 5, `"1"`, `{"a":2}`); code != http.StatusOK || v["version"] != float64(2) {
		t.Fatalf("conditional write at the current version = %d %v; want 200 at version 2", code, v)
	}
}

// TestRun_Help: -h prints the usage and succeeds, as README's "Try it"
// reader expects; it used to end with "fenced-store: flag: help requested"
// and exit status 1. It starts nothing (no Postgres).
func TestRun_Help(t *testing.T) {
	t.Parallel()
	var stderr bytes.Buffer
	if err := run(t.Context(), []string{"-h"}, io.Discard, &stderr); err != nil {
		t.Fatalf("run -h = %v; want nil", err)
	}
	if !strings.Contains(stderr.String(), "-database-url") {
		t.Errorf("run -h printed %q; want the usage", stderr.String())
	}
}
