// The README's TypeScript example: take the lock "invoices", write to the
// reference store with the lease's fencing token, release.
//   cd sdk/typescript && npm ci && npm run build
//   REDFENCE_API_KEY=$KEY node examples/with-lock.mjs
import { Redfence, RedfenceError } from "../dist/index.js";

const rf = new Redfence({
  baseUrl: process.env.REDFENCE_SERVER ?? "http://127.0.0.1:8080",
  apiKey: process.env.REDFENCE_API_KEY,
  owner: "ts-example",
});

try {
  // withLock renews the lease every ttl/3 while fn runs and always releases it;
  // lease.signal aborts the moment the lease is lost or runs out.
  const res = await rf.withLock(
    "invoices",
    async (lease) => {
      console.log(`holding "${lease.name}" with fencing token ${lease.fencingToken}`);
      return rf.putResource("invoices", lease.fencingToken, { total: 42 });
    },
    { ttlMs: 10_000, waitMs: 5_000 },
  );
  console.log(`wrote version ${res.version} with token ${res.fencing_token}`);

  // Every operation of openapi.yaml is on rf.api, typed:
  const { data } = await rf.api.GET("/v1/locks/{name}", { params: { path: { name: "invoices" } } });
  console.log(`held: ${data?.held}, last fencing token: ${data?.last_fencing_token}`);
} catch (err) {
  if (err instanceof RedfenceError) console.error(`${err.kind}: ${err.message}`);
  throw err;
}
