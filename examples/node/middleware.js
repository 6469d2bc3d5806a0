// An HTTP middleware that asks Tollgate before letting a request through.
//
//   const limit = tollgate({ target: "127.0.0.1:50051", tenant: "acme",
//                            key: (req) => req.headers["x-api-key"] });
//   http.createServer((req, res) => limit(req, res, () => handler(req, res)));
//
// Allowed requests carry the RateLimit header fields Tollgate returns; rejected
// ones get an honest 429 with Retry-After. If Tollgate cannot be reached the
// request goes through (fail open): the limiter must not become the outage.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "../../proto");

function client(target) {
  const definition = protoLoader.loadSync("tollgate/v1/tollgate.proto", {
    includeDirs: [PROTO_ROOT],
    keepCase: true,
    longs: Number,
    defaults: true,
  });
  const { tollgate } = grpc.loadPackageDefinition(definition);
  return new tollgate.v1.RateLimiter(target, grpc.credentials.createInsecure());
}

function tollgate({ target, tenant = "", resource = "", key, cost = () => 1, timeoutMs = 50 }) {
  const rpc = client(target);
  return function limit(req, res, next) {
    const apiKey = key(req);
    if (!apiKey) {
      res.writeHead(400, { "Content-Type": "text/plain" });
      res.end("missing API key\n");
      return;
    }
    const request = { key: apiKey, tenant, resource, cost: cost(req), dry_run: false };
    rpc.ShouldAllow(request, { deadline: Date.now() + timeoutMs }, (err, decision) => {
      if (err) {
        console.warn(`tollgate unavailable (${err.code}); letting the request through`);
        next();
        return;
      }
      for (const [name, value] of Object.entries(decision.headers)) res.setHeader(name, value);
      if (!decision.allowed) {
        res.writeHead(429, { "Content-Type": "text/plain" });
        res.end("rate limited; retry after the Retry-After header\n");
        return;
      }
      next();
    });
  };
}

// For work whose cost is known only afterwards (LLM tokens): Reserve the
// estimate, let the handler run, and Settle with the usage the handler set
// in the `usageHeader` response header once the response is done, or 0 if
// it set none (a failure), which refunds the whole estimate.
//
//   const budget = tollgateBudget({ target, tenant: "llm", key: (req) => req.headers["x-api-key"],
//                                   estimate: (req) => Number(req.headers["x-max-tokens"] || 1) });
function tollgateBudget({
  target,
  tenant = "",
  resource = "",
  key,
  estimate = () => 1,
  usageHeader = "x-usage-tokens",
  ttlSeconds = 60,
  timeoutMs = 50,
}) {
  const rpc = client(target);
  return function budget(req, res, next) {
    const apiKey = key(req);
    if (!apiKey) {
      res.writeHead(400, { "Content-Type": "text/plain" });
      res.end("missing API key\n");
      return;
    }
    const request = { key: apiKey, tenant, resource, estimate: estimate(req), ttl: { seconds: ttlSeconds, nanos: 0 } };
    rpc.Reserve(request, { deadline: Date.now() + timeoutMs }, (err, reserved) => {
      if (err) {
        console.warn(`tollgate unavailable (${err.code}); letting the request through`);
        next();
        return;
      }
      const decision = reserved.decision;
      for (const [name, value] of Object.entries(decision.headers)) res.setHeader(name, value);
      if (!decision.allowed) {
        res.writeHead(429, { "Content-Type": "text/plain" });
        res.end("over budget; retry after the Retry-After header\n");
        return;
      }
      let settled = false;
      const settle = () => {
        if (settled || !reserved.reservation) return;
        settled = true;
        const used = Number(res.getHeader(usageHeader)) || 0;
        rpc.Settle({ reservation: reserved.reservation, actual: used }, { deadline: Date.now() + timeoutMs }, (e) => {
          if (e) console.warn(`settle failed (${e.code}); the estimate stays charged`);
        });
      };
      res.on("finish", settle);
      res.on("close", settle);
      try {
        next();
      } catch (e) {
        settle();
        throw e;
      }
    });
  };
}

// To cap how many requests run at once: hold a slot of the key's
// concurrency rules while the handler runs, through a Hold stream. Ending
// the stream (the response is done, or this process died and its
// connection dropped) gives the slot back at once.
//
//   const slot = tollgateSlot({ target, tenant: "reports", key: (req) => req.headers["x-api-key"] });
function tollgateSlot({ target, tenant = "", resource = "", key, ttlSeconds = 60, timeoutMs = 50 }) {
  const rpc = client(target);
  return function slot(req, res, next) {
    const apiKey = key(req);
    if (!apiKey) {
      res.writeHead(400, { "Content-Type": "text/plain" });
      res.end("missing API key\n");
      return;
    }
    const call = rpc.Hold();
    let answered = false;
    let released = false;
    const release = () => {
      if (released) return;
      released = true;
      call.end();
    };
    const failOpen = (why) => {
      if (answered) return;
      answered = true;
      clearTimeout(timer);
      released = true;
      call.cancel();
      console.warn(`tollgate unavailable (${why}); letting the request through`);
      next();
    };
    const timer = setTimeout(() => failOpen("timeout"), timeoutMs);
    call.on("error", (err) => failOpen(err.code));
    call.on("data", (answer) => {
      if (answered || !answer.acquired) return;
      answered = true;
      clearTimeout(timer);
      const acquired = answer.acquired;
      for (const [name, value] of Object.entries(acquired.decision.headers)) res.setHeader(name, value);
      if (!acquired.granted) {
        release();
        res.writeHead(429, { "Content-Type": "text/plain" });
        res.end("too many requests in flight; retry after the Retry-After header\n");
        return;
      }
      res.on("finish", release);
      res.on("close", release);
      try {
        next();
      } catch (e) {
        release();
        throw e;
      }
    });
    call.write({ key: apiKey, tenant, resource, ttl: { seconds: ttlSeconds, nanos: 0 }, cost: 0 });
  };
}

module.exports = { tollgate, tollgateBudget, tollgateSlot };
