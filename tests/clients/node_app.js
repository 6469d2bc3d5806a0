// A small application using the installed tollgate-client package, for
// tests/clients.rs:
//
//   node node_app.js express|fastify PORT TOLLGATE_ADDR TENANT open|closed
//
// `/` is behind the package's middleware (tenant TENANT, key x-api-key);
// `/reserve?key=K&estimate=N[&used=M][&fail=1]` reserves and settles;
// `/slot?key=K&ms=N` holds a concurrency slot of tenant "slots" for N ms;
// `/wait?key=K&max_wait=S` waits for tenant "paced" with backoff;
// `/batch?key=K&cost=N` asks for 1 token of K and N of K-2 of tenant "llm" at
// once. The other
// routes pass the middleware as a tenant without rules.
"use strict";

const { Tollgate, RateLimited, TollgateError, expressMiddleware, fastifyHook } = require("tollgate-client");

const [mode, port, target, tenant, policy] = process.argv.slice(2);
const client = new Tollgate(target, { timeout: 300, onUnreachable: policy });
const middlewareTenant = (path) => (path === "/" ? tenant : "no-rules");
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// Each route: (query) -> [status, body, headers].
async function route(path, q) {
  const key = q.key || "k";
  const refused = (err) => {
    if (err instanceof RateLimited) return [429, "refused\n", err.decision.headers];
    throw err;
  };
  if (path === "/") return [200, "hello\n", {}];
  if (path === "/reserve") {
    try {
      return await client.reserve(key, Number(q.estimate), { tenant: "llm" }, async (r) => {
        if (q.fail) throw new Error("the work failed");
        if (q.used !== undefined) r.used = Number(q.used);
        return [200, `reserved ${r.estimate}\n`, {}];
      });
    } catch (err) {
      if (err instanceof RateLimited) return refused(err);
      return [500, "the work failed\n", {}];
    }
  }
  if (path === "/slot") {
    try {
      return await client.slot(key, { tenant: "slots" }, async (s) => {
        await sleep(Number(q.ms || 0));
        return [200, `held ${s.inFlight}/${s.limit}\n`, {}];
      });
    } catch (err) {
      return refused(err);
    }
  }
  if (path === "/wait") {
    const d = await client.waitAllowed(key, { tenant: "paced", maxWait: Number(q.max_wait) * 1000 });
    return [d.allowed ? 200 : 429, `allowed=${d.allowed}\n`, {}];
  }
  if (path === "/batch") {
    try {
      const b = await client.batch([{ key, cost: 1, tenant: "llm" }, { key: `${key}-2`, cost: Number(q.cost), tenant: "llm" }]);
      return [b.allowed ? 200 : 429, `remaining [${b.items.map((d) => d.remaining).join(", ")}]\n`, {}];
    } catch (err) {
      if (err instanceof TollgateError) return [400, `${err.codeName}: ${err.details}\n`, {}];
      throw err;
    }
  }
  return [404, "no such route\n", {}];
}

if (mode === "express") {
  const express = require("express");
  const app = express();
  app.use(expressMiddleware(client, { tenant: (req) => middlewareTenant(req.path) }));
  app.get(/.*/, async (req, res) => {
    const [status, body, headers] = await route(req.path, req.query);
    res.status(status).set(headers).type("text/plain").send(body);
  });
  app.listen(Number(port), "127.0.0.1", () => console.log(`listening on 127.0.0.1:${port}`));
} else {
  const fastify = require("fastify")();
  fastify.addHook("onRequest", fastifyHook(client, { tenant: (req) => middlewareTenant(req.url.split("?")[0]) }));
  fastify.get("/*", async (request, reply) => {
    const [status, body, headers] = await route(request.url.split("?")[0], request.query);
    return reply.code(status).headers(headers).type("text/plain").send(body);
  });
  fastify.get("/", async (request, reply) => reply.type("text/plain").send("hello\n"));
  fastify.listen({ port: Number(port), host: "127.0.0.1" }).then(() => console.log(`listening on 127.0.0.1:${port}`));
}
