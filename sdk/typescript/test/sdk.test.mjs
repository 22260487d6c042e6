// Tests of the TypeScript SDK against a real Redfence: `redfence dev` (five
// redis-server nodes and Postgres on loopback), started here and stopped
// with SIGINT at the end; requests carry the API key its banner prints.
// REDFENCE_BIN names the binary; without it the test builds one with
// `go build`.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync, spawn, spawnSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { setTimeout as delay } from "node:timers/promises";

import createClient from "openapi-fetch";

import { Redfence, RedfenceError } from "../dist/index.js";

const sdk = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const root = path.resolve(sdk, "../..");
const tmp = mkdtempSync(path.join(tmpdir(), "redfence-sdk-"));

let server;
let baseUrl;
let apiKey; // the API key redfence dev prints (undefined when auth is off)

before(async () => {
  let bin = process.env.REDFENCE_BIN;
  if (!bin) {
    bin = path.join(tmp, "redfence");
    execFileSync("go", ["build", "-o", bin, "./cmd/redfence"], { cwd: root, stdio: "inherit" });
  }
  const env = Object.fromEntries(Object.entries(process.env).filter(([k]) => !k.startsWith("REDFENCE_")));
  env.REDFENCE_LOG_LEVEL = "warn";
  server = spawn(bin, ["dev", "--addr", "127.0.0.1:0"], { env, stdio: ["ignore", "pipe", "pipe"] });
  baseUrl = await new Promise((resolve, reject) => {
    let out = "";
    let url;
    const timer = setTimeout(() => reject(new Error(`redfence dev did not start within 120 s:\n${out}`)), 120_000);
    const onData = (d) => {
      out += d;
      url ??= /Redfence is serving on (http:\/\/\S+)/.exec(out)?.[1];
      apiKey ??= /^\s*KEY=(\S+)$/m.exec(out)?.[1];
      if (url && out.includes("Press Ctrl-C")) {
        clearTimeout(timer);
        resolve(url);
      }
    };
    server.stdout.on("data", onData);
    server.stderr.on("data", onData);
    server.once("exit", (code) => {
      clearTimeout(timer);
      reject(new Error(`redfence dev exited with ${code}:\n${out}`));
    });
  });
});

after(async () => {
  if (server && server.exitCode === null && server.signalCode === null) {
    const exited = new Promise((resolve) => server.once("exit", resolve));
    server.kill("SIGINT");
    await exited;
  }
  rmSync(tmp, { recursive: true, force: true });
});

/** Asserts that name is free: an acquire that tries once succeeds. */
async function assertReleased(rf, name) {
  const l = await rf.acquire(name, { ttlMs: 5000 });
  await l.release();
}

test("the generated types are up to date with openapi.yaml", () => {
  const out = path.join(tmp, "schema.ts");
  const gen = spawnSync(path.join(sdk, "node_modules", ".bin", "openapi-typescript"), [path.join(root, "openapi.yaml"), "-o", out], {
    encoding: "utf8",
  });
  assert.equal(gen.status, 0, gen.stderr);
  assert.ok(
    readFileSync(out, "utf8") === readFileSync(path.join(sdk, "src", "schema.ts"), "utf8"),
    "src/schema.ts is out of date: run `npm run generate` in sdk/typescript and commit it",
  );
});

test("a plain openapi-fetch client acquires, writes with the token and releases", async () => {
  const api = createClient({ baseUrl, headers: apiKey ? { Authorization: `Bearer ${apiKey}` } : {} });
  const name = "orders:invoice-7"; // openapi-fetch percent-encodes the ':'; the server decodes it
  const acq = await api.POST("/v1/locks/{name}", { params: { path: { name } }, body: { ttl_ms: 30000, owner: "ts" } });
  assert.equal(acq.response.status, 201);
  assert.equal(acq.data.name, name);
  assert.ok(acq.data.fencing_token >= 1 && acq.data.lock_token.length === 27 && acq.data.validity_ms > 0);

  const put = await api.PUT("/v1/resources/{name}", {
    params: { path: { name } },
    body: { fencing_token: acq.data.fencing_token, data: { total: 42 } },
  });
  assert.equal(put.response.status, 200);
  assert.deepEqual(put.data.data, { total: 42 });
  assert.equal(put.data.fencing_token, acq.data.fencing_token);

  const lockToken = { "Lock-Token": acq.data.lock_token };
  const rel = await api.DELETE("/v1/locks/{name}", { params: { path: { name }, header: lockToken } });
  assert.equal(rel.response.status, 204);
  const again = await api.DELETE("/v1/locks/{name}", { params: { path: { name }, header: lockToken } });
  assert.equal(again.response.status, 409);
  assert.equal(again.error.type, "urn:redfence:problem:not-holder");
});

test("withLock runs fn with the lease, returns its result and releases", async () => {
  const rf = new Redfence({ baseUrl, apiKey, owner: "ts-test" });
  const got = await rf.withLock("ts-ok", async (lease) => {
    assert.ok(lease.held && lease.fencingToken >= 1 && lease.remainingMs > 0);
    await rf.putResource("ts-ok", lease.fencingToken, { n: 1 });
    return lease.fencingToken;
  });
  assert.ok(got >= 1);
  await assertReleased(rf, "ts-ok");
});

test("withLock renews the lease while fn runs, past several TTLs", async () => {
  const rf = new Redfence({ baseUrl, apiKey });
  const ttlMs = 2000;
  await rf.withLock(
    "ts-renew",
    async (lease) => {
      const first = lease.deadline.getTime();
      while (lease.deadline.getTime() < first + 2 * ttlMs) {
        assert.ok(lease.held, `the lease ended: ${lease.signal.reason}`);
        await delay(50); // polling interval, not synchronisation
      }
      const st = await rf.api.GET("/v1/locks/{name}", { params: { path: { name: "ts-renew" } } });
      assert.equal(st.data.held, true);
      assert.equal(st.data.last_fencing_token, lease.fencingToken);
    },
    { ttlMs },
  );
  await assertReleased(rf, "ts-renew");
});

test("withLock rethrows fn's error and releases", async () => {
  const rf = new Redfence({ baseUrl, apiKey });
  const boom = new Error("boom");
  await assert.rejects(
    rf.withLock("ts-throw", () => {
      throw boom;
    }),
    (err) => err === boom,
  );
  await assertReleased(rf, "ts-throw");
});

test("acquire on a held lock rejects with kind held", async () => {
  const rf = new Redfence({ baseUrl, apiKey });
  const lease = await rf.acquire("ts-held", { ttlMs: 10000 });
  try {
    await assert.rejects(rf.acquire("ts-held"), (err) => {
      assert.ok(err instanceof RedfenceError);
      assert.equal(err.kind, "held");
      assert.equal(err.slug, "lock-held");
      assert.ok(err.retryAfterMs > 0);
      return true;
    });
    await assert.rejects(rf.acquire("ts-held", { waitMs: 200 }), (err) => err.kind === "held" && err.slug === "wait-timeout");
  } finally {
    await lease.release();
  }
});

test("a lease that is not renewed ends, and withLock reports it lost", async () => {
  const rf = new Redfence({ baseUrl, apiKey });
  await assert.rejects(
    rf.withLock(
      "ts-lost",
      async (lease) => {
        await new Promise((resolve) => lease.signal.addEventListener("abort", resolve, { once: true }));
        assert.equal(lease.held, false);
        assert.ok(lease.remainingMs <= 0);
      },
      { ttlMs: 500, renewFraction: 0 },
    ),
    (err) => err instanceof RedfenceError && err.kind === "lost",
  );
});

test("a write with a stale fencing token rejects with kind stale", async () => {
  const rf = new Redfence({ baseUrl, apiKey });
  const old = await rf.withLock("ts-stale", (lease) => lease.fencingToken);
  const next = await rf.acquire("ts-stale");
  try {
    await assert.rejects(rf.putResource("ts-stale", old, 0), (err) => {
      assert.equal(err.kind, "stale");
      assert.equal(err.currentFencingToken, next.fencingToken);
      return true;
    });
  } finally {
    await next.release();
  }
});

test("a conditional write applies only at the version asked, else rejects with kind precondition", async () => {
  const rf = new Redfence({ baseUrl, apiKey });
  const lease = await rf.acquire("ts-cas");
  try {
    const t = lease.fencingToken;
    const wantPrecondition = (version) => (err) => {
      assert.ok(err instanceof RedfenceError, String(err));
      assert.equal(err.kind, "precondition");
      assert.equal(err.status, 412);
      assert.equal(err.currentVersion, version);
      return true;
    };
    await assert.rejects(rf.putResource("ts-cas", t, "x", { version: 1 }), wantPrecondition(undefined));
    assert.equal((await rf.putResource("ts-cas", t, 1, { version: 0 })).version, 1);
    await assert.rejects(rf.putResource("ts-cas", t, "x", { version: 0 }), wantPrecondition(1));
    assert.equal((await rf.putResource("ts-cas", t, 2, { version: 1 })).version, 2);
    await assert.rejects(rf.putResource("ts-cas", t, "x", { version: 1 }), wantPrecondition(2));
    for (const version of [-1, 1.5, Number.NaN]) {
      await assert.rejects(rf.putResource("ts-cas", t, "x", { version }), (err) => err instanceof RedfenceError && err.kind === "invalid");
    }
    const { data } = await rf.api.GET("/v1/resources/{name}", { params: { path: { name: "ts-cas" } } });
    assert.equal(data.version, 2);
    assert.equal(data.data, 2);
  } finally {
    await lease.release();
  }
});

test("withLock keeps the process alive while fn waits only on the lease", async () => {
  // A child Node process whose only pending work is fn, resolved by an
  // unref'd timer after two TTLs: without withLock holding the event loop
  // open, Node would exit at once (code 13, the lock left to expire).
  const script = path.join(tmp, "alive.mjs");
  const { writeFileSync } = await import("node:fs");
  writeFileSync(script, `
import { Redfence } from ${JSON.stringify(path.join(sdk, "dist/index.js"))};
const rf = new Redfence({ baseUrl: process.argv[2], apiKey: process.argv[3] || undefined });
await rf.withLock("sdk-alive", (lease) => new Promise((resolve) => {
  setTimeout(resolve, 2 * lease.ttlMs).unref();
}), { ttlMs: 1000 });
console.log("done");
`);
  const r = spawnSync(process.execPath, [script, baseUrl, apiKey ?? ""], { encoding: "utf8", timeout: 30_000 });
  assert.equal(r.status, 0, `exit ${r.status}: ${r.stderr}`);
  assert.equal(r.stdout.trim(), "done");
  const rf = new Redfence({ baseUrl, apiKey });
  await assertReleased(rf, "sdk-alive");
});

test("extend after release rejects with a RedfenceError", async () => {
  const rf = new Redfence({ baseUrl, apiKey });
  const lease = await rf.acquire("sdk-released", { ttlMs: 5000 });
  await lease.release();
  await assert.rejects(lease.extend(), (err) => err instanceof RedfenceError && err.kind === "lost");
});
