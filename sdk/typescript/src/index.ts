/**
 * TypeScript client for Redfence.
 *
 * - `Redfence#api` is an openapi-fetch client typed by `schema.ts`, which
 *   openapi-typescript generates from openapi.yaml (never edited by hand):
 *   every operation of the HTTP API, fully typed.
 * - `Redfence#withLock(name, fn)` acquires a lock, runs `fn` with the lease,
 *   renews the lease while `fn` runs and always releases it.
 *
 * A lease is a lease: it can end while this process is paused and does not
 * notice. `lease.signal` aborts as soon as a renewal learns the lease is lost,
 * or when its deadline (your send time + `validity_ms`, on a monotonic clock)
 * passes; but only storage that checks `lease.fencingToken` keeps data safe.
 */
import createClient, { type Client } from "openapi-fetch";

import type { components, paths } from "./schema.js";

export type { components, paths } from "./schema.js";

/** The problem document of an error answer (RFC 9457). */
export type Problem = components["schemas"]["Problem"];

/** A document of the reference store: any JSON value (object, array, string, number, boolean or null). */
export type JsonValue = components["schemas"]["PutResourceRequest"]["data"];

/** What kind of failure a RedfenceError is; stable across problem types. */
export type ErrorKind =
  | "held" // lock-held, wait-timeout
  | "lost" // lock-lost, not-holder, or the lease's deadline passed
  | "stale" // stale-token
  | "precondition" // precondition-failed: the document is at another version (If-Match, If-None-Match)
  | "unavailable" // quorum-unavailable, fencing-unavailable, lease-expired, store-unavailable, shutting-down, request-timeout, 5xx, 429, network, timeout
  | "invalid" // invalid-request, request-too-large, unsupported-media-type; a request that could not be sent as asked
  | "not-found" // resource-not-found, not-found
  | "denied" // 401, 403
  | "unknown";

const PREFIX = "urn:redfence:problem:";

const KINDS: Record<string, ErrorKind> = {
  "lock-held": "held",
  "wait-timeout": "held",
  "lock-lost": "lost",
  "not-holder": "lost",
  "stale-token": "stale",
  "precondition-failed": "precondition",
  "quorum-unavailable": "unavailable",
  "fencing-unavailable": "unavailable",
  "lease-expired": "unavailable",
  "store-unavailable": "unavailable",
  "shutting-down": "unavailable",
  "request-timeout": "unavailable",
  "invalid-request": "invalid",
  "request-too-large": "invalid",
  "unsupported-media-type": "invalid",
  "method-not-allowed": "invalid",
  "not-found": "not-found",
  "resource-not-found": "not-found",
};

function kindOf(slug: string, status: number): ErrorKind {
  const k = KINDS[slug];
  if (k) return k;
  if (status === 401 || status === 403) return "denied";
  if (status === 429 || status >= 500 || status === 0) return "unavailable";
  if (status === 404) return "not-found";
  if (status >= 400 && status !== 409) return "invalid";
  return "unknown";
}

/** What a RedfenceError is made from. */
export interface ErrorInit {
  /**
   * The body of the error answer: used as the problem document when it is
   * one (an object with a string `type`); anything else (a proxy's HTML page,
   * an empty body) is ignored.
   */
  problem?: unknown;
  /** The answer, for its Retry-After header when the body has no retry_after_ms. */
  response?: Response | undefined;
  /** The underlying error (network failure). */
  cause?: unknown;
  /** A message when there is no problem document. */
  detail?: string;
  /** Overrides the kind derived from the problem type and status. */
  kind?: ErrorKind;
}

function isProblem(v: unknown): v is Problem {
  return typeof v === "object" && v !== null && typeof (v as { type?: unknown }).type === "string";
}

/** Parses a Retry-After header (delay-seconds or an HTTP date) into ms; 0 if absent or unreadable. */
function retryAfterHeader(v: string | null | undefined): number {
  if (!v) return 0;
  const t = v.trim();
  if (/^\d+$/.test(t)) return Number(t) * 1000;
  const at = Date.parse(t);
  return Number.isNaN(at) ? 0 : Math.max(at - Date.now(), 0);
}

/** An error answer of Redfence, or a failure to reach it. */
export class RedfenceError extends Error {
  /** held, lost, stale, unavailable, ... */
  readonly kind: ErrorKind;
  /** The HTTP status; 0 when the server was not reached. */
  readonly status: number;
  /** The problem type slug (lock-held, stale-token, ...); "" if none. */
  readonly slug: string;
  /** The problem document, when the answer was one. */
  readonly problem: Problem | undefined;
  /** When trying again may succeed, in milliseconds (0: unknown). */
  readonly retryAfterMs: number;
  /** The newest fencing token issued (stale-token). */
  readonly currentFencingToken: number | undefined;
  /** The document's version (precondition-failed); undefined when there is no document. */
  readonly currentVersion: number | undefined;

  constructor(op: string, name: string, status: number, init: ErrorInit = {}) {
    const { cause, detail } = init;
    const problem = isProblem(init.problem) ? init.problem : undefined;
    const slug = problem?.type.startsWith(PREFIX) ? problem.type.slice(PREFIX.length) : "";
    // Not reached: the cause says why, unless a detail does.
    const what = status !== 0 ? (slug ? `${status} ${slug}` : `HTTP ${status}`) : cause !== undefined && !detail ? `unreachable: ${String(cause)}` : "";
    const text = problem?.detail ?? detail;
    const msg = [what, text].filter(Boolean).join(": ");
    super(`redfence: ${op} "${name}": ${msg}`, cause === undefined ? undefined : { cause });
    this.name = "RedfenceError";
    this.status = status;
    this.slug = slug;
    this.problem = problem;
    this.kind = init.kind ?? kindOf(slug, status);
    this.retryAfterMs = problem?.retry_after_ms ?? retryAfterHeader(init.response?.headers.get("Retry-After"));
    this.currentFencingToken = problem?.current_fencing_token;
    this.currentVersion = problem?.current_version;
  }
}

export interface RedfenceOptions {
  /** The server's base URL, e.g. "http://127.0.0.1:8080". */
  baseUrl: string;
  /** Sent as "Authorization: Bearer <apiKey>" when set. */
  apiKey?: string;
  /** Labels every lease unless LockOptions.owner is set. */
  owner?: string;
  /** A fetch implementation (default: globalThis.fetch). */
  fetch?: (input: Request) => Promise<Response>;
  /**
   * How long one request may take before it fails with kind "unavailable",
   * in ms (default 30 000); an acquire gets its waitMs on top. A renewal try
   * is bounded instead by half the renewal interval (1 s at least) and the
   * lease's deadline, so one stuck on a dead connection is tried again in
   * time; withLock's release, by the lease's time left (1 s at least).
   */
  timeoutMs?: number;
}

export interface LockOptions {
  /** Lease length in ms, also of every renewal (default: the server's default TTL). */
  ttlMs?: number;
  /** How long to wait while the lock is held, in ms (default 0: try once). At most the server's max wait. */
  waitMs?: number;
  /** Owner label (not a secret). */
  owner?: string;
  /**
   * Renew after this fraction of the TTL (default 1/3), in [0, 1) (else
   * kind "invalid"); 0 turns renewal off.
   * Renewal goes on until the lease is released or lost, as Redisson's
   * watchdog does: a lease from a bare `acquire()` that is never released
   * stays held while this process runs (bound it with maxHoldMs).
   */
  renewFraction?: number;
  /**
   * Stop renewing once a renewal would hold the lock longer than this, in ms
   * (default: no cap). Not less than the TTL (kind "invalid").
   */
  maxHoldMs?: number;
  /** Ends an acquire that is still waiting (it rejects with the signal's reason, as fetch does); no effect once granted. */
  signal?: AbortSignal;
}

/** Options of a write to the reference store (putResource). */
export interface PutOptions {
  /**
   * Write only if the document is at this version (`If-Match: "<version>"`),
   * or, with 0, only if there is no document yet (`If-None-Match: *`);
   * otherwise reject with kind "precondition". Default: write whatever the
   * version.
   */
  version?: number;
}

type Grant = components["schemas"]["LockResponse"];

/** The reason a lease's signal carries when its holder released it. */
const releasedReason = (name: string) =>
  new RedfenceError("release", name, 0, { detail: "the lease was released", kind: "lost" });

/** Reasons that mean "released by its holder", not lost. */
const released = new WeakSet<object>();

/** A moment by both clocks: monotonic (performance.now()) and wall (Date.now()), in ms. */
interface Instant {
  mono: number;
  wall: number;
}

function instant(): Instant {
  return { mono: performance.now(), wall: Date.now() };
}

/**
 * Runs a request with a timeout and an optional caller's signal: the
 * signal is given to fetch, and the promise also settles when it aborts,
 * even with a fetch that ignores it.
 */
function bounded<T>(run: (signal: AbortSignal) => Promise<T>, timeoutMs: number, outer?: AbortSignal): Promise<T> {
  if (outer?.aborted) return Promise.reject(outer.reason);
  // A timer and a controller of its own, held until the request settles:
  // Node 20 lets a garbage collection drop an AbortSignal.timeout that only
  // AbortSignal.any holds, and the request then waits for ever
  // (nodejs/node#57736).
  const ctrl = new AbortController();
  const signal = ctrl.signal;
  const timer = setTimeout(
    () => ctrl.abort(new DOMException("The operation was aborted due to timeout", "TimeoutError")),
    Math.max(Math.ceil(timeoutMs), 1),
  );
  const onOuter = () => ctrl.abort(outer?.reason);
  outer?.addEventListener("abort", onOuter, { once: true });
  let onAbort: () => void = () => undefined;
  const aborted = new Promise<never>((_, reject) => {
    onAbort = () => reject(signal.reason);
    signal.addEventListener("abort", onAbort, { once: true });
  });
  return Promise.race([run(signal), aborted]).finally(() => {
    clearTimeout(timer);
    outer?.removeEventListener("abort", onOuter);
    signal.removeEventListener("abort", onAbort);
  });
}

/**
 * The error for a request that got no answer: the signal's reason when
 * outer (the caller's signal, or a lease's) ended it, as fetch rejects;
 * else a RedfenceError, unreachable or timed out.
 */
function noAnswer(op: string, name: string, cause: unknown, outer?: AbortSignal): unknown {
  if (outer?.aborted && cause === outer.reason) return cause;
  if (cause instanceof DOMException && cause.name === "TimeoutError") {
    return new RedfenceError(op, name, 0, { detail: "no answer in time", kind: "unavailable" });
  }
  return new RedfenceError(op, name, 0, { cause });
}

/**
 * baseUrl (base, parsed) quoted for an error, without the user name and
 * password it may hold: errors are logged. One that holds an "@" but did not
 * parse into them is not quoted.
 */
function quoteBaseUrl(baseUrl: string, base: URL | undefined): string {
  if (base && (base.username || base.password)) {
    const shown = new URL(base.href);
    shown.username = "";
    shown.password = "";
    return `${JSON.stringify(shown.href)} (user name and password not shown)`;
  }
  return baseUrl.includes("@") ? "(not quoted: it may hold a password)" : JSON.stringify(baseUrl);
}

/** The error of an acquire of name refused before it was sent, or of a grant refused on arrival. */
function invalidAcquire(name: string, detail: string): RedfenceError {
  return new RedfenceError("acquire", name, 0, { detail, kind: "invalid" });
}

/** Waits ms, or rejects with signal's reason once it aborts (as fetch does). */
function pause(ms: number, signal?: AbortSignal): Promise<void> {
  if (signal?.aborted) return Promise.reject(signal.reason);
  return new Promise((resolve, reject) => {
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, Math.max(Math.ceil(ms), 0));
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/** A held lock. Send `fencingToken` with every write made under it. */
export class Lease {
  readonly name: string;
  readonly fencingToken: number;
  readonly owner: string;
  readonly ttlMs: number;
  /**
   * Aborted when the lease ends: lost, run out, or released (`signal.reason`
   * says which). Like `AbortSignal.timeout`, a bare `acquire()` lease's timers
   * do not hold Node's event loop open: code that waits only on this signal
   * should run in `withLock`, which does.
   */
  readonly signal: AbortSignal;

  #rf: Redfence;
  #lockToken: string;
  #deadline: number; // performance.now() ms
  #wallDeadline: number; // Date.now() ms
  #acquired: number;
  #opts: LockOptions;
  #abort = new AbortController();
  #renewTimer: ReturnType<typeof setTimeout> | undefined;
  #expiryTimer: ReturnType<typeof setTimeout> | undefined;
  #lastRenewError: RedfenceError | undefined;
  // The release under way, or the one that settled it for good (deleted,
  // or nothing held); a release that failed otherwise may be tried again.
  #release: Promise<void> | undefined;

  /** @internal */
  constructor(rf: Redfence, name: string, lockToken: string, g: Grant, sent: Instant, opts: LockOptions) {
    this.#rf = rf;
    this.name = name;
    this.#lockToken = lockToken;
    this.fencingToken = g.fencing_token;
    this.owner = g.owner;
    this.ttlMs = g.ttl_ms;
    this.#deadline = sent.mono + g.validity_ms;
    this.#wallDeadline = sent.wall + g.validity_ms;
    this.#acquired = sent.mono;
    this.#opts = opts;
    this.signal = this.#abort.signal;
    if (this.remainingMs > 0) this.#schedule();
  }

  /**
   * Milliseconds left until the deadline (send time + validity_ms); negative
   * once passed by either clock: the monotonic one (performance.now()) stops
   * while the machine is suspended, and the Redis nodes' expiry does not, so
   * after a suspend only the wall clock (Date.now()) knows the lease ran out.
   * A wall clock stepped forward can only end a lease early.
   */
  get remainingMs(): number {
    return Math.min(this.#deadline - performance.now(), this.#wallDeadline - Date.now());
  }

  /** The deadline as a wall-clock Date, for display. */
  get deadline(): Date {
    return new Date(Date.now() + this.remainingMs);
  }

  /**
   * Whether the lease still lasts: not lost, not released, and its deadline
   * not passed (checked now, not only when the expiry timer runs: after a
   * pause, I/O callbacks may run before timers).
   */
  get held(): boolean {
    if (!this.signal.aborted && this.remainingMs <= 0) this.#expire();
    return !this.signal.aborted;
  }

  /**
   * Arms the expiry timer: at the deadline, or in a second if that is
   * later, so that a lease that ran out during a suspend (timers stop with
   * the monotonic clock) ends within a second of the resume.
   */
  #armExpiry(): void {
    clearTimeout(this.#expiryTimer);
    this.#expiryTimer = setTimeout(() => this.#expire(), Math.min(Math.max(this.remainingMs, 0), 1000));
    this.#expiryTimer.unref?.();
  }

  #schedule(): void {
    this.#armExpiry();
    const fraction = this.#opts.renewFraction ?? 1 / 3;
    if (fraction <= 0) return;
    const renewIn = this.remainingMs - this.ttlMs * (1 - fraction);
    const cap = this.#opts.maxHoldMs;
    if (cap !== undefined && performance.now() + Math.max(renewIn, 0) + this.ttlMs - this.#acquired > cap) return;
    clearTimeout(this.#renewTimer);
    this.#renewTimer = setTimeout(() => void this.#renew(), Math.max(renewIn, 0));
    this.#renewTimer.unref?.();
  }

  #expire(): void {
    if (this.signal.aborted) return;
    if (this.remainingMs > 0) {
      this.#armExpiry();
      return;
    }
    const last = this.#lastRenewError;
    this.#end(new RedfenceError("lease", this.name, 0, {
      detail: last ? `the deadline passed without a renewal (the last one failed: ${last.message})` : "the deadline passed without a renewal",
      kind: "lost",
      ...(last ? { cause: last } : {}),
    }));
  }

  #end(reason: unknown): void {
    clearTimeout(this.#renewTimer);
    clearTimeout(this.#expiryTimer);
    if (!this.signal.aborted) this.#abort.abort(reason);
  }

  async #renew(): Promise<void> {
    if (!this.held) return;
    try {
      // Each try is bounded by half the renewal interval (1 s at least), not
      // only by the deadline: one stuck on a connection that went dead
      // without a word is given up in time to try again on a new one.
      const interval = this.ttlMs * (this.#opts.renewFraction ?? 1 / 3);
      await this.#extend(this.ttlMs, Math.min(this.remainingMs, Math.max(interval / 2, 1000)));
      this.#lastRenewError = undefined;
    } catch (err) {
      if (this.signal.aborted) return;
      if (err instanceof RedfenceError) {
        this.#lastRenewError = err;
        if (err.kind === "denied" || err.kind === "invalid") {
          // Asking again cannot succeed (a revoked key, say): the lease
          // ends now, with the reason, rather than at its deadline.
          this.#end(err);
          return;
        }
      }
      // Not decided (unavailable): retry soon, while time is left.
      clearTimeout(this.#renewTimer);
      let delay = Math.min(Math.max(this.ttlMs / 12, 50), 1000, Math.max(this.remainingMs / 2, 10));
      if (err instanceof RedfenceError && err.retryAfterMs > 0) delay = Math.min(Math.max(delay, err.retryAfterMs), Math.max(this.remainingMs / 2, 10));
      this.#renewTimer = setTimeout(() => void this.#renew(), delay);
      this.#renewTimer.unref?.();
    }
  }

  /**
   * Renews the lease now for ttlMs (default: its TTL); a RedfenceError of
   * kind "lost" means it is gone (and has ended). The server keeps the
   * longer of the lease's remaining time and ttlMs: extend cannot shorten
   * a lease.
   */
  async extend(ttlMs = this.ttlMs): Promise<void> {
    if (!this.held) throw this.signal.reason;
    return this.#extend(ttlMs, this.remainingMs);
  }

  /** extend, its request bounded by limitMs (and by the lease's end). */
  async #extend(ttlMs: number, limitMs: number): Promise<void> {
    if (!this.held) throw this.signal.reason;
    const sent = instant();
    const { data, error, response } = await bounded(
      (signal) => this.#rf.api.POST("/v1/locks/{name}/extend", {
        params: { path: { name: this.name }, header: { "Lock-Token": this.#lockToken } },
        body: { ttl_ms: ttlMs },
        signal,
      }),
      limitMs,
      this.signal,
    ).catch((cause: unknown) => {
      // Released or lost meanwhile, or cut short by the lease's end
      // (whichever timer ran first): the lease's reason (kind "lost").
      if (!this.held) throw this.signal.reason;
      throw noAnswer("extend", this.name, cause, this.signal);
    });
    if (!data) {
      const err = new RedfenceError("extend", this.name, response.status, { problem: error, response });
      if (err.kind === "lost") this.#end(err);
      throw err;
    }
    if (data.fencing_token !== this.fencingToken) {
      const err = new RedfenceError("extend", this.name, response.status, { detail: "renewed with another fencing token", kind: "lost" });
      this.#end(err);
      throw err;
    }
    // It may have ended while the renewal was on its way (released, or
    // its deadline passed): the server's new lease is then nobody's.
    if (this.signal.aborted) throw this.signal.reason;
    this.#deadline = sent.mono + data.validity_ms;
    this.#wallDeadline = sent.wall + data.validity_ms;
    this.#schedule();
  }

  /**
   * Stops renewal, ends the lease (its signal aborts, released) and deletes
   * the lock. Resolves when it was deleted; rejects with kind "lost" if it
   * was already gone. When the server could not be asked (kind
   * "unavailable"), the lock runs out at its deadline unless a later call,
   * which sends the delete again, succeeds. A call while one is under way,
   * or after one that settled it, returns that one's outcome.
   */
  release(): Promise<void> {
    return this.releaseWithin(this.#rf.timeoutMs);
  }

  /**
   * @internal release, its request bounded by limitMs (at most the
   * client's timeoutMs).
   */
  releaseWithin(limitMs: number): Promise<void> {
    if (this.#release) return this.#release;
    const reason = releasedReason(this.name);
    released.add(reason); // a release, not a loss (see withLock)
    this.#end(reason);
    const p = (async () => {
      const { error, response } = await bounded(
        (signal) => this.#rf.api.DELETE("/v1/locks/{name}", {
          params: { path: { name: this.name }, header: { "Lock-Token": this.#lockToken } },
          signal,
        }),
        Math.min(limitMs, this.#rf.timeoutMs),
      ).catch((cause: unknown) => {
        throw noAnswer("release", this.name, cause);
      });
      if (response.status !== 204) {
        throw new RedfenceError("release", this.name, response.status, { problem: error, response });
      }
    })();
    this.#release = p;
    p.catch((err: unknown) => {
      if (!(err instanceof RedfenceError) || err.kind !== "lost") this.#release = undefined; // may be tried again
    });
    return p;
  }
}

/**
 * Releases lease, sending the release again after an "unavailable" failure
 * (after its Retry-After, 100 ms at least) while the lease's time lasts:
 * after that the lock has run out by itself. A release sent again that
 * finds nothing held (not-holder) before the deadline is the release done:
 * an earlier one whose answer was lost may have deleted it, and either way
 * the lock is no longer this lease's.
 */
async function releaseRetrying(lease: Lease): Promise<void> {
  const end = performance.now() + Math.max(lease.remainingMs, 0);
  for (let again = false; ; again = true) {
    try {
      // Each try bounded by the lease's time left (1 s at least): after it
      // the lock runs out by itself, and the caller need not wait on.
      await lease.releaseWithin(Math.max(end - performance.now(), 1000));
      return;
    } catch (err) {
      if (again && err instanceof RedfenceError && err.kind === "lost" && performance.now() < end) return;
      const wait = err instanceof RedfenceError && err.kind === "unavailable" ? Math.max(err.retryAfterMs, 100) : -1;
      if (wait < 0 || performance.now() + wait >= end) throw err;
      await new Promise((r) => setTimeout(r, wait));
    }
  }
}

/** Whether reason (a lease signal's) says the holder released it. */
function isReleased(reason: unknown): boolean {
  return typeof reason === "object" && reason !== null && released.has(reason);
}

/** A Redfence client: the generated API client plus leases. */
export class Redfence {
  /** The openapi-fetch client, typed by the types generated from openapi.yaml. */
  readonly api: Client<paths>;
  readonly #owner: string | undefined;
  /** @internal */
  readonly timeoutMs: number;

  constructor(opts: RedfenceOptions) {
    let base: URL | undefined;
    try {
      base = new URL(opts.baseUrl);
    } catch {
      base = undefined;
    }
    if (!base || (base.protocol !== "http:" && base.protocol !== "https:")) {
      // Caught here: fetch's failure would read as an unreachable server
      // (kind "unavailable"), and an acquire would retry it while it waits.
      throw new TypeError(`redfence: baseUrl must be an absolute http or https URL, like "http://127.0.0.1:8080", not ${quoteBaseUrl(opts.baseUrl, base)}`);
    }
    if (base.username || base.password) {
      // fetch refuses every request to such a URL, with an error quoting
      // it, password and all, that would read as an unreachable server.
      throw new TypeError(`redfence: baseUrl must not hold a user name or password (fetch refuses such a URL): ${quoteBaseUrl(opts.baseUrl, base)}`);
    }
    const headers: Record<string, string> = {};
    if (opts.apiKey) {
      // Checked here, without quoting it: fetch's own error would.
      if (!/^[\x21-\x7e]+$/.test(opts.apiKey)) throw new TypeError("redfence: the API key has characters a header cannot carry (whitespace or non-ASCII)");
      headers.Authorization = `Bearer ${opts.apiKey}`;
    }
    this.api = createClient<paths>({ baseUrl: opts.baseUrl, headers, ...(opts.fetch ? { fetch: opts.fetch } : {}) });
    this.#owner = opts.owner;
    this.timeoutMs = opts.timeoutMs ?? 30_000;
  }

  /**
   * Takes the lock on name; rejects with a RedfenceError (kind "held" when it
   * is taken, "lost" when the grant's validity ran out before its answer
   * arrived: it is released again). The lease renews itself until released
   * or lost (see LockOptions.renewFraction). With waitMs, an answer of kind
   * "unavailable" (no server reached, too few nodes, shutting down) is tried
   * again after its retryAfterMs while the wait lasts, unless that ends
   * after the wait does.
   */
  async acquire(name: string, opts: LockOptions = {}): Promise<Lease> {
    const invalid = (detail: string) => invalidAcquire(name, detail);
    const { renewFraction: f, maxHoldMs, ttlMs, waitMs } = opts;
    if (f !== undefined && !(f >= 0 && f < 1)) throw invalid(`renewFraction ${f} is outside [0, 1)`);
    if (waitMs !== undefined && !(Number.isFinite(waitMs) && waitMs >= 0)) throw invalid(`waitMs ${waitMs} is not a finite number of ms, 0 or more`);
    if (maxHoldMs !== undefined && ttlMs !== undefined && !(maxHoldMs >= ttlMs)) {
      throw invalid(`maxHoldMs ${maxHoldMs} is shorter than ttlMs ${ttlMs}: the first lease would outlast it`);
    }
    const owner = opts.owner ?? this.#owner;
    const waitEnd = performance.now() + (waitMs ?? 0);
    let backoff = 50;
    for (let tries = 0; ; tries++) {
      // The wait asked for, then what is left of it.
      const wait = waitMs === undefined || tries === 0 ? waitMs : Math.max(Math.floor(waitEnd - performance.now()), 0);
      try {
        return await this.#acquireOnce(name, opts, owner, wait);
      } catch (err) {
        // Not reached, or it could not decide (a restart, a majority of
        // nodes down, shutting down): try again while the wait lasts, as the
        // Go client does, unless the server said it cannot succeed before
        // the wait ends (quarantines ending later: every other 503 says
        // "in a second").
        const left = waitEnd - performance.now();
        if (!(err instanceof RedfenceError) || err.kind !== "unavailable" || left <= 0) throw err;
        if (err.retryAfterMs > 1000 && err.retryAfterMs > left) throw err;
        // Jittered, so clients told the same Retry-After do not all come back at once.
        const base = Math.max(backoff, err.retryAfterMs);
        backoff = Math.min(2 * backoff, 1000);
        await pause(Math.min(base + Math.random() * (base / 5), left), opts.signal);
      }
    }
  }

  /** One acquire request, sent with waitMs as its wait_ms. */
  async #acquireOnce(name: string, opts: LockOptions, owner: string | undefined, waitMs: number | undefined): Promise<Lease> {
    const { maxHoldMs, ttlMs } = opts;
    const body: components["schemas"]["AcquireRequest"] = {};
    if (ttlMs !== undefined) body.ttl_ms = ttlMs;
    if (waitMs !== undefined) body.wait_ms = waitMs;
    if (owner) body.owner = owner;
    const sent = instant();
    const { data, error, response } = await bounded(
      (signal) => this.api.POST("/v1/locks/{name}", { params: { path: { name } }, body, signal }),
      // An answer later than the wait plus the TTL grants nothing that lasts.
      Math.min(this.timeoutMs, ttlMs ?? Infinity) + (waitMs ?? 0),
      opts.signal,
    ).catch((cause: unknown) => {
      throw noAnswer("acquire", name, cause, opts.signal);
    });
    if (!data) throw new RedfenceError("acquire", name, response.status, { problem: error, response });
    if (!data.lock_token) throw new RedfenceError("acquire", name, response.status, { detail: "the answer has no lock_token" });
    const lease = new Lease(this, name, data.lock_token, data, sent, opts);
    if (maxHoldMs !== undefined && !(maxHoldMs >= lease.ttlMs)) {
      // The server's default TTL outlasts the cap: not handed out.
      await lease.release().catch(() => undefined);
      throw invalidAcquire(name, `maxHoldMs ${maxHoldMs} is shorter than the server's default TTL ${lease.ttlMs} (the grant was released)`);
    }
    if (!lease.held) {
      // Granted, but its validity ran out before the answer arrived (a
      // pause, a slow network): never handed out as held.
      await lease.release().catch(() => undefined);
      throw new RedfenceError("acquire", name, response.status, {
        detail: "the grant's validity ran out before its answer arrived (it was released)", kind: "lost",
      });
    }
    return lease;
  }

  /**
   * Acquires the lock on name, runs fn with the lease (use `lease.signal` to
   * stop when it ends and `lease.fencingToken` for writes), renews it while
   * fn runs, and always releases it (a release the server could not answer
   * is retried while the lease lasts). Resolves to fn's result; rejects with
   * fn's error, with a "lost" RedfenceError if the lease was lost (or its
   * deadline passed) before fn returned, or with the release's error.
   */
  async withLock<T>(name: string, fn: (lease: Lease) => Promise<T> | T, opts: LockOptions = {}): Promise<T> {
    const lease = await this.acquire(name, opts);
    let result: T;
    // A lease's own timers do not hold the process open (unref), but while
    // fn runs its renewals must go on even if fn waits on nothing else
    // (e.g. only on lease.signal): keep the event loop alive until it ends.
    const keepAlive = setInterval(() => undefined, 2 ** 30);
    try {
      result = await fn(lease);
    } catch (err) {
      await releaseRetrying(lease).catch(() => undefined);
      throw err;
    } finally {
      clearInterval(keepAlive);
    }
    const held = lease.held; // checks the deadline now
    // fn may have released it itself: that is no loss.
    const lost = held || isReleased(lease.signal.reason) ? undefined : lease.signal.reason;
    try {
      await releaseRetrying(lease);
    } catch (err) {
      // A loss is what the caller must hear of; a "lost" answer to fn's
      // own release, fn heard already.
      if (!lost && (held || !(err instanceof RedfenceError) || err.kind !== "lost")) throw err;
    }
    if (lost) throw lost;
    return result;
  }

  /**
   * Writes data to the reference store with a fencing token; rejects with
   * kind "stale" when a newer token exists. With `opts.version` it is a
   * compare-and-set on the document's version, for a read-modify-write by
   * several workers sharing one grant: it applies only if the document is
   * at that version (If-Match), or, with 0, only if there is none yet
   * (If-None-Match: *); otherwise nothing is written and it rejects with
   * kind "precondition" and `currentVersion` (undefined: no document). A
   * stale token is refused first (kind "stale").
   */
  async putResource(name: string, fencingToken: number, data: JsonValue, opts: PutOptions = {}): Promise<components["schemas"]["Resource"]> {
    try {
      JSON.stringify(data);
    } catch (cause) {
      throw new RedfenceError("put", name, 0, { cause, detail: "data is not JSON", kind: "invalid" });
    }
    const { version } = opts;
    if (version !== undefined && !(Number.isSafeInteger(version) && version >= 0)) {
      throw new RedfenceError("put", name, 0, { detail: `version ${version}: must be an integer, at least 0`, kind: "invalid" });
    }
    const header = version === undefined ? undefined : version === 0 ? { "If-None-Match": "*" } : { "If-Match": `"${version}"` };
    const { data: res, error, response } = await bounded(
      (signal) => this.api.PUT("/v1/resources/{name}", { params: { path: { name }, header }, body: { fencing_token: fencingToken, data }, signal }),
      this.timeoutMs,
    ).catch((cause: unknown) => {
      throw noAnswer("put", name, cause);
    });
    if (!res) throw new RedfenceError("put", name, response.status, { problem: error, response });
    return res;
  }
}
