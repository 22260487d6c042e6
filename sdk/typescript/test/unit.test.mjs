// Tests of the SDK's own logic against a scripted server (a fetch that
// answers as told): answers a real server gives only under faults (a
// proxy's error page, a 503 with Retry-After only, a grant that arrives
// after its validity) and timings that a real one cannot be made to show.
// sdk.test.mjs runs the same SDK against a real Redfence.
import { test } from "node:test";
import assert from "node:assert/strict";
import { setTimeout as delay } from "node:timers/promises";
import v8 from "node:v8";
import vm from "node:vm";

import { Redfence, RedfenceError } from "../dist/index.js";

const problem = (status, slug, extra = {}, headers = {}) =>
  new Response(JSON.stringify({ type: `urn:redfence:problem:${slug}`, title: slug, status, ...extra }), {
    status,
    headers: { "content-type": "application/problem+json", ...headers },
  });
const grant = (validity = 10_000, ttl = validity) =>
  new Response(
    JSON.stringify({ name: "n", lock_token: "jzocnifUtgU-kaoMf0LY4Vtgw_c", fencing_token: 7, ttl_ms: ttl, validity_ms: validity, expires_at: "2030-01-01T00:00:00Z", owner: "" }),
    { status: 201, headers: { "content-type": "application/json" } },
  );
const noContent = () => new Response(null, { status: 204 });

/** A client whose server is route(kind, nth call of that kind) -> Response; kind: acquire, extend, release, put. */
function scripted(route, opts = {}) {
  const calls = [];
  const rf = new Redfence({
    baseUrl: "http://scripted",
    apiKey: "rf_0123456789abcdef_secret",
    ...opts,
    fetch: async (req) => {
      const kind = req.url.endsWith("/extend") ? "extend" : req.url.includes("/resources/") ? "put" : req.method === "DELETE" ? "release" : "acquire";
      calls.push(kind);
      return route(kind, calls.filter((c) => c === kind).length, req);
    },
  });
  const count = (kind) => calls.filter((c) => c === kind).length;
  return { rf, calls, count };
}

test("an error answer that is not a problem document (a proxy's page, an empty body) is a RedfenceError", async () => {
  for (const [res, kind] of [
    [new Response("<html>502 Bad Gateway</html>", { status: 502, headers: { "content-type": "text/html" } }), "unavailable"],
    [new Response(null, { status: 429, headers: { "retry-after": "7" } }), "unavailable"],
    [new Response(JSON.stringify({ message: "no" }), { status: 400, headers: { "content-type": "application/json" } }), "invalid"],
  ]) {
    const { rf } = scripted(() => res.clone());
    await assert.rejects(rf.acquire("n"), (e) => {
      assert.ok(e instanceof RedfenceError, `${e}`);
      assert.equal(e.kind, kind);
      assert.equal(e.status, res.status);
      assert.equal(e.slug, "");
      assert.equal(e.problem, undefined);
      return true;
    });
  }
});

test("retryAfterMs falls back to the Retry-After header (the server's 503s carry only that)", async () => {
  const { rf } = scripted(() => problem(503, "quorum-unavailable", {}, { "retry-after": "1" }));
  await assert.rejects(rf.acquire("n"), (e) => e.kind === "unavailable" && e.retryAfterMs === 1000);
  const { rf: rf2 } = scripted(() => problem(409, "lock-held", { retry_after_ms: 1234 }, { "retry-after": "2" }));
  await assert.rejects(rf2.acquire("n"), (e) => e.kind === "held" && e.retryAfterMs === 1234);
});

test("the deadline counts from the send time, and a grant whose validity ran out before its answer arrived is not handed out", async () => {
  const { rf, count } = scripted(async (kind) => {
    if (kind === "acquire") {
      await delay(300);
      return grant(1000);
    }
    return noContent();
  });
  const lease = await rf.acquire("n", { renewFraction: 0 });
  assert.ok(lease.remainingMs <= 700, `remainingMs ${lease.remainingMs}: not counted from the send time`);
  await lease.release();

  const late = scripted(async (kind) => {
    if (kind === "acquire") {
      await delay(200);
      return grant(100);
    }
    return noContent();
  });
  await assert.rejects(late.rf.acquire("n"), (e) => e.kind === "lost");
  assert.equal(late.count("release"), 1, "the late grant was not released");
  assert.equal(count("release"), 1);
});

test("lease.held turns false when the deadline passes, before the expiry timer runs", async () => {
  const { rf } = scripted((kind) => (kind === "acquire" ? grant(150) : noContent()));
  const lease = await rf.acquire("n", { renewFraction: 0 });
  const until = performance.now() + 200;
  while (performance.now() < until); // blocks the event loop past the deadline: no timer can run
  assert.equal(lease.held, false);
  assert.equal(lease.signal.aborted, true);
  assert.equal(lease.signal.reason.kind, "lost");
  await lease.release().catch(() => undefined);
});

test("a lease whose deadline passed while the machine slept has ended: the wall clock knows, the monotonic one does not", async () => {
  // A suspend stops performance.now() and the timers; the Redis nodes'
  // expiry runs on. Here Date.now() jumps an hour and performance.now()
  // does not: held is false at once, and a lease nobody asks ends within
  // a second (the expiry timer looks at least that often), not at its
  // monotonic deadline a minute away.
  const { rf } = scripted((kind) => (kind === "acquire" ? grant(60_000) : noContent()));
  const asked = await rf.acquire("n", { renewFraction: 0 });
  const unasked = await rf.acquire("m", { renewFraction: 0 });
  assert.equal(asked.held, true);
  const realNow = Date.now;
  Date.now = () => realNow() + 3_600_000;
  try {
    assert.equal(asked.held, false);
    assert.equal(asked.signal.reason.kind, "lost");
    assert.ok(asked.remainingMs < 0);
    // The lease's timers do not hold the event loop open; this one does
    // (and bounds a hang: the monotonic deadline is a minute away).
    let hang;
    const ended = await Promise.race([
      new Promise((resolve) => unasked.signal.addEventListener("abort", () => resolve(true), { once: true })),
      new Promise((resolve) => (hang = setTimeout(() => resolve(false), 30_000))),
    ]);
    clearTimeout(hang);
    assert.ok(ended, "the unasked lease was still held 30 s after the resume");
    assert.equal(unasked.signal.reason.kind, "lost");
  } finally {
    Date.now = realNow;
  }
  await asked.release().catch(() => undefined);
  await unasked.release().catch(() => undefined);
});

test("withLock reports a lease whose deadline passed while fn ran as lost", async () => {
  const { rf } = scripted((kind) => (kind === "acquire" ? grant(150) : noContent()));
  await assert.rejects(
    rf.withLock("n", () => {
      const until = performance.now() + 200;
      while (performance.now() < until);
      return "done";
    }, { renewFraction: 0 }),
    (e) => e.kind === "lost",
  );
});

test("a release the server could not answer can be sent again; withLock does so", async () => {
  const { rf, count } = scripted((kind, n) => {
    if (kind === "acquire") return grant();
    if (kind === "release" && n === 1) return problem(503, "quorum-unavailable", {}, { "retry-after": "0" });
    return noContent();
  });
  const lease = await rf.acquire("n");
  await assert.rejects(lease.release(), (e) => e.kind === "unavailable");
  assert.equal(lease.held, false, "a lease given up is not held, even if the delete failed");
  await lease.release();
  await lease.release(); // settled: no third request
  assert.equal(count("release"), 2);

  const again = scripted((kind, n) => {
    if (kind === "acquire") return grant();
    if (kind === "release" && n < 3) return problem(503, "quorum-unavailable", {}, { "retry-after": "0" });
    return noContent();
  });
  assert.equal(await again.rf.withLock("n", () => 42), 42);
  assert.equal(again.count("release"), 3);
});

test("a release answered not-holder is final", async () => {
  const { rf, count } = scripted((kind) => (kind === "acquire" ? grant() : problem(409, "not-holder")));
  const lease = await rf.acquire("n");
  await assert.rejects(lease.release(), (e) => e.kind === "lost");
  await assert.rejects(lease.release(), (e) => e.kind === "lost");
  assert.equal(count("release"), 1);
  // withLock: the lease was held when fn returned, so the lost release is an error.
  await assert.rejects(rf.withLock("n", () => 1), (e) => e.kind === "lost" && e.slug === "not-holder");
});

test("withLock resolves with fn's result when fn released the lease itself", async () => {
  const { rf, count } = scripted((kind) => (kind === "acquire" ? grant() : noContent()));
  assert.equal(await rf.withLock("n", async (lease) => {
    await lease.release();
    assert.equal(lease.held, false);
    return 42;
  }), 42);
  assert.equal(count("release"), 1);
});

test("a renewal answered lock-lost ends the lease at once; one answered 401 too, with its reason", async () => {
  for (const [res, slug] of [[problem(409, "lock-lost"), "lock-lost"], [problem(401, "unauthorized"), "unauthorized"]]) {
    // A minute's lease renewed after 1% of it: ended by the answer, long before its deadline.
    const { rf, count } = scripted((kind) => (kind === "acquire" ? grant(60_000) : kind === "extend" ? res.clone() : noContent()));
    let left;
    await assert.rejects(
      rf.withLock("n", (lease) => new Promise((resolve) => lease.signal.addEventListener("abort", () => {
        left = lease.remainingMs;
        resolve();
      })), { renewFraction: 0.01 }),
      (e) => e.slug === slug,
    );
    assert.ok(left > 0, "the lease ran on to its deadline");
    assert.equal(count("extend"), 1, `${slug}: renewal was retried`);
  }
});

test("withLock sends the release again when fn threw and the server could not answer", async () => {
  const { rf, count } = scripted((kind, n) => {
    if (kind === "acquire") return grant();
    if (kind === "release" && n === 1) return problem(503, "quorum-unavailable", {}, { "retry-after": "0" });
    return noContent();
  });
  await assert.rejects(rf.withLock("n", () => { throw new Error("fn failed"); }), /fn failed/);
  assert.equal(count("release"), 2);
});

test("a renewal that keeps failing ends the lease at its deadline, saying why", async () => {
  const { rf } = scripted((kind) => (kind === "acquire" ? grant(400) : kind === "extend" ? problem(503, "quorum-unavailable") : noContent()));
  const lease = await rf.acquire("n");
  const keepAlive = setInterval(() => undefined, 1000); // a bare lease's timers are unref'd
  await new Promise((resolve) => lease.signal.addEventListener("abort", resolve));
  clearInterval(keepAlive);
  assert.equal(lease.signal.reason.kind, "lost");
  assert.match(lease.signal.reason.message, /quorum-unavailable/);
  assert.doesNotMatch(lease.signal.reason.message, /unreachable/); // the server answered
  await lease.release().catch(() => undefined);
});

test("withLock: a release sent again that finds nothing held (its first answer was lost) is the release done", async () => {
  const { rf, count } = scripted((kind, n) => {
    if (kind === "acquire") return grant();
    if (kind === "release" && n === 1) return Promise.reject(new TypeError("fetch failed")); // deleted, answer lost
    if (kind === "release") return problem(409, "not-holder");
    return noContent();
  });
  assert.equal(await rf.withLock("n", () => 42), 42);
  assert.equal(count("release"), 2);
});

test("extend while a release is under way rejects with the lease's reason (lost), not as unreachable", async () => {
  let answerRelease;
  const { rf } = scripted((kind) => {
    if (kind === "acquire") return grant();
    if (kind === "release") return new Promise((resolve) => { answerRelease = () => resolve(noContent()); });
    return new Promise(() => {}); // an extend never answered
  });
  const lease = await rf.acquire("n", { renewFraction: 0 });
  const ext = lease.extend();
  const rel = lease.release();
  await assert.rejects(ext, (e) => e instanceof RedfenceError && e.kind === "lost");
  answerRelease();
  await rel;
});

test("an extend still unanswered when the lease ends rejects as lost, not unavailable", async () => {
  const { rf } = scripted((kind) => (kind === "acquire" ? grant(300) : new Promise(() => {})), { timeoutMs: 60_000 });
  const lease = await rf.acquire("n", { renewFraction: 0 });
  await assert.rejects(lease.extend(1000), (e) => e instanceof RedfenceError && e.kind === "lost");
  assert.equal(lease.held, false);
  await lease.release().catch(() => undefined);
});

test("bad options are refused before anything is sent", async () => {
  const { rf, calls } = scripted(() => grant(60_000));
  for (const opts of [
    { renewFraction: Number.NaN }, { renewFraction: 1 }, { renewFraction: -0.1 }, { ttlMs: 10_000, maxHoldMs: 5_000 },
    { waitMs: Number.NaN }, { waitMs: -1 }, { waitMs: Infinity },
  ]) {
    await assert.rejects(rf.acquire("n", opts), (e) => e instanceof RedfenceError && e.kind === "invalid", String(Object.entries(opts)));
  }
  assert.deepEqual(calls, []);
  // A base URL fetch cannot use is refused at once, not retried as an unreachable server.
  for (const baseUrl of ["localhost:8080", "127.0.0.1:8080", "/v1", "", "ftp://host"]) {
    assert.throws(() => new Redfence({ baseUrl }), (e) => e instanceof TypeError && /absolute http or https URL/.test(e.message), baseUrl);
  }
  // So is one with a user name or password (fetch refuses it on every
  // request, quoting it whole), and the error never quotes the password.
  for (const baseUrl of ["http://u:s3cretPW@127.0.0.1:8080", "https://:s3cretPW@h", "ftp://u:s3cretPW@h", "u:s3cretPW@h:1"]) {
    assert.throws(() => new Redfence({ baseUrl }), (e) => e instanceof TypeError && !e.message.includes("s3cretPW"), baseUrl);
  }
  assert.throws(() => new Redfence({ baseUrl: "http://u:s3cretPW@h" }), (e) => /must not hold a user name or password/.test(e.message));
  // A cap below the server's default TTL is found on the grant, which is released.
  const { rf: rf2, count } = scripted((kind) => (kind === "acquire" ? grant(60_000) : noContent()));
  await assert.rejects(rf2.acquire("n", { maxHoldMs: 1000 }), (e) => e.kind === "invalid");
  assert.equal(count("release"), 1);
});

test("no request is sent after release", async () => {
  const { rf, calls } = scripted((kind) => (kind === "acquire" || kind === "extend" ? grant(300) : noContent()));
  const lease = await rf.acquire("n");
  await lease.release();
  const n = calls.length;
  await delay(600);
  assert.deepEqual(calls.slice(n), []);
});

test("an acquire can be cancelled with LockOptions.signal, and times out without an answer", async () => {
  const { rf } = scripted(() => new Promise(() => {})); // never answers, ignores abort
  const ac = new AbortController();
  const p = rf.acquire("n", { waitMs: 60_000, signal: ac.signal });
  const reason = new Error("shutting down");
  ac.abort(reason);
  await assert.rejects(p, (e) => e === reason); // the signal's reason, as fetch rejects: not a retryable "unavailable"

  const slow = scripted(() => new Promise(() => {}), { timeoutMs: 100 });
  const keepAlive = setInterval(() => undefined, 1000); // a real fetch's socket would keep the process up
  try {
    await assert.rejects(slow.rf.acquire("n"), (e) => e.kind === "unavailable" && /no answer in time/.test(e.message));
    // An acquire waits no longer than its wait plus its TTL, however long timeoutMs is.
    const hung = scripted(() => new Promise(() => {}), { timeoutMs: 3_600_000 });
    await assert.rejects(hung.rf.acquire("n", { ttlMs: 200, waitMs: 100 }), (e) => e.kind === "unavailable" && /no answer in time/.test(e.message));
  } finally {
    clearInterval(keepAlive);
  }
});

test("an API key a header cannot carry is refused without being quoted; local errors are invalid", async () => {
  assert.throws(() => new Redfence({ baseUrl: "http://x", apiKey: "rf_id_SuperSecret\nX: y" }), (e) => !String(e.message).includes("SuperSecret"));
  const { rf, count } = scripted(() => noContent());
  await assert.rejects(rf.putResource("n", 1, { big: 1n }), (e) => e.kind === "invalid" && e.status === 0);
  assert.equal(count("put"), 0);
});

test("no error or lease shows the lock token or the API key", async () => {
  const { rf } = scripted((kind) => (kind === "acquire" ? grant() : problem(409, "not-holder")));
  const lease = await rf.acquire("n");
  const err = await lease.release().catch((e) => e);
  for (const s of [JSON.stringify(lease), String(lease), JSON.stringify(err), String(err), err.stack, JSON.stringify(rf)]) {
    assert.ok(!s.includes("jzocnifUtgU") && !s.includes("secret"), s);
  }
});

/** Node's gc(), without --expose-gc on the command line. */
function gcFunction() {
  v8.setFlagsFromString("--expose-gc");
  return vm.runInNewContext("gc");
}

/** Settles with p's outcome, or with "pending" if p has not settled by ms. */
const within = (p, ms) => Promise.race([p.then(() => "resolved", (e) => e), delay(ms, "pending")]);

test("a request's timeout holds through garbage collections (an AbortSignal.timeout held only by AbortSignal.any is collected in Node 20)", async () => {
  const gc = gcFunction();
  const { rf } = scripted(() => new Promise(() => {}), { timeoutMs: 300 }); // never answers, ignores abort
  const collect = setInterval(gc, 20);
  try {
    const e = await within(rf.acquire("n"), 10_000);
    assert.ok(e instanceof RedfenceError && e.kind === "unavailable", `acquire with the server silent: ${e}; want it timed out`);
  } finally {
    clearInterval(collect);
  }
});

test("a renewal stuck on a dead connection is given up and tried again while the lease lasts", async () => {
  const { rf, count } = scripted((kind, n) => {
    if (kind === "acquire") return grant(3000);
    if (kind === "extend" && n === 1) return new Promise(() => {}); // a connection gone silent
    return kind === "extend" ? grant(3000) : noContent();
  });
  const lease = await rf.acquire("n"); // renews after 1 s; each try bounded by 1 s
  const keepAlive = setInterval(() => undefined, 1000);
  try {
    await within(new Promise((resolve) => { const t = setInterval(() => { if (count("extend") >= 2) { clearInterval(t); resolve(); } }, 10); }), 10_000);
    assert.ok(count("extend") >= 2, `${count("extend")} extends; want the stuck one tried again`);
    assert.equal(lease.held, true, "the lease was lost to one stuck renewal");
  } finally {
    clearInterval(keepAlive);
    await lease.release();
  }
});

test("withLock's release gives up once the lease has run out, not after timeoutMs", async () => {
  const { rf } = scripted((kind) => (kind === "acquire" ? grant(500) : new Promise(() => {})), { timeoutMs: 60_000 });
  const keepAlive = setInterval(() => undefined, 1000);
  try {
    const e = await within(rf.withLock("n", () => "done", { renewFraction: 0 }), 20_000);
    assert.ok(e instanceof RedfenceError && e.kind === "unavailable", `withLock with the release unanswered: ${e}; want it to give up as unavailable`);
  } finally {
    clearInterval(keepAlive);
  }
});

test("an acquire with waitMs tries again after an unavailable answer, with what is left of the wait", async () => {
  const waits = [];
  const { rf, count } = scripted(async (kind, n, req) => {
    if (kind !== "acquire") return noContent();
    waits.push((await req.json()).wait_ms);
    if (n === 1) return problem(503, "quorum-unavailable", { retry_after_ms: 20 });
    if (n === 2) throw new TypeError("fetch failed"); // not reached (a restart)
    return grant();
  });
  const lease = await rf.acquire("n", { waitMs: 30_000, renewFraction: 0 });
  assert.equal(count("acquire"), 3);
  assert.equal(waits[0], 30_000);
  assert.ok(waits[1] < waits[0] && waits[2] < waits[1], `wait_ms sent ${waits}: want what is left of the wait each time`);
  await lease.release();

  // Without a wait, or with a refusal that is not "unavailable", one try only.
  for (const [opts, res] of [
    [{}, () => problem(503, "quorum-unavailable", { retry_after_ms: 20 })],
    [{ waitMs: 30_000 }, () => problem(409, "wait-timeout", { retry_after_ms: 20 })],
    [{ waitMs: 30_000 }, () => problem(400, "invalid-request")],
  ]) {
    const once = scripted(res);
    await assert.rejects(once.rf.acquire("n", opts), RedfenceError);
    assert.equal(once.count("acquire"), 1, `${JSON.stringify(opts)}: sent again`);
  }
});

test("an acquire gives up at once when the server says it cannot succeed before the wait ends", async () => {
  // A quarantine ending in a minute, for a wait of 30 s.
  const { rf, count } = scripted(() => problem(503, "quorum-unavailable", { retry_after_ms: 60_000 }, { "retry-after": "60" }));
  await assert.rejects(rf.acquire("n", { waitMs: 30_000 }), (e) => e.kind === "unavailable" && e.retryAfterMs === 60_000);
  assert.equal(count("acquire"), 1);
});

test("an acquire waiting to try again ends with its signal's reason", async () => {
  // The 503's body signals once it has been read to its end: what is left
  // before the acquire waits to try again (30 s away) is microtasks, which
  // all run before the next macrotask (setImmediate).
  let read;
  const bodyRead = new Promise((resolve) => { read = resolve; });
  const { rf, count } = scripted(() => {
    const text = new TextEncoder().encode(JSON.stringify({ type: "urn:redfence:problem:shutting-down", title: "t", status: 503 }));
    const body = new ReadableStream({
      start(c) { c.enqueue(text); },
      pull(c) { c.close(); read(); },
    });
    return new Response(body, { status: 503, headers: { "content-type": "application/problem+json", "retry-after": "30" } });
  });
  const ac = new AbortController();
  const p = rf.acquire("n", { waitMs: 60_000, signal: ac.signal });
  await bodyRead;
  await new Promise((resolve) => setImmediate(resolve));
  assert.equal(count("acquire"), 1);
  const reason = new Error("stop");
  ac.abort(reason);
  assert.equal(await within(p, 5_000), reason); // now, not once the 30 s are over
  assert.equal(count("acquire"), 1);
});
