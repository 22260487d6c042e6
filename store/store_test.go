package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/cluster/clustertest"
	"github.com/redfence/redfence/internal/refstore"
	"github.com/redfence/redfence/internal/testutil"
	"github.com/redfence/redfence/migrations"
)

// waitTimeout bounds every wait for an observable condition.
const waitTimeout = 30 * time.Second

// holdConns takes n connections of pool at once (each a session of its
// own), released when t ends.
func holdConns(t *testing.T, pool *pgxpool.Pool, n int) []*pgxpool.Conn {
	t.Helper()
	held := make([]*pgxpool.Conn, 0, n)
	t.Cleanup(func() {
		for _, c := range held {
			c.Release()
		}
	})
	for range n {
		c, err := pool.Acquire(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	return held
}

// open opens url with opts and closes the DB in t.Cleanup.
func open(t testing.TB, url string, opts Options) *DB {
	t.Helper()
	db, err := Open(t.Context(), url, opts)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(db.Close)
	return db
}

// newDB returns a migrated DB on a fresh database, and the database URL.
func newDB(t testing.TB, opts Options) (*DB, string) {
	t.Helper()
	url := clustertest.Database(t)
	db := open(t, url, opts)
	if _, err := db.Migrate(t.Context()); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	return db, url
}

// connect opens a plain connection (not through the store) for setting up
// and observing, closed in t.Cleanup.
func connect(t testing.TB, url string) *pgx.Conn {
	t.Helper()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["application_name"] = "store_test"
	conn, err := pgx.ConnectConfig(t.Context(), cfg)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// migrationFiles returns the names of the embedded migrations.
func migrationFiles(t testing.TB) []string {
	t.Helper()
	names, err := fs.Glob(migrations.FS, "*.sql")
	if err != nil || len(names) == 0 {
		t.Fatalf("embedded migrations = %v, %v; want at least one", names, err)
	}
	return names
}

// migrateUpTo applies db's migrations up to version only, as an older
// build left the database.
func migrateUpTo(t testing.TB, db *DB, version int64) {
	t.Helper()
	sqlDB := stdlib.OpenDBFromPool(db.pool)
	t.Cleanup(func() { _ = sqlDB.Close() })
	p, err := goose.NewProvider(goose.DialectPostgres, sqlDB, migrations.FS,
		goose.WithTableName(migrationsTable), goose.WithDisableGlobalRegistry(true))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(t.Context(), version); err != nil {
		t.Fatal(err)
	}
}

// issue issues a token for key and fails the test on error.
func issue(t testing.TB, db *DB, key string) fencing.Token {
	t.Helper()
	tok, err := db.Issue(t.Context(), fencing.Claim{Key: key})
	if err != nil {
		t.Fatalf("Issue(%q): %v", key, err)
	}
	return tok
}

// blockedBy counts the backends that wait for a lock held by the backend
// with the given pid.
func blockedBy(ctx context.Context, conn *pgx.Conn, pid uint32) (int, error) {
	var n int
	err := conn.QueryRow(ctx,
		`SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))`, int64(pid)).Scan(&n)
	return n, err
}

func TestDB_Migrate(t *testing.T) {
	t.Parallel()
	files := migrationFiles(t)

	t.Run("Idempotent", func(t *testing.T) {
		t.Parallel()
		db := open(t, clustertest.Database(t), Options{})
		applied, err := db.Migrate(t.Context())
		if err != nil {
			t.Fatalf("first Migrate: %v", err)
		}
		if !slices.Equal(applied, files) {
			t.Errorf("first Migrate applied %v; want %v", applied, files)
		}
		applied, err = db.Migrate(t.Context())
		if err != nil {
			t.Fatalf("second Migrate: %v", err)
		}
		if len(applied) != 0 {
			t.Errorf("second Migrate applied %v; want nothing", applied)
		}
	})

	t.Run("DocumentsKept", func(t *testing.T) {
		// Documents written while they were jsonb (before 00007) read
		// back, by value, once they are json; and a pooled connection that
		// prepared the documents' statements before the migration (an
		// already running server) serves them after it.
		t.Parallel()
		url := clustertest.Database(t)
		db := open(t, url, Options{DocMaxConns: 1})
		migrateUpTo(t, db, 6)
		const doc = `{"b":[1,2.50,null],"a":{"s":"\u00e9"},"n":-12}`
		if _, err := db.pool.Exec(t.Context(), `INSERT INTO redfence_fencing (key, token) VALUES ('k', 3);
INSERT INTO redfence_resources (key, data, fencing_token, version) VALUES ('k', '`+doc+`', 3, 2)`); err != nil {
			t.Fatal(err)
		}
		tok := issue(t, db, "prepared")
		put(t, db, "prepared", tok, `{"v":1}`) // prepared while data was jsonb
		wantResource(t, db, "prepared", `{"v":1}`, tok, 1)
		if _, err := db.Migrate(t.Context()); err != nil {
			t.Fatal(err)
		}
		wantResource(t, db, "prepared", `{"v":1}`, tok, 1)
		put(t, db, "prepared", tok, `{"v":2}`)
		wantResource(t, db, "k", doc, 3, 2)
		put(t, db, "k", 3, `{"b":1e2}`)
		wantResource(t, db, "k", `{"b":1e2}`, 3, 3)
	})

	t.Run("LongRewrite", func(t *testing.T) {
		// 00007 rewrites the documents' table: it runs as long as that
		// takes, not cut short by the pool's statement timeout. Here the
		// rewrite waits for a reader's lock until it has run longer than
		// that timeout (1 s), and within its own lock timeout (5 s).
		t.Parallel()
		ctx := t.Context()
		url := clustertest.Database(t)
		setup := open(t, url, Options{})
		migrateUpTo(t, setup, 6)
		reader, err := pgx.Connect(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { reader.Close(context.Background()) })
		tx, err := reader.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `SELECT count(*) FROM redfence_resources`); err != nil { // a lock the rewrite waits for
			t.Fatal(err)
		}
		watch, err := pgx.Connect(ctx, url) // outside any transaction: pg_stat_activity is read afresh
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { watch.Close(context.Background()) })
		db := open(t, url, Options{StatementTimeout: time.Second})
		migrated := make(chan error, 1)
		go func() {
			_, err := db.Migrate(ctx)
			migrated <- err
		}()
		testutil.WaitFor(t, time.Minute, "the rewrite running past the statement timeout", func() (bool, error) {
			select {
			case err := <-migrated:
				t.Fatalf("Migrate ended while the rewrite waited for the table: %v", err)
			default:
			}
			var n int
			err := watch.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND query LIKE '%ALTER TABLE redfence_resources%'
  AND state = 'active' AND now() - query_start > interval '1500 milliseconds'`).Scan(&n)
			return n > 0, err
		})
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		if err := <-migrated; err != nil {
			t.Fatalf("Migrate with a 1 s statement timeout, its rewrite running longer: %v", err)
		}
		var typ string
		if err := db.pool.QueryRow(ctx, `SELECT data_type FROM information_schema.columns
WHERE table_name = 'redfence_resources' AND column_name = 'data'`).Scan(&typ); err != nil || typ != "json" {
			t.Fatalf("data column type = %q, %v; want json", typ, err)
		}
	})

	t.Run("Concurrent", func(t *testing.T) {
		t.Parallel()
		const n = 4
		url := clustertest.Database(t)
		dbs := make([]*DB, n)
		for i := range dbs {
			dbs[i] = open(t, url, Options{})
		}
		start := make(chan struct{})
		applied := make([][]string, n)
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i, db := range dbs {
			wg.Go(func() {
				<-start
				applied[i], errs[i] = db.Migrate(t.Context())
			})
		}
		close(start)
		wg.Wait()
		var all []string
		for i := range n {
			if errs[i] != nil {
				t.Errorf("Migrate #%d: %v", i, errs[i])
			}
			all = append(all, applied[i]...)
		}
		slices.Sort(all)
		if !slices.Equal(all, files) {
			t.Errorf("%d concurrent Migrate calls applied %v in all; want each of %v once", n, all, files)
		}

		conn := connect(t, url)
		var tables int
		if err := conn.QueryRow(t.Context(), `
SELECT count(*) FROM pg_tables
 WHERE tablename IN ('redfence_fencing', 'redfence_resources')`).Scan(&tables); err != nil {
			t.Fatal(err)
		}
		if tables != 2 {
			t.Errorf("redfence tables = %d; want 2", tables)
		}
		var recorded int
		if err := conn.QueryRow(t.Context(),
			`SELECT count(*) FROM redfence_schema_migrations WHERE version_id > 0 AND is_applied`).Scan(&recorded); err != nil {
			t.Fatal(err)
		}
		if recorded != len(files) {
			t.Errorf("recorded migrations = %d; want %d", recorded, len(files))
		}
		// The schema works.
		if tok := issue(t, dbs[n-1], "k"); tok != 1 {
			t.Errorf("Issue after concurrent migrations = %d; want 1", tok)
		}
	})
}

// TestDB_Migrate_PostgresGone: a Migrate waiting for another process's
// migrations (the advisory lock held elsewhere) whose Postgres goes away
// meanwhile (a restart terminates its session) fails with ErrUnavailable,
// as every other statement of a Postgres gone does, so that a server
// starting waits for it (cmd's OpenWaiting) instead of exiting. Before,
// its error was goose's, unclassified, and the server exited.
func TestDB_Migrate_PostgresGone(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	url := clustertest.Database(t)
	db := open(t, url, Options{})
	admin := connect(t, url)
	if _, err := admin.Exec(ctx, "SELECT pg_advisory_lock($1)", int64(migrationLockID)); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := db.Migrate(ctx)
		done <- err
	}()
	testutil.WaitFor(t, waitTimeout, "Migrate to wait for the advisory lock", func() (bool, error) {
		var n int
		err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = 'redfence' AND query LIKE '%pg_try_advisory_lock%'`).Scan(&n)
		return n > 0, err
	})
	if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE datname = current_database() AND application_name = 'redfence'`); err != nil {
		t.Fatal(err)
	}
	err := <-done
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Migrate whose session was terminated = %v; want an error matching ErrUnavailable", err)
	}
}

func TestDB_Issue(t *testing.T) {
	t.Parallel()
	db, _ := newDB(t, Options{})

	t.Run("SequencePerKey", func(t *testing.T) {
		t.Parallel()
		a, b := t.Name()+"/a", t.Name()+"/b"
		for _, step := range []struct {
			key  string
			want fencing.Token
		}{
			{a, 1}, {a, 2}, {b, 1}, {a, 3}, {b, 2}, {b, 3}, {a, 4},
		} {
			if got := issue(t, db, step.key); got != step.want {
				t.Errorf("Issue(%q) = %d; want %d", step.key, got, step.want)
			}
		}
	})

	t.Run("Concurrent", func(t *testing.T) {
		t.Parallel()
		const n = 200
		key := t.Name()
		tokens := make([]fencing.Token, n)
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				tokens[i], errs[i] = db.Issue(t.Context(), fencing.Claim{Key: key})
			})
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatalf("concurrent Issue: %v", err)
		}
		slices.Sort(tokens)
		for i, tok := range tokens {
			if tok != fencing.Token(i+1) {
				t.Fatalf("sorted tokens[%d] = %d; want %d (tokens: %v)", i, tok, i+1, tokens)
			}
		}
		last, err := db.Last(t.Context(), key)
		if err != nil {
			t.Fatal(err)
		}
		if last.Token != n {
			t.Errorf("Last(%q).Token = %d; want %d", key, last.Token, n)
		}
	})

	t.Run("Last", func(t *testing.T) {
		t.Parallel()
		key := t.Name()
		if _, err := db.Issue(t.Context(), fencing.Claim{Key: key, Owner: "alice", Holder: "h-alice"}); err != nil {
			t.Fatal(err)
		}
		tok, err := db.Issue(t.Context(), fencing.Claim{Key: key, Owner: "bob", Holder: "h-bob"})
		if err != nil {
			t.Fatal(err)
		}
		got, err := db.Last(t.Context(), key)
		if err != nil {
			t.Fatalf("Last(%q): %v", key, err)
		}
		want := fencing.Record{Claim: fencing.Claim{Key: key, Owner: "bob", Holder: "h-bob"}, Token: tok}
		if got.IssuedAt.IsZero() {
			t.Errorf("Last(%q).IssuedAt is zero; want the issue time", key)
		}
		got.IssuedAt = time.Time{}
		if got != want {
			t.Errorf("Last(%q) = %+v; want %+v", key, got, want)
		}
	})

	t.Run("LastUnknown", func(t *testing.T) {
		t.Parallel()
		key := t.Name()
		got, err := db.Last(t.Context(), key)
		if err != nil {
			t.Fatalf("Last(%q): %v", key, err)
		}
		if want := (fencing.Record{Claim: fencing.Claim{Key: key}}); got != want {
			t.Errorf("Last(%q) = %+v; want %+v", key, got, want)
		}
	})
}

// wantStale checks that err is a *fencing.StaleError for key with the given tokens
// that matches fencing.ErrStale.
func wantStale(t testing.TB, err error, key string, got, current fencing.Token) {
	t.Helper()
	var se *fencing.StaleError
	if !errors.As(err, &se) {
		t.Fatalf("PutResource(%q, %d) error = %v; want a *fencing.StaleError", key, got, err)
	}
	if !errors.Is(err, fencing.ErrStale) {
		t.Errorf("errors.Is(%v, fencing.ErrStale) = false; want true", err)
	}
	want := fencing.StaleError{Key: key, Got: got, Current: current}
	if *se != want {
		t.Errorf("fencing.StaleError = %+v; want %+v", *se, want)
	}
}

// put writes data and fails the test on error.
func put(t testing.TB, db *DB, key string, tok fencing.Token, data string) *Resource {
	t.Helper()
	r, err := db.PutResource(t.Context(), key, tok, json.RawMessage(data))
	if err != nil {
		t.Fatalf("PutResource(%q, %d, %s): %v", key, tok, data, err)
	}
	return r
}

// wantResource checks the stored document under key.
func wantResource(t testing.TB, db *DB, key string, data string, tok fencing.Token, version int64) {
	t.Helper()
	r, err := db.GetResource(t.Context(), key)
	if err != nil {
		t.Fatalf("GetResource(%q): %v", key, err)
	}
	if !jsonEqual(t, r.Data, json.RawMessage(data)) || r.FencingToken != tok || r.Version != version {
		t.Errorf("GetResource(%q) = data %s, token %d, version %d; want %s, %d, %d",
			key, r.Data, r.FencingToken, r.Version, data, tok, version)
	}
}

// jsonEqual compares two JSON texts by value.
func jsonEqual(t testing.TB, a, b json.RawMessage) bool {
	t.Helper()
	var va, vb any
	if err := json.Unmarshal(a, &va); err != nil {
		t.Errorf("invalid JSON %q: %v", a, err)
		return false
	}
	if err := json.Unmarshal(b, &vb); err != nil {
		t.Errorf("invalid JSON %q: %v", b, err)
		return false
	}
	return reflect.DeepEqual(va, vb)
}

func TestDB_PutResource(t *testing.T) {
	t.Parallel()
	db, _ := newDB(t, Options{})

	t.Run("Unissued", func(t *testing.T) {
		t.Parallel()
		key := t.Name()
		_, err := db.PutResource(t.Context(), key, 1, json.RawMessage(`{"a":1}`))
		wantStale(t, err, key, 1, 0)
		if _, err := db.GetResource(t.Context(), key); !errors.Is(err, ErrNotFound) {
			t.Errorf("GetResource after refused write: %v; want ErrNotFound", err)
		}
	})

	t.Run("NewestAcceptedRepeatedly", func(t *testing.T) {
		t.Parallel()
		key := t.Name()
		tok := issue(t, db, key)
		for i := range int64(3) {
			data := fmt.Sprintf(`{"n":%d}`, i)
			r := put(t, db, key, tok, data)
			if r.Key != key || r.FencingToken != tok || r.Version != i+1 || !jsonEqual(t, r.Data, json.RawMessage(data)) {
				t.Errorf("PutResource #%d = %+v; want key %q, token %d, version %d, data %s", i, r, key, tok, i+1, data)
			}
			if r.UpdatedAt.IsZero() {
				t.Errorf("PutResource #%d UpdatedAt is zero", i)
			}
		}
		wantResource(t, db, key, `{"n":2}`, tok, 3)
	})

	t.Run("Older", func(t *testing.T) {
		t.Parallel()
		key := t.Name()
		old := issue(t, db, key)
		put(t, db, key, old, `"by old"`)
		newest := issue(t, db, key)
		_, err := db.PutResource(t.Context(), key, old, json.RawMessage(`"stale"`))
		wantStale(t, err, key, old, newest)
		wantResource(t, db, key, `"by old"`, old, 1)
		put(t, db, key, newest, `"by newest"`)
		wantResource(t, db, key, `"by newest"`, newest, 2)
	})

	t.Run("NeverIssued", func(t *testing.T) {
		t.Parallel()
		key := t.Name()
		newest := issue(t, db, key)
		_, err := db.PutResource(t.Context(), key, newest+1, json.RawMessage(`1`))
		wantStale(t, err, key, newest+1, newest)
		if _, err := db.GetResource(t.Context(), key); !errors.Is(err, ErrNotFound) {
			t.Errorf("GetResource after refused write: %v; want ErrNotFound", err)
		}
	})

	t.Run("GetMissing", func(t *testing.T) {
		t.Parallel()
		r, err := db.GetResource(t.Context(), t.Name())
		if !errors.Is(err, ErrNotFound) {
			t.Errorf("GetResource(missing) = %+v, %v; want ErrNotFound", r, err)
		}
	})

	t.Run("InvalidData", func(t *testing.T) {
		t.Parallel()
		// Valid JSON (for encoding/json) that its readers cannot read
		// (Postgres's JSON functions, Unicode text, a double): refused
		// before Postgres is asked, with a *refstore.DataError.
		for _, tc := range []struct {
			name, data string
			checked    bool
		}{
			{"Nul", `"nul \u0000 inside"`, true},
			{"NotUTF8", "\"\xff\xfe\"", true},
			{"LoneHigh", `["\ud800"]`, true},
			{"HighThenOther", `"\ud800\u0041"`, true},
			{"LoneLow", `{"k":"\udc00"}`, true},
			{"NumberOverflow", `1e1000000`, true},
			{"DoubleOverflow", `{"n":-1e309}`, true},
		} {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				key := t.Name()
				tok := issue(t, db, key)
				_, err := db.PutResource(t.Context(), key, tok, json.RawMessage(tc.data))
				if !errors.Is(err, ErrInvalidData) || errors.Is(err, ErrUnavailable) {
					t.Errorf("PutResource(%q) = %v; want ErrInvalidData only", tc.data, err)
				}
				var de *refstore.DataError
				if errors.As(err, &de) != tc.checked {
					t.Errorf("PutResource(%q) = %v; want a *refstore.DataError: %v", tc.data, err, tc.checked)
				}
				if _, err := db.GetResource(t.Context(), key); !errors.Is(err, ErrNotFound) {
					t.Errorf("GetResource after the refused write: %v; want ErrNotFound", err)
				}
			})
		}
	})

	t.Run("AsSent", func(t *testing.T) {
		t.Parallel()
		// A document reads back as it was written, without its
		// insignificant whitespace: numbers in their form, keys in their
		// order, repeated keys kept. A number that needs many digits in
		// full (1e-16383, 0.000…1) is not written out in full either (jsonb
		// printed it so: 9 bytes read back as 16 KiB).
		for _, tc := range []struct{ name, data, want string }{
			{"Numbers", "[ -0, 1e2, 1.50, 1E+2, 12.5e-3, 0.0 ]", "[-0,1e2,1.50,1E+2,12.5e-3,0.0]"},
			{"Tiny", `{"n": 1e-16383}`, `{"n":1e-16383}`},
			{"LongScale", "0." + strings.Repeat("0", 20000) + "1", "0." + strings.Repeat("0", 20000) + "1"},
			{"KeyOrder", "{\"b\": 1,\n \"a\": {\"z\": [], \"y\": null}}", `{"b":1,"a":{"z":[],"y":null}}`},
			{"RepeatedKey", `{"a":1,"a":2}`, `{"a":1,"a":2}`},
			{"StringsKept", `" a  b \u0041 \/ "`, `" a  b \u0041 \/ "`},
		} {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				key := t.Name()
				tok := issue(t, db, key)
				if r := put(t, db, key, tok, tc.data); string(r.Data) != tc.want {
					t.Errorf("PutResource data = %.80s; want %.80s", r.Data, tc.want)
				}
				r, err := db.GetResource(t.Context(), key)
				if err != nil {
					t.Fatal(err)
				}
				if string(r.Data) != tc.want {
					t.Errorf("GetResource data = %.80s (%d bytes); want %.80s (%d bytes)", r.Data, len(r.Data), tc.want, len(tc.want))
				}
			})
		}
	})

	t.Run("JSONKinds", func(t *testing.T) {
		t.Parallel()
		for _, tc := range []struct{ name, data string }{
			{"Object", `{"b":[1,2],"a":{"x":null},"u":"\u00e9"}`},
			{"EmptyObject", `{}`},
			{"Array", `[1,"two",{"three":3},[],null]`},
			{"String", `"hello, \"world\""`},
			{"SurrogatePair", `"\ud83d\ude00"`},
			{"EscapedBackslash", `"\\u0000 is text here"`},
			{"Number", `-12.5e3`},
			{"Integer", `42`},
			{"True", `true`},
			{"False", `false`},
			{"Null", `null`},
		} {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				key := t.Name()
				tok := issue(t, db, key)
				r := put(t, db, key, tok, tc.data)
				if !jsonEqual(t, r.Data, json.RawMessage(tc.data)) {
					t.Errorf("PutResource data = %s; want %s", r.Data, tc.data)
				}
				wantResource(t, db, key, tc.data, tok, 1)
			})
		}
	})
}

// TestDB_DocumentsOwnPool: the reference store has a pool of its own, so
// document writes that hold every connection of it (here one, stuck behind
// a row lock an outside transaction holds) leave the locks' pool free:
// tokens are still issued and fencing records read. With one pool of one
// connection the issuance would wait for the stuck write.
func TestDB_DocumentsOwnPool(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{MaxConns: 1, DocMaxConns: 1, StatementTimeout: 5 * time.Minute})
	const key = "doc"
	tok := issue(t, db, key)
	conn := connect(t, url)
	tx, err := conn.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	if _, err := tx.Exec(t.Context(), `SELECT 1 FROM redfence_fencing WHERE key = $1 FOR UPDATE`, key); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := db.PutResource(t.Context(), key, tok, json.RawMessage(`"stuck"`))
		done <- err
	}()
	obs := connect(t, url)
	testutil.WaitFor(t, waitTimeout, "the write to wait on the row lock", func() (bool, error) {
		n, err := blockedBy(t.Context(), obs, conn.PgConn().PID())
		return n > 0, err
	})
	// The documents' only connection is taken; the locks' pool serves.
	ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
	defer cancel()
	other, err := db.Issue(ctx, fencing.Claim{Key: "other"})
	if err != nil || other != 1 {
		t.Fatalf("Issue while the documents' pool is taken = %d, %v; want 1", other, err)
	}
	if last, err := db.Last(ctx, key); err != nil || last.Token != tok {
		t.Fatalf("Last while the documents' pool is taken = %+v, %v; want token %d", last, err, tok)
	}
	if err := tx.Rollback(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("the write, once the row was free: %v", err)
	}
}

// TestDB_PutResource_Race closes the lost-update window deterministically: a
// write and an issuance for the same key are made to overlap by holding one
// of them open in a transaction until the other is seen waiting on its lock.
func TestDB_PutResource_Race(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{})

	t.Run("IssueBeforeWrite", func(t *testing.T) {
		t.Parallel()
		key := t.Name()
		old := issue(t, db, key)
		conn := connect(t, url)
		tx, err := conn.Begin(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(context.Background())
		var newest fencing.Token
		if err := tx.QueryRow(t.Context(), issueSQL, key, "next", "h-next", time.Minute.Microseconds()).Scan(&newest); err != nil {
			t.Fatal(err)
		}

		type result struct {
			r   *Resource
			err error
		}
		done := make(chan result, 1)
		go func() {
			r, err := db.PutResource(t.Context(), key, old, json.RawMessage(`"from the paused holder"`))
			done <- result{r, err}
		}()
		obs := connect(t, url)
		testutil.WaitFor(t, waitTimeout, "the write to wait on the token row lock", func() (bool, error) {
			select {
			case res := <-done:
				if res.err != nil {
					return false, fmt.Errorf("PutResource returned %v while the issuance was uncommitted; want it to wait", res.err)
				}
				return false, fmt.Errorf("PutResource stored %s with token %d while the issuance was uncommitted; want it to wait", res.r.Data, res.r.FencingToken)
			default:
			}
			n, err := blockedBy(t.Context(), obs, conn.PgConn().PID())
			return n > 0, err
		})
		if err := tx.Commit(t.Context()); err != nil {
			t.Fatal(err)
		}
		res := <-done
		wantStale(t, res.err, key, old, newest)
		if _, err := db.GetResource(t.Context(), key); !errors.Is(err, ErrNotFound) {
			t.Errorf("GetResource after the refused write: %v; want ErrNotFound", err)
		}
	})

	t.Run("WriteBeforeIssue", func(t *testing.T) {
		t.Parallel()
		key := t.Name()
		old := issue(t, db, key)
		conn := connect(t, url)
		tx, err := conn.Begin(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(context.Background())
		if _, err := tx.Exec(t.Context(), putSQL, key, int64(old), []byte(`"written first"`), false, nil, false, nil); err != nil {
			t.Fatal(err)
		}

		type result struct {
			tok fencing.Token
			err error
		}
		done := make(chan result, 1)
		go func() {
			tok, err := db.Issue(t.Context(), fencing.Claim{Key: key})
			done <- result{tok, err}
		}()
		obs := connect(t, url)
		testutil.WaitFor(t, waitTimeout, "the issuance to wait on the writer's row lock", func() (bool, error) {
			select {
			case res := <-done:
				return false, fmt.Errorf("Issue returned %d, %v while a write was uncommitted; want it to wait", res.tok, res.err)
			default:
			}
			n, err := blockedBy(t.Context(), obs, conn.PgConn().PID())
			return n > 0, err
		})
		if err := tx.Commit(t.Context()); err != nil {
			t.Fatal(err)
		}
		res := <-done
		if res.err != nil || res.tok != old+1 {
			t.Fatalf("Issue = %d, %v; want %d", res.tok, res.err, old+1)
		}
		wantResource(t, db, key, `"written first"`, old, 1)
		_, err = db.PutResource(t.Context(), key, old, json.RawMessage(`"late"`))
		wantStale(t, err, key, old, res.tok)
	})
}

func TestDB_Unfenced(t *testing.T) {
	t.Parallel()
	url := clustertest.Database(t)
	fenced := open(t, url, Options{})
	if _, err := fenced.Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}
	unfenced := open(t, url, Options{Unfenced: true})

	for _, tc := range []struct {
		name      string
		db        *DB
		wantStale bool
	}{
		{"Fenced", fenced, true},
		{"Unfenced", unfenced, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			key := t.Name()
			old := issue(t, tc.db, key)
			newest := issue(t, tc.db, key)
			_, err := tc.db.PutResource(t.Context(), key, old, json.RawMessage(`"stale"`))
			if tc.wantStale {
				wantStale(t, err, key, old, newest)
				return
			}
			if err != nil {
				t.Fatalf("unfenced PutResource(%q, %d) = %v; want the stale write accepted", key, old, err)
			}
			wantResource(t, tc.db, key, `"stale"`, old, 1)
		})
	}
}

func TestDB_PostgresRestart(t *testing.T) {
	t.Parallel()
	pg := clustertest.Postgres(t)
	url, err := pg.CreateDatabase(t.Context(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	db := open(t, url, Options{})
	if _, err := db.Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}
	const key = "k"
	var before fencing.Token
	for range 5 {
		before = issue(t, db, key)
	}

	if err := pg.Stop(t.Context(), true); err != nil {
		t.Fatal(err)
	}

	// Each call must fail rather than hang: the context deadline is the bound,
	// and a call that outlives it by far is reported as a hang.
	const callTimeout = 10 * time.Second
	for _, tc := range []struct {
		name string
		call func(ctx context.Context) error
	}{
		{"Issue", func(ctx context.Context) error {
			tok, err := db.Issue(ctx, fencing.Claim{Key: key})
			if !errors.Is(err, ErrUnavailable) {
				return fmt.Errorf("got %d, %v; want ErrUnavailable", tok, err)
			}
			return nil
		}},
		{"Ping", func(ctx context.Context) error {
			if db.Ping(ctx) == nil {
				return errors.New("got nil; want an error")
			}
			return nil
		}},
		{"PutResource", func(ctx context.Context) error {
			_, err := db.PutResource(ctx, key, before, json.RawMessage(`1`))
			if !errors.Is(err, ErrUnavailable) {
				return fmt.Errorf("got %v; want ErrUnavailable", err)
			}
			return nil
		}},
		{"GetResource", func(ctx context.Context) error {
			_, err := db.GetResource(ctx, key)
			if !errors.Is(err, ErrUnavailable) {
				return fmt.Errorf("got %v; want ErrUnavailable", err)
			}
			return nil
		}},
		{"Last", func(ctx context.Context) error {
			if _, err := db.Last(ctx, key); err == nil {
				return errors.New("got nil; want an error")
			}
			return nil
		}},
	} {
		ctx, cancel := context.WithTimeout(t.Context(), callTimeout)
		done := make(chan error, 1)
		go func() { done <- tc.call(ctx) }()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("%s on a stopped Postgres: %v", tc.name, err)
			}
		case <-time.After(callTimeout + waitTimeout):
			t.Fatalf("%s on a stopped Postgres did not return %v after its context ended", tc.name, waitTimeout)
		}
		cancel()
	}

	if err := pg.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	// Connections of the pool died with the server; the pool replaces them
	// as they fail. Poll until an issuance succeeds.
	var after fencing.Token
	testutil.WaitFor(t, waitTimeout, "Issue to succeed after the restart", func() (bool, error) {
		tok, err := db.Issue(t.Context(), fencing.Claim{Key: key})
		if err != nil {
			t.Logf("Issue after restart: %v", err)
			return false, nil
		}
		after = tok
		return true, nil
	})
	if after <= before {
		t.Errorf("Issue after restart = %d; want above %d, the last token issued before", after, before)
	}
	if err := db.Ping(t.Context()); err != nil {
		t.Errorf("Ping after restart: %v", err)
	}
}

func TestOpen_RedactsPassword(t *testing.T) {
	t.Parallel()
	const secret = "s3cr3t-Pa55w0rd"
	// A loopback port nobody listens on.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closedPort := ln.Addr().(*net.TCPAddr).Port
	ln.Close()

	for _, tc := range []struct{ name, url string }{
		{"BadPort", "postgres://user:" + secret + "@localhost:notaport/db"},
		{"BadEscape", "postgres://user:" + secret + "%zz@localhost/db"},
		{"BadSSLMode", "postgres://user:" + secret + "@localhost/db?sslmode=bogus"},
		{"BadPoolParam", "postgres://user:" + secret + "@localhost/db?pool_max_conns=many"},
		{"BadDSN", "host=localhost user=user password=" + secret + " port=notaport"},
		{"Unreachable", fmt.Sprintf("postgres://user:%s@127.0.0.1:%d/db?sslmode=disable&connect_timeout=5", secret, closedPort)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			db, err := Open(ctx, tc.url, Options{})
			if err == nil {
				db.Close()
				t.Fatalf("Open(%q) succeeded; want an error", tc.url)
			}
			if strings.Contains(err.Error(), secret) {
				t.Errorf("Open error = %q; want it without the password", err)
			}
		})
	}
}

// TestOpen_SilentServer: a server that accepts connections but never
// answers fails Open at the connect timeout instead of hanging it.
func TestOpen_SilentServer(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() }) // held open, never answered
		}
	}()
	url := "postgres://redfence@" + ln.Addr().String() + "/redfence?sslmode=disable"
	db, err := Open(context.Background(), url, Options{ConnectTimeout: 100 * time.Millisecond})
	if err == nil {
		db.Close()
		t.Fatal("Open against a silent server succeeded")
	}
	if !errors.Is(err, context.DeadlineExceeded) && !strings.Contains(err.Error(), "timeout") {
		t.Errorf("Open against a silent server = %v; want a timeout", err)
	}
}

func TestOpen_SynchronousCommit(t *testing.T) {
	t.Parallel()
	url := clustertest.Database(t)
	admin := connect(t, url)
	var dbName string
	if err := admin.QueryRow(t.Context(), "SELECT current_database()").Scan(&dbName); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(t.Context(),
		"ALTER DATABASE "+pgx.Identifier{dbName}.Sanitize()+" SET synchronous_commit = off"); err != nil {
		t.Fatal(err)
	}
	// Control: a plain new session gets the database default.
	var sc string
	if err := connect(t, url).QueryRow(t.Context(), "SHOW synchronous_commit").Scan(&sc); err != nil {
		t.Fatal(err)
	}
	if sc != "off" {
		t.Fatalf("synchronous_commit of a plain session = %q; want off (the ALTER DATABASE did not apply)", sc)
	}

	const conns = 3
	db := open(t, url, Options{MaxConns: conns})
	// Hold every connection of the pool at once so each one is checked.
	held := holdConns(t, db.pool, conns)
	for i, c := range held {
		if err := c.QueryRow(t.Context(), "SHOW synchronous_commit").Scan(&sc); err != nil {
			t.Fatal(err)
		}
		if sc != "on" {
			t.Errorf("pool connection %d: synchronous_commit = %q; want on", i, sc)
		}
	}
	// A transaction left idle ends: after the statement timeout on the
	// locks' pool, after docIdleInTx on the documents' (their writes hold
	// their name's token row).
	for _, tc := range []struct {
		pool *pgxpool.Pool
		want string
	}{{db.docs, "500ms"}, {db.pool, "5s"}} {
		var v string
		if tc.pool == db.pool {
			err := held[0].QueryRow(t.Context(), "SHOW idle_in_transaction_session_timeout").Scan(&v)
			if err != nil {
				t.Fatal(err)
			}
		} else if err := tc.pool.QueryRow(t.Context(), "SHOW idle_in_transaction_session_timeout").Scan(&v); err != nil {
			t.Fatal(err)
		}
		if v != tc.want {
			t.Errorf("idle_in_transaction_session_timeout = %q; want %q", v, tc.want)
		}
	}
	// The sessions where claims set aside wait for a held row issue tokens
	// too: durably, and with a statement timeout of at least the issue
	// timeout (the default, 10 s), which bounds their wait.
	var sync, stmt, idle string
	if err := db.waits.QueryRow(t.Context(), `SELECT current_setting('synchronous_commit'),
		current_setting('statement_timeout'), current_setting('idle_in_transaction_session_timeout')`).Scan(&sync, &stmt, &idle); err != nil {
		t.Fatal(err)
	}
	if sync != "on" || stmt != "10s" || idle != "5s" {
		t.Errorf("held-row pool: synchronous_commit %q, statement_timeout %q, idle_in_transaction_session_timeout %q; want on, 10s, 5s", sync, stmt, idle)
	}
}

// TestOpen_SynchronousCommitSurvivesReload: a reload of the server's
// configuration that turns synchronous_commit off reaches every live session
// still on the server default; the pool's sessions set it themselves, so
// they keep waiting for the WAL flush.
func TestOpen_SynchronousCommitSurvivesReload(t *testing.T) {
	t.Parallel()
	// A server of its own: ALTER SYSTEM would reach every test's sessions.
	pg := clustertest.Postgres(t)
	url := pg.URL()
	const conns = 2
	db := open(t, url, Options{MaxConns: conns})
	held := holdConns(t, db.pool, conns)
	control := connect(t, url) // a plain session on the server default
	admin := connect(t, url)
	if _, err := admin.Exec(t.Context(), "ALTER SYSTEM SET synchronous_commit = off"); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(t.Context(), "SELECT pg_reload_conf()"); err != nil {
		t.Fatal(err)
	}
	// The postmaster signals every session at once: once the control
	// session runs with off, so would the pool's on the default.
	var sc string
	testutil.WaitFor(t, 30*time.Second, "the reload to reach a live session", func() (bool, error) {
		err := control.QueryRow(t.Context(), "SHOW synchronous_commit").Scan(&sc)
		return sc == "off", err
	})
	for i, c := range held {
		if err := c.QueryRow(t.Context(), "SHOW synchronous_commit").Scan(&sc); err != nil {
			t.Fatal(err)
		}
		if sc != "on" {
			t.Errorf("pool connection %d after the reload: synchronous_commit = %q; want on", i, sc)
		}
	}
}

// TestDB_TerminatedConnections: backends terminated while their connections
// sat in the pools (pg_terminate_backend, a fast restart) cost no call an
// error: each statement is sent again on a live connection, since Postgres
// ran none of them.
func TestDB_TerminatedConnections(t *testing.T) {
	t.Parallel()
	db, url := newDB(t, Options{MaxConns: 2, DocMaxConns: 2})
	ctx := t.Context()
	tok := issue(t, db, "k")
	put(t, db, "k", tok, `{"v":1}`)
	if _, err := db.Last(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	admin := connect(t, url)
	var dbName string
	if err := admin.QueryRow(ctx, "SELECT current_database()").Scan(&dbName); err != nil {
		t.Fatal(err)
	}
	terminate := func() {
		t.Helper()
		if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE datname = $1 AND application_name = 'redfence'`, dbName); err != nil {
			t.Fatal(err)
		}
		testutil.WaitFor(t, waitTimeout, "the backends to exit", func() (bool, error) {
			var n int
			err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
				WHERE datname = $1 AND application_name = 'redfence'`, dbName).Scan(&n)
			return n == 0, err
		})
	}
	terminate()
	tok2, err := db.Issue(ctx, fencing.Claim{Key: "k"})
	if err != nil || tok2 != tok+1 {
		t.Errorf("Issue after the backends were terminated = %d, %v; want %d", tok2, err, tok+1)
	}
	if _, err := db.PutResource(ctx, "k", tok2, json.RawMessage(`{"v":2}`)); err != nil {
		t.Errorf("PutResource after the backends were terminated: %v", err)
	}
	terminate()
	if r, err := db.Last(ctx, "k"); err != nil || r.Token != tok2 {
		t.Errorf("Last after the backends were terminated = %+v, %v; want token %d", r, err, tok2)
	}
	if _, err := db.GetResource(ctx, "k"); err != nil {
		t.Errorf("GetResource after the backends were terminated: %v", err)
	}
	terminate()
	if err := db.Heartbeat(ctx, "server-1", time.Minute, time.Second, nil); err != nil {
		t.Errorf("Heartbeat after the backends were terminated: %v", err)
	}
}

func TestDB_Nodes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := newDB(t, Options{})
	epoch, left, created, err := db.RegisterNode(ctx, "n1:6379", "e1", nil)
	if err != nil || epoch != "e1" || left != 0 || !created {
		t.Fatalf("RegisterNode(new) = %q, %v, %v, %v; want e1, 0, created", epoch, left, created, err)
	}
	epoch, _, created, err = db.RegisterNode(ctx, "n1:6379", "e2", nil)
	if err != nil || epoch != "e1" || created {
		t.Fatalf("RegisterNode(known) = %q, %v, %v; want e1 kept, not created", epoch, created, err)
	}
	// A stale expectation changes nothing.
	epoch, left, err = db.QuarantineNode(ctx, "n1:6379", "old", "e3", "", false, time.Minute)
	if err != nil || epoch != "e1" || left != 0 {
		t.Fatalf("QuarantineNode(stale) = %q, %v, %v; want e1 unchanged, no quarantine", epoch, left, err)
	}
	epoch, left, err = db.QuarantineNode(ctx, "n1:6379", "e1", "e3", "", false, time.Minute)
	if err != nil || epoch != "e3" || left <= 0 || left > time.Minute {
		t.Fatalf("QuarantineNode = %q, %v, %v; want e3 with up to a minute left", epoch, left, err)
	}
	// A second loss during the quarantine restarts it, never shortening it.
	epoch2, left2, err := db.QuarantineNode(ctx, "n1:6379", "e3", "e4", "", false, time.Hour)
	if err != nil || epoch2 != "e4" || left2 <= time.Minute || left2 > time.Hour {
		t.Fatalf("QuarantineNode(during) = %q, %v, %v; want e4 with up to an hour left", epoch2, left2, err)
	}
	if epoch, l, err := db.QuarantineNode(ctx, "n1:6379", "e4", "e5", "", false, time.Second); err != nil || epoch != "e5" || l <= time.Minute {
		t.Fatalf("QuarantineNode(shorter, during) = %q, %v, %v; want e5 with the hour kept", epoch, l, err)
	}
	// A server merely behind (a stale expectation) changes nothing.
	if epoch, l, err := db.QuarantineNode(ctx, "n1:6379", "e3", "e9", "", false, 2*time.Hour); err != nil || epoch != "e5" || l > time.Hour {
		t.Fatalf("QuarantineNode(behind) = %q, %v, %v; want e5 unchanged", epoch, l, err)
	}
	// A restarted server sees the running quarantine.
	_, left3, _, err := db.RegisterNode(ctx, "n1:6379", "e9", nil)
	if err != nil || left3 <= 0 || left3 > left2 {
		t.Fatalf("RegisterNode after quarantine = %v, %v; want the same end (at most %v left)", left3, err, left2)
	}
	// The time left is counted on Postgres' clock, whatever the server's
	// says: a quarantine that ended there reports none.
	if _, err := db.pool.Exec(ctx, `UPDATE redfence_nodes SET quarantined_until = now() - interval '1 second' WHERE addr = 'n1:6379'`); err != nil {
		t.Fatal(err)
	}
	if _, left4, _, err := db.RegisterNode(ctx, "n1:6379", "e9", nil); err != nil || left4 != 0 {
		t.Fatalf("RegisterNode after the quarantine ended = %v, %v; want 0 left", left4, err)
	}
}

// TestDB_Heartbeat: a quarantine lasts as long as the longest that a server
// which may still hold a lease needs, whatever the detecting server asks.
func TestDB_Heartbeat(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := newDB(t, Options{})
	quarantine := func(addr string) time.Duration {
		t.Helper()
		if _, _, _, err := db.RegisterNode(ctx, addr, "e1", nil); err != nil {
			t.Fatal(err)
		}
		_, left, err := db.QuarantineNode(ctx, addr, "e1", "e2", "", false, 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		return left
	}
	if left := quarantine("alone:6379"); left <= 0 || left > 10*time.Second {
		t.Errorf("no server registered: %v left; want up to the 10s asked", left)
	}
	for id, q := range map[string]time.Duration{"short": time.Minute, "long": 5 * time.Minute} {
		if err := db.Heartbeat(ctx, id, q, time.Second, nil); err != nil {
			t.Fatal(err)
		}
	}
	if left := quarantine("n1:6379"); left <= time.Minute || left > 5*time.Minute {
		t.Errorf("with a live server needing 5m: %v left; want up to 5m, more than 1m", left)
	}
	// The long one stopped beating longer ago than its quarantine: any
	// lease it granted has ended.
	if _, err := db.pool.Exec(ctx, `UPDATE redfence_servers SET seen_at = now() - interval '10 minutes' WHERE id = 'long'`); err != nil {
		t.Fatal(err)
	}
	if left := quarantine("n2:6379"); left <= 10*time.Second || left > time.Minute {
		t.Errorf("with the long server gone: %v left; want up to 1m, more than 10s", left)
	}
	// Beating again brings it back.
	if err := db.Heartbeat(ctx, "long", 5*time.Minute, time.Second, nil); err != nil {
		t.Fatal(err)
	}
	if left := quarantine("n3:6379"); left <= time.Minute {
		t.Errorf("with the long server back: %v left; want more than 1m", left)
	}
	// An address first seen while servers may hold leases is quarantined
	// at once: it may be a known node under another name, just restarted.
	if _, left, created, err := db.RegisterNode(ctx, "alias-of-n1:6379", "e7", nil); err != nil || !created || left <= time.Minute || left > 5*time.Minute {
		t.Errorf("RegisterNode(new address, servers live) = %v, %v, %v; want created, quarantined up to 5m", left, created, err)
	}
}

// TestDB_Heartbeat_NodeListNoProcess: a refusal names the addresses of the
// refused list that have no Redis process on record, and says to start again
// once they answer: such a start may respell a listed node whose process is
// not known under the new spelling yet (its node was down), which the
// advice to stop every server does not fit. A refusal without such an
// address says nothing of it.
func TestDB_Heartbeat_NodeListNoProcess(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := newDB(t, Options{})
	for addr, run := range map[string]string{"a:1": "R-a", "b:1": "R-b", "c:1": "R-c", "d:1": "R-d"} {
		if _, _, _, err := db.RegisterNode(ctx, addr, "e1", nil); err != nil {
			t.Fatal(err)
		}
		if _, _, err := db.NodeProcess(ctx, addr, run, "e2", false); err != nil {
			t.Fatal(err)
		}
	}
	// Registered while its node was down: no process on record.
	if _, _, _, err := db.RegisterNode(ctx, "alias-of-c:1", "e1", nil); err != nil {
		t.Fatal(err)
	}
	if err := db.Heartbeat(ctx, "running", time.Minute, time.Second, []string{"a:1", "b:1", "c:1"}); err != nil {
		t.Fatal(err)
	}
	err := db.Heartbeat(ctx, "respelt", time.Minute, time.Second, []string{"a:1", "alias-of-c:1", "b:1"})
	if !errors.Is(err, ErrNodeListDiffers) || !strings.Contains(err.Error(), "no Redis process on record for alias-of-c:1:") {
		t.Errorf("a respelt address without a process on record: %v; want ErrNodeListDiffers naming it as without a process on record", err)
	}
	err = db.Heartbeat(ctx, "replaced", time.Minute, time.Second, []string{"a:1", "b:1", "d:1"})
	if !errors.Is(err, ErrNodeListDiffers) || strings.Contains(err.Error(), "no Redis process on record") {
		t.Errorf("another node, on record: %v; want ErrNodeListDiffers saying nothing of addresses without a process", err)
	}
}

// TestDB_Heartbeat_NodeList: a server whose node list differs from that of
// a server that may still hold a lease is refused (ErrNodeListDiffers) and
// recorded nowhere; the same list in another order is the same list;
// servers that recorded no list are not compared; once the other server's
// leases have ended, the new list is taken. Of servers with different lists
// starting together, exactly one list is taken.
func TestDB_Heartbeat_NodeList(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := newDB(t, Options{})
	five := []string{"a:1", "b:1", "c:1", "d:1", "e:1"}
	three := []string{"a:1", "b:1", "c:1"}
	if err := db.Heartbeat(ctx, "old-version", time.Minute, time.Second, nil); err != nil {
		t.Fatal(err)
	}
	if err := db.Heartbeat(ctx, "s5", time.Minute, time.Second, five); err != nil {
		t.Fatalf("first list, beside a server that recorded none: %v", err)
	}
	if err := db.Heartbeat(ctx, "s5", time.Minute, time.Second, five); err != nil {
		t.Fatalf("a second beat: %v", err)
	}
	if err := db.Heartbeat(ctx, "same", time.Minute, time.Second, five); err != nil {
		t.Fatalf("the same list: %v", err)
	}
	err := db.Heartbeat(ctx, "s3", time.Minute, time.Second, three)
	if !errors.Is(err, ErrNodeListDiffers) {
		t.Fatalf("another list while servers of the first may hold leases: %v; want ErrNodeListDiffers", err)
	}
	for _, want := range []string{"a:1,b:1,c:1,d:1,e:1", "a:1,b:1,c:1"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name the list %s", err, want)
		}
	}
	var n int
	if err := db.pool.QueryRow(ctx, `SELECT count(*) FROM redfence_servers WHERE id = 's3'`).Scan(&n); err != nil || n != 0 {
		t.Errorf("refused server's rows = %d, %v; want none", n, err)
	}
	// Both servers of the first list stopped long enough ago for their
	// leases to have ended: the new list is taken, and the old one refused.
	if _, err := db.pool.Exec(ctx, `UPDATE redfence_servers SET seen_at = now() - interval '10 minutes' WHERE id IN ('s5', 'same')`); err != nil {
		t.Fatal(err)
	}
	if err := db.Heartbeat(ctx, "s3", time.Minute, time.Second, three); err != nil {
		t.Fatalf("another list once the first list's leases have ended: %v", err)
	}
	if err := db.Heartbeat(ctx, "s5-again", time.Minute, time.Second, five); !errors.Is(err, ErrNodeListDiffers) {
		t.Errorf("the first list again beside the new one: %v; want ErrNodeListDiffers", err)
	}
	// A server of the first list that beats again after it stopped
	// counting (a long Postgres outage) is checked as a new one; one that
	// counts is not checked again.
	if err := db.Heartbeat(ctx, "s5", time.Minute, time.Second, five); !errors.Is(err, ErrNodeListDiffers) {
		t.Errorf("a server of the first list beating again after its leases ended: %v; want ErrNodeListDiffers", err)
	}
	if _, err := db.pool.Exec(ctx, `UPDATE redfence_servers SET seen_at = now() WHERE id = 's5'`); err != nil {
		t.Fatal(err)
	}
	if err := db.Heartbeat(ctx, "s5", time.Minute, time.Second, five); err != nil {
		t.Errorf("a beat of a server that counts, beside another list (not checked again): %v", err)
	}

	// One node's address spelt another way: the same process on record
	// behind both addresses is the same node; another process is not.
	db3, _ := newDB(t, Options{})
	for addr, run := range map[string]string{"a:1": "R-a", "b:1": "R-b", "c:1": "R-c", "alias-of-c:1": "R-c", "d:1": "R-d"} {
		if _, _, _, err := db3.RegisterNode(ctx, addr, "e1", nil); err != nil {
			t.Fatal(err)
		}
		if _, _, err := db3.NodeProcess(ctx, addr, run, "e2", false); err != nil {
			t.Fatal(err)
		}
	}
	if err := db3.Heartbeat(ctx, "spelt", time.Minute, time.Second, []string{"a:1", "b:1", "c:1"}); err != nil {
		t.Fatal(err)
	}
	if err := db3.Heartbeat(ctx, "respelt", time.Minute, time.Second, []string{"a:1", "alias-of-c:1", "b:1"}); err != nil {
		t.Errorf("the same processes under another address: %v; want the same list", err)
	}
	if err := db3.Heartbeat(ctx, "replaced", time.Minute, time.Second, []string{"a:1", "b:1", "d:1"}); !errors.Is(err, ErrNodeListDiffers) {
		t.Errorf("another process: %v; want ErrNodeListDiffers", err)
	}
	if err := db3.Heartbeat(ctx, "unknown", time.Minute, time.Second, []string{"a:1", "b:1", "new:1"}); !errors.Is(err, ErrNodeListDiffers) {
		t.Errorf("an address without a process on record: %v; want ErrNodeListDiffers", err)
	}

	// Servers with different lists starting together: a heartbeat waits
	// for one under way (here: a transaction recording a list, holding the
	// heartbeats' lock) and then sees its list.
	db2, _ := newDB(t, Options{})
	tx := holdHeartbeatLock(t, db2.pool)
	if _, err := tx.Exec(ctx, beatSQL, "first", 60000, 1000, five); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- db2.Heartbeat(ctx, "second", time.Minute, time.Second, three) }()
	for waiting := 0; waiting == 0; {
		select {
		case err := <-done:
			t.Fatalf("a heartbeat beside one under way returned at once (%v); want it to wait for it", err)
		default:
		}
		if err := db2.pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, ErrNodeListDiffers) {
		t.Errorf("a heartbeat with another list, after one under way committed: %v; want ErrNodeListDiffers", err)
	}
}

// holdHeartbeatLock begins a transaction on db that holds the heartbeats'
// lock, as another server's beat under way would; it is rolled back when
// the test ends unless committed first.
func holdHeartbeatLock(t *testing.T, db interface {
	Begin(context.Context) (pgx.Tx, error)
}) pgx.Tx {
	t.Helper()
	tx, err := db.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if _, err := tx.Exec(t.Context(), heartbeatLockSQL); err != nil {
		t.Fatal(err)
	}
	return tx
}

// TestDB_NodeRunID: the Redis process on record. A restart seen as a new
// run_id is quarantined unless the record already names that process (a
// server handled it), even when the epoch moved on for an earlier restart:
// a server behind on the record must not take a second restart for the one
// it missed. A server that was not watching the node (NodeProcess) finds an
// unseen restart by the run_id alone, and quarantines it only while a server
// may hold a lease and unless the node fsyncs every write.
func TestDB_NodeRunID(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := newDB(t, Options{})
	const addr = "run:6379"
	if _, _, _, err := db.RegisterNode(ctx, addr, "e1", nil); err != nil {
		t.Fatal(err)
	}
	// Nothing on record yet: the first process is recorded, no quarantine.
	if epoch, left, err := db.NodeProcess(ctx, addr, "R1", "x", false); err != nil || epoch != "e1" || left != 0 {
		t.Fatalf("NodeProcess(first) = %q, %v, %v; want e1, no quarantine", epoch, left, err)
	}
	// No server may hold a lease: an unseen restart cannot have lost one.
	if epoch, left, err := db.NodeProcess(ctx, addr, "R2", "x", false); err != nil || epoch != "e1" || left != 0 {
		t.Fatalf("NodeProcess(restart, no live server) = %q, %v, %v; want e1, no quarantine", epoch, left, err)
	}
	if err := db.Heartbeat(ctx, "s", time.Minute, time.Second, nil); err != nil {
		t.Fatal(err)
	}
	// The same process again: no quarantine.
	if epoch, left, err := db.NodeProcess(ctx, addr, "R2", "x", false); err != nil || epoch != "e1" || left != 0 {
		t.Fatalf("NodeProcess(same) = %q, %v, %v; want e1, no quarantine", epoch, left, err)
	}
	// A restart from a durable process (appendfsync always) to a durable
	// one kept every write: no quarantine.
	if epoch, left, err := db.NodeProcess(ctx, addr, "R2", "x", true); err != nil || epoch != "e1" || left != 0 {
		t.Fatalf("NodeProcess(same, now durable) = %q, %v, %v; want e1, no quarantine", epoch, left, err)
	}
	if epoch, left, err := db.NodeProcess(ctx, addr, "R3", "x", true); err != nil || epoch != "e1" || left != 0 {
		t.Fatalf("NodeProcess(durable restart of a durable process) = %q, %v, %v; want e1, no quarantine", epoch, left, err)
	}
	// A durable process started on the data of one that was not: the
	// writes it missed may hold leases.
	if _, err := db.pool.Exec(ctx, `UPDATE redfence_nodes SET run_durable = false WHERE addr = $1`, addr); err != nil {
		t.Fatal(err)
	}
	epoch, left, err := db.NodeProcess(ctx, addr, "R3b", "e1b", true)
	if err != nil || epoch != "e1b" || left <= 0 {
		t.Fatalf("NodeProcess(durable restart of a process that was not) = %q, %v, %v; want e1b and a quarantine", epoch, left, err)
	}
	if _, err := db.pool.Exec(ctx, `UPDATE redfence_nodes SET quarantined_until = NULL, epoch = 'e1' WHERE addr = $1`, addr); err != nil {
		t.Fatal(err)
	}
	// An unseen restart while a server may hold a lease: quarantined for
	// what that server needs, under the new epoch; once only.
	epoch, left, err = db.NodeProcess(ctx, addr, "R4", "e2", false)
	if err != nil || epoch != "e2" || left <= 0 || left > time.Minute {
		t.Fatalf("NodeProcess(unseen restart) = %q, %v, %v; want e2 with up to a minute left", epoch, left, err)
	}
	if epoch, left, err := db.NodeProcess(ctx, addr, "R4", "x", false); err != nil || epoch != "e2" || left <= 0 {
		t.Fatalf("NodeProcess(same restart, second server) = %q, %v, %v; want e2 and the running quarantine", epoch, left, err)
	}
	if _, _, err := db.NodeProcess(ctx, "unknown:6379", "R1", "x", false); err == nil {
		t.Error("NodeProcess(unregistered address) succeeded")
	}
	// A server that saw R4 itself, with e1 as its epoch, adopts the
	// handled restart; one that finds R5 restarts the quarantine even
	// though its epoch (e1) is behind the record's.
	if epoch, _, err := db.QuarantineNode(ctx, addr, "e1", "x", "R4", false, time.Minute); err != nil || epoch != "e2" {
		t.Fatalf("QuarantineNode(handled restart) = %q, %v; want e2 adopted", epoch, err)
	}
	if _, err := db.pool.Exec(ctx, `UPDATE redfence_nodes SET quarantined_until = NULL WHERE addr = $1`, addr); err != nil {
		t.Fatal(err)
	}
	epoch, left, err = db.QuarantineNode(ctx, addr, "e1", "e3", "R5", false, time.Minute)
	if err != nil || epoch != "e3" || left <= 0 {
		t.Fatalf("QuarantineNode(second restart, server behind) = %q, %v, %v; want e3 and a quarantine", epoch, left, err)
	}
	// A lost marker (no run_id) keeps the process on record.
	if epoch, _, err := db.QuarantineNode(ctx, addr, "e3", "e4", "", false, time.Minute); err != nil || epoch != "e4" {
		t.Fatalf("QuarantineNode(lost marker) = %q, %v; want e4", epoch, err)
	}
	if epoch, _, err := db.QuarantineNode(ctx, addr, "e1", "x", "R5", false, time.Minute); err != nil || epoch != "e4" {
		t.Fatalf("QuarantineNode(R5 again) = %q, %v; want e4 adopted (R5 still on record)", epoch, err)
	}
}

// TestDB_QuarantineNodeRace: a server whose quarantine statement waited on
// another server's move of the same node gets the epoch that move left, not
// the one the node was found without (a read inside the waiting statement
// would see the row as it was before the move).
func TestDB_QuarantineNodeRace(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := newDB(t, Options{})
	if _, _, _, err := db.RegisterNode(ctx, "race:6379", "E", nil); err != nil {
		t.Fatal(err)
	}
	tx, err := db.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `UPDATE redfence_nodes SET epoch = 'NA', quarantined_until = now() + interval '1 minute' WHERE addr = 'race:6379'`); err != nil {
		t.Fatal(err)
	}
	type answer struct {
		epoch string
		left  time.Duration
		err   error
	}
	done := make(chan answer, 1)
	go func() {
		epoch, left, err := db.QuarantineNode(ctx, "race:6379", "E", "NB", "", false, time.Minute)
		done <- answer{epoch, left, err}
	}()
	testutil.WaitFor(t, 30*time.Second, "the second statement to wait on the row lock", func() (bool, error) {
		var n int
		err := db.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()`).Scan(&n)
		return n > 0, err
	})
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	a := <-done
	if a.err != nil || a.epoch != "NA" || a.left <= 0 {
		t.Errorf("QuarantineNode after a concurrent move = %q, %v, %v; want NA and its quarantine", a.epoch, a.left, a.err)
	}
}

// TestDB_Heartbeat_StoppedCountingWhileWaiting: a server's beat that began
// while the server still counted, but got the heartbeats' lock only after
// its count ended and a server with another list had started (a slow link
// to Postgres: the beats that failed before were as slow), is checked as a
// new server's is: it is refused, and the server grants nothing. Whether it
// counts is judged when it is checked, not when its transaction began
// (now()), or it would take up granting on its list beside the other one.
func TestDB_Heartbeat_StoppedCountingWhileWaiting(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db, url := newDB(t, Options{})
	five := []string{"a:1", "b:1", "c:1", "d:1", "e:1"}
	three := []string{"a:1", "b:1", "c:1"}
	if err := db.Heartbeat(ctx, "old", time.Minute, time.Second, five); err != nil {
		t.Fatal(err)
	}
	// The heartbeats' lock, held as by another server's beat under way.
	obs := connect(t, url)
	tx := holdHeartbeatLock(t, obs)
	done := make(chan error, 1)
	go func() { done <- db.Heartbeat(ctx, "old", time.Minute, time.Second, five) }()
	var began time.Time
	testutil.WaitFor(t, waitTimeout, "the old server's beat to wait for the heartbeats' lock", func() (bool, error) {
		err := obs.QueryRow(ctx, `SELECT a.xact_start FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE l.locktype = 'advisory' AND NOT l.granted`).Scan(&began)
		if errors.Is(err, pgx.ErrNoRows) {
			return false, nil
		}
		return err == nil, err
	})
	// Its count ends just after its beat began (1 ms), and ended before now.
	if _, err := tx.Exec(ctx, `UPDATE redfence_servers SET seen_at = $1::timestamptz + interval '1 millisecond' - interval '61 seconds' WHERE id = 'old'`, began); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, waitTimeout, "Postgres' clock to pass the old server's count", func() (bool, error) {
		var past bool
		err := tx.QueryRow(ctx, `SELECT clock_timestamp() > $1::timestamptz + interval '1 millisecond'`, began).Scan(&past)
		return past, err
	})
	// A server with another list started meanwhile: the old one no longer
	// counted when it was checked.
	if _, err := tx.Exec(ctx, beatSQL, "new", 60000, 1000, three); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, ErrNodeListDiffers) {
		t.Errorf("a beat that waited past the end of its server's count, beside a server with another list: %v; want ErrNodeListDiffers", err)
	}
}

// TestDB_Heartbeat_LockNotHeldForClient: the heartbeats' lock is never
// held while Postgres waits for the client: a server whose link to Postgres
// stalls in the middle of its beat (a network partition, a paused VM) does
// not hold up the beats of every other server (which then grant nothing once
// theirs are stale), for as long as its session lasts in Postgres (up to
// its idle_in_transaction_session_timeout, REDFENCE_STATEMENT_TIMEOUT, or
// until TCP gives up on it). Here the stalled server's beat gets the lock
// once the network to Postgres already keeps back what it sends.
func TestDB_Heartbeat_LockNotHeldForClient(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db, url := newDB(t, Options{})
	_, hostPort, _ := strings.Cut(strings.TrimPrefix(url, "postgres://"), "@")
	hostPort, _, _ = strings.Cut(hostPort, "/")
	proxy := newHeldProxy(t, hostPort)
	stalled := open(t, strings.Replace(url, hostPort, proxy.ln.Addr().String(), 1), Options{StatementTimeout: time.Hour})
	five := []string{"a:1", "b:1", "c:1", "d:1", "e:1"}
	if err := stalled.Heartbeat(ctx, "stalled", time.Minute, time.Second, five); err != nil {
		t.Fatal(err)
	}
	obs := connect(t, url)
	tx := holdHeartbeatLock(t, obs)
	sctx, scancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- stalled.Heartbeat(sctx, "stalled", time.Minute, time.Second, five) }()
	defer func() { scancel(); proxy.release(); <-done }()
	testutil.WaitFor(t, waitTimeout, "the stalled server's beat to wait for the heartbeats' lock", func() (bool, error) {
		var n int
		err := obs.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted`).Scan(&n)
		return n == 1, err
	})
	proxy.hold()
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	bctx, bcancel := context.WithTimeout(ctx, waitTimeout)
	defer bcancel()
	if err := db.Heartbeat(bctx, "other", time.Minute, time.Second, five); err != nil {
		t.Errorf("another server's beat while a server's link stalled in the middle of its own: %v; want it recorded", err)
	}
}
