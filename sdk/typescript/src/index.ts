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
  | "unavailable" // quorum-unavailable, fencing-unavailable, lease-expired, store-unavailable, shutting-down, 5xx, 429, network
  | "invalid" // invalid-request, request-too-large, unsupported-media-type
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
  "quorum-unavailable": "unavailable",
  "fencing-unavailable": "unavailable",
  "lease-expired": "unavailable",
  "store-unavailable": "unavailable",
  "shutting-down": "unavailable",
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
  /** The problem document of the answer, if it was one. */
  problem?: Problem | undefined;
  /** The underlying error (network failure). */
  cause?: unknown;
  /** A message when there is no problem document. */
  detail?: string;
  /** Overrides the kind derived from the problem type and status. */
  kind?: ErrorKind;
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

  constructor(op: string, name: string, status: number, init: ErrorInit = {}) {
    const { problem, cause, detail } = init;
    const slug = problem?.type.startsWith(PREFIX) ? problem.type.slice(PREFIX.length) : "";
    const what = status !== 0 ? (slug ? `${status} ${slug}` : `HTTP ${status}`) : cause !== undefined ? `unreachable: ${String(cause)}` : "";
    const text = problem?.detail ?? detail;
    const msg = [what, text].filter(Boolean).join(": ");
    super(`redfence: ${op} "${name}": ${msg}`, cause === undefined ? undefined : { cause });
    this.name = "RedfenceError";
    this.status = status;
    this.slug = slug;
    this.problem = problem;
    this.kind = init.kind ?? kindOf(slug, status);
    this.retryAfterMs = problem?.retry_after_ms ?? 0;
    this.currentFencingToken = problem?.current_fencing_token;
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
}

export interface LockOptions {
  /** Lease length in ms, also of every renewal (default: the server's default TTL). */
  ttlMs?: number;
  /** How long to wait while the lock is held, in ms (default 0: try once). At most the server's max wait. */
  waitMs?: number;
  /** Owner label (not a secret). */
  owner?: string;
  /** Renew after this fraction of the TTL (default 1/3); 0 turns renewal off. */
  renewFraction?: number;
  /** Stop renewing once a renewal would hold the lock longer than this, in ms (default: no cap). */
  maxHoldMs?: number;
}

type Grant = components["schemas"]["LockResponse"];

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
  #acquired: number;
  #opts: LockOptions;
  #abort = new AbortController();
  #renewTimer: ReturnType<typeof setTimeout> | undefined;
  #expiryTimer: ReturnType<typeof setTimeout> | undefined;
  #released: Promise<void> | undefined;

  /** @internal */
  constructor(rf: Redfence, name: string, lockToken: string, g: Grant, sent: number, opts: LockOptions) {
    this.#rf = rf;
    this.name = name;
    this.#lockToken = lockToken;
    this.fencingToken = g.fencing_token;
    this.owner = g.owner;
    this.ttlMs = g.ttl_ms;
    this.#deadline = sent + g.validity_ms;
    this.#acquired = sent;
    this.#opts = opts;
    this.signal = this.#abort.signal;
    this.#schedule();
  }

  /** Milliseconds left until the deadline (send time + validity_ms); negative once passed. */
  get remainingMs(): number {
    return this.#deadline - performance.now();
  }

  /** The deadline as a wall-clock Date, for display. */
  get deadline(): Date {
    return new Date(Date.now() + this.remainingMs);
  }

  /** Whether the lease still lasts. */
  get held(): boolean {
    return !this.signal.aborted;
  }

  #schedule(): void {
    clearTimeout(this.#expiryTimer);
    this.#expiryTimer = setTimeout(() => this.#expire(), Math.max(this.remainingMs, 0));
    this.#expiryTimer.unref?.();
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
    if (this.remainingMs > 0) {
      this.#schedule();
      return;
    }
    this.#end(new RedfenceError("lease", this.name, 0, { detail: "the deadline passed without a renewal", kind: "lost" }));
  }

  #end(reason: unknown): void {
    clearTimeout(this.#renewTimer);
    clearTimeout(this.#expiryTimer);
    this.#abort.abort(reason);
  }

  async #renew(): Promise<void> {
    if (this.signal.aborted) return;
    try {
      await this.extend();
    } catch (err) {
      if (this.signal.aborted) return;
      // Not decided (unavailable): retry soon, while time is left.
      clearTimeout(this.#renewTimer);
      const delay = Math.min(Math.max(this.ttlMs / 12, 50), 1000, Math.max(this.remainingMs / 2, 10));
      this.#renewTimer = setTimeout(() => void this.#renew(), delay);
      this.#renewTimer.unref?.();
    }
  }

  /** Renews the lease now; a RedfenceError of kind "lost" means it is gone (and has ended). */
  async extend(ttlMs = this.ttlMs): Promise<void> {
    if (this.signal.aborted) throw this.signal.reason;
    const sent = performance.now();
    const { data, error, response } = await this.#rf.api.POST("/v1/locks/{name}/extend", {
      params: { path: { name: this.name }, header: { "Lock-Token": this.#lockToken } },
      body: { ttl_ms: ttlMs },
      signal: AbortSignal.any([this.signal, AbortSignal.timeout(Math.max(Math.ceil(this.remainingMs), 1))]),
    }).catch((cause: unknown) => {
      throw new RedfenceError("extend", this.name, 0, { cause });
    });
    if (!data) {
      const err = new RedfenceError("extend", this.name, response.status, { problem: error as Problem | undefined });
      if (err.kind === "lost") this.#end(err);
      throw err;
    }
    if (data.fencing_token !== this.fencingToken) {
      const err = new RedfenceError("extend", this.name, response.status, { detail: "renewed with another fencing token", kind: "lost" });
      this.#end(err);
      throw err;
    }
    this.#deadline = sent + data.validity_ms;
    this.#schedule();
  }

  /** Stops renewal and deletes the lock. Resolves when deleted; rejects with kind "lost" if it was already gone. Idempotent. */
  release(): Promise<void> {
    this.#released ??= (async () => {
      clearTimeout(this.#renewTimer);
      clearTimeout(this.#expiryTimer);
      try {
        const { error, response } = await this.#rf.api.DELETE("/v1/locks/{name}", {
          params: { path: { name: this.name }, header: { "Lock-Token": this.#lockToken } },
        }).catch((cause: unknown) => {
          throw new RedfenceError("release", this.name, 0, { cause });
        });
        if (response.status !== 204) {
          throw new RedfenceError("release", this.name, response.status, { problem: error as Problem | undefined });
        }
      } finally {
        if (!this.signal.aborted) {
          this.#abort.abort(new RedfenceError("release", this.name, 0, { detail: "the lease was released", kind: "lost" }));
        }
      }
    })();
    return this.#released;
  }
}

/** A Redfence client: the generated API client plus leases. */
export class Redfence {
  /** The openapi-fetch client, typed by the types generated from openapi.yaml. */
  readonly api: Client<paths>;
  readonly #owner: string | undefined;

  constructor(opts: RedfenceOptions) {
    const headers: Record<string, string> = {};
    if (opts.apiKey) headers.Authorization = `Bearer ${opts.apiKey}`;
    this.api = createClient<paths>({ baseUrl: opts.baseUrl, headers, ...(opts.fetch ? { fetch: opts.fetch } : {}) });
    this.#owner = opts.owner;
  }

  /** Takes the lock on name; rejects with a RedfenceError (kind "held" when it is taken). */
  async acquire(name: string, opts: LockOptions = {}): Promise<Lease> {
    const owner = opts.owner ?? this.#owner;
    const body: components["schemas"]["AcquireRequest"] = {};
    if (opts.ttlMs !== undefined) body.ttl_ms = opts.ttlMs;
    if (opts.waitMs !== undefined) body.wait_ms = opts.waitMs;
    if (owner) body.owner = owner;
    const sent = performance.now();
    const { data, error, response } = await this.api
      .POST("/v1/locks/{name}", { params: { path: { name } }, body })
      .catch((cause: unknown) => {
        throw new RedfenceError("acquire", name, 0, { cause });
      });
    if (!data) throw new RedfenceError("acquire", name, response.status, { problem: error as Problem | undefined });
    if (!data.lock_token) throw new RedfenceError("acquire", name, response.status, { detail: "the answer has no lock_token" });
    return new Lease(this, name, data.lock_token, data, sent, opts);
  }

  /**
   * Acquires the lock on name, runs fn with the lease (use `lease.signal` to
   * stop when it ends and `lease.fencingToken` for writes), renews it while
   * fn runs, and always releases it. Resolves to fn's result; rejects with
   * fn's error, or with a "lost" RedfenceError if the lease was lost before
   * fn returned.
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
      await lease.release().catch(() => undefined);
      throw err;
    } finally {
      clearInterval(keepAlive);
    }
    const lost = lease.signal.aborted ? lease.signal.reason : undefined;
    try {
      await lease.release();
    } catch (err) {
      if (!lost) throw err;
    }
    if (lost) throw lost;
    return result;
  }

  /** Writes data to the reference store with a fencing token; rejects with kind "stale" when a newer token exists. */
  async putResource(name: string, fencingToken: number, data: JsonValue): Promise<components["schemas"]["Resource"]> {
    const { data: res, error, response } = await this.api
      .PUT("/v1/resources/{name}", { params: { path: { name } }, body: { fencing_token: fencingToken, data } })
      .catch((cause: unknown) => {
        throw new RedfenceError("put", name, 0, { cause });
      });
    if (!res) throw new RedfenceError("put", name, response.status, { problem: error as Problem | undefined });
    return res;
  }
}
