// Tollgate's Node.js client: ask before doing expensive work.
//
//   const { Tollgate } = require("tollgate-client");
//   const tollgate = new Tollgate("127.0.0.1:50051", { tenant: "acme" });
//   const decision = await tollgate.shouldAllow("alice", { cost: 1 });
//
// `expressMiddleware` and `fastifyHook` answer an honest 429 with Tollgate's
// headers. When Tollgate cannot be reached within `timeout` ms, the
// `onUnreachable` policy answers: "open" (the default) admits, "closed"
// refuses.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO = path.join(__dirname, "proto");

// Codes that mean "Tollgate did not answer", not "the request is wrong".
const UNREACHABLE = new Set([
  grpc.status.UNAVAILABLE,
  grpc.status.DEADLINE_EXCEEDED,
  grpc.status.RESOURCE_EXHAUSTED,
  grpc.status.CANCELLED,
  grpc.status.UNKNOWN,
]);

const DEGRADED = {
  DEGRADED_FAILED_OPEN: "failed_open",
  DEGRADED_FAILED_CLOSED: "failed_closed",
  DEGRADED_LOCAL: "local",
};

let loaded;
function api() {
  if (!loaded) {
    const definition = protoLoader.loadSync("tollgate/v1/tollgate.proto", {
      includeDirs: [PROTO],
      keepCase: true,
      longs: Number,
      enums: String,
      defaults: true,
    });
    loaded = grpc.loadPackageDefinition(definition).tollgate.v1;
  }
  return loaded;
}

const seconds = (d) => (d ? Number(d.seconds) + d.nanos / 1e9 : 0);
const duration = (s) => ({ seconds: Math.floor(s), nanos: Math.round((s - Math.floor(s)) * 1e9) });

function decisionOf(r) {
  return {
    allowed: r.allowed,
    remaining: r.remaining,
    limit: r.limit,
    retryAfter: seconds(r.retry_after),
    resetAfter: seconds(r.reset_after),
    rule: r.limit_name,
    headers: { ...r.headers },
    shadow: r.shadow,
    degraded: DEGRADED[r.degraded] || null,
    unreachable: false,
  };
}

function unreachableDecision(policy) {
  return {
    allowed: policy === "open", remaining: 0, limit: 0, retryAfter: 0, resetAfter: 0,
    rule: "", headers: {}, shadow: false, degraded: null, unreachable: true,
  };
}

/**
 * Tollgate refused the request as invalid: `code` is the gRPC status
 * (`codeName` its name, such as INVALID_ARGUMENT), `details` what to fix.
 */
class TollgateError extends Error {
  constructor(err) {
    const codeName = Object.keys(grpc.status).find((k) => grpc.status[k] === err.code) || String(err.code);
    super(`${codeName}: ${err.details}`);
    this.name = "TollgateError";
    this.code = err.code;
    this.codeName = codeName;
    this.details = err.details;
  }
}

/** Refused by Tollgate (or the closed policy); `decision` has the headers. */
class RateLimited extends Error {
  constructor(decision) {
    super(`rate limited by ${decision.rule || "tollgate"}; retry after ${decision.retryAfter.toFixed(3)} s`);
    this.name = "RateLimited";
    this.decision = decision;
  }
}

class Tollgate {
  constructor(target = "127.0.0.1:50051", { tenant = "", timeout = 250, onUnreachable = "open", credentials } = {}) {
    if (onUnreachable !== "open" && onUnreachable !== "closed") {
      throw new TypeError(`onUnreachable is ${JSON.stringify(onUnreachable)}; use "open" or "closed"`);
    }
    this.tenant = tenant;
    this.timeout = timeout;
    this.onUnreachable = onUnreachable;
    this.stub = new (api().RateLimiter)(target, credentials || grpc.credentials.createInsecure());
  }

  close() {
    this.stub.close();
  }

  _call(method, request) {
    return new Promise((resolve, reject) => {
      this.stub[method](request, { deadline: Date.now() + this.timeout }, (err, response) =>
        err ? reject(err) : resolve(response));
    });
  }

  _failed(err) {
    if (UNREACHABLE.has(err.code)) {
      console.warn(`tollgate unreachable (${err.code}); failing ${this.onUnreachable}`);
      return unreachableDecision(this.onUnreachable);
    }
    throw new TollgateError(err);
  }

  _tenant(tenant) {
    return tenant === undefined ? this.tenant : tenant;
  }

  /** May `key` spend `cost` tokens now? */
  async shouldAllow(key, { cost = 1, tenant, resource = "", dryRun = false } = {}) {
    try {
      const r = await this._call("ShouldAllow", { key, cost, tenant: this._tenant(tenant), resource, dry_run: dryRun });
      return decisionOf(r);
    } catch (err) {
      return this._failed(err);
    }
  }

  /** Decides every item at once: all are charged, or none is. */
  async batch(items) {
    const request = { items: items.map((i) => ({ key: i.key, cost: i.cost ?? 1, tenant: this._tenant(i.tenant), resource: i.resource || "" })) };
    let r;
    try {
      r = await this._call("ShouldAllowBatch", request);
    } catch (err) {
      const d = this._failed(err);
      return { allowed: d.allowed, items: items.map(() => d), retryAfter: 0, unreachable: true };
    }
    return { allowed: r.allowed, items: r.results.map(decisionOf), retryAfter: seconds(r.retry_after), unreachable: false };
  }

  /**
   * Asks until admitted: a refusal sleeps its retryAfter plus up to `jitter`
   * of it (so callers refused together do not return together), for at most
   * `maxWait` ms; returns the last decision.
   */
  async waitAllowed(key, { cost = 1, tenant, resource = "", maxWait = 10000, jitter = 0.2 } = {}) {
    const deadline = Date.now() + maxWait;
    for (;;) {
      const d = await this.shouldAllow(key, { cost, tenant, resource });
      if (d.allowed || d.unreachable || d.retryAfter <= 0) return d;
      const pause = d.retryAfter * 1000 * (1 + Math.random() * jitter);
      if (Date.now() + pause > deadline) return d;
      await new Promise((r) => setTimeout(r, pause));
    }
  }

  /** Settles a reservation at `actual` tokens. */
  async settle(token, actual) {
    await this._call("Settle", { reservation: token, actual });
  }

  /**
   * Reserves `estimate` tokens, runs `work(reservation)`, and settles in a
   * `finally`: at `reservation.used` if set, else the estimate, or 0 (a
   * refund) when `work` throws. Refused: throws RateLimited.
   */
  async reserve(key, estimate, options, work) {
    if (typeof options === "function") [options, work] = [{}, options];
    const { tenant, resource = "", ttl = 60 } = options || {};
    let decision, token;
    try {
      const r = await this._call("Reserve", { key, estimate, tenant: this._tenant(tenant), resource, ttl: duration(ttl) });
      decision = decisionOf(r.decision);
      token = r.reservation;
    } catch (err) {
      decision = this._failed(err);
      token = "";
    }
    if (!decision.allowed) throw new RateLimited(decision);
    const reservation = { decision, token, estimate, used: undefined };
    let failed = false;
    try {
      return await work(reservation);
    } catch (err) {
      failed = true;
      throw err;
    } finally {
      if (token) {
        const actual = reservation.used !== undefined ? reservation.used : failed ? 0 : estimate;
        try {
          await this.settle(token, actual);
        } catch (err) {
          console.warn(`settle failed (${err.code}); the reservation expires with its estimate charged`);
        }
      }
    }
  }

  /**
   * Holds a slot of the concurrency caps that apply while `work(slot)` runs,
   * through a Hold stream: given back when it ends, or at once if this
   * process dies. Full: throws RateLimited.
   */
  async slot(key, options, work) {
    if (typeof options === "function") [options, work] = [{}, options];
    const { tenant, resource = "", ttl = 60, cost = 0 } = options || {};
    const call = this.stub.Hold();
    const answers = [];
    let waiting = null;
    const next = () => new Promise((resolve) => {
      if (answers.length) resolve(answers.shift());
      else waiting = resolve;
    });
    const push = (a) => {
      if (waiting) { const w = waiting; waiting = null; w(a); } else answers.push(a);
    };
    call.on("data", (m) => push({ message: m }));
    call.on("error", (err) => push({ error: err }));
    call.on("end", () => push({ end: true }));
    call.write({ key, tenant: this._tenant(tenant), resource, ttl: duration(Math.max(ttl, 1)), cost });
    let timer;
    const first = await Promise.race([
      next(),
      new Promise((resolve) => { timer = setTimeout(() => resolve({ timeout: true }), this.timeout); }),
    ]);
    clearTimeout(timer);
    if (!first.message) {
      call.cancel();
      const d = first.error ? this._failed(first.error) : unreachableDecision(this.onUnreachable);
      if (!d.allowed) throw new RateLimited(d);
      return work({ decision: d, lease: "", inFlight: 0, limit: 0 });
    }
    const acquired = first.message.acquired;
    const decision = decisionOf(acquired.decision);
    if (!acquired.granted) {
      call.cancel();
      throw new RateLimited(decision);
    }
    try {
      return await work({ decision, lease: acquired.lease, inFlight: acquired.in_flight, limit: acquired.limit });
    } finally {
      // Ending the stream releases the lease; the server's last answer says so.
      call.end();
      if (acquired.lease) {
        await Promise.race([next(), new Promise((r) => setTimeout(r, this.timeout))]);
      }
      call.cancel();
    }
  }
}

function apiKeyOrAddress(req) {
  const given = req.headers["x-api-key"];
  return given || req.socket?.remoteAddress || req.ip || null;
}

const valueOf = (v, req) => (typeof v === "function" ? v(req) : v);

// Decides `req`; returns the decision, or null after answering 400.
async function decide(client, req, { key = apiKeyOrAddress, cost = 1, tenant, resource = "" }) {
  const k = key(req);
  if (!k) return null;
  return client.shouldAllow(k, { cost: valueOf(cost, req), tenant: valueOf(tenant, req), resource: valueOf(resource, req) });
}

const REFUSED = "rate limited; retry after the Retry-After header\n";

/**
 * Express middleware: decides each request with ShouldAllow, answers 429
 * with Tollgate's headers when refused, and adds the RateLimit headers to
 * admitted responses. `key` (default: x-api-key, else the client address),
 * `cost`, `tenant` and `resource` may be values or functions of the request.
 */
function expressMiddleware(client, options = {}) {
  return function tollgate(req, res, next) {
    decide(client, req, options).then((d) => {
      if (!d) {
        res.status(400).type("text/plain").send("missing API key\n");
        return;
      }
      for (const [name, value] of Object.entries(d.headers)) res.setHeader(name, value);
      if (!d.allowed) {
        res.status(429).type("text/plain").send(REFUSED);
        return;
      }
      next();
    }, next);
  };
}

/**
 * A Fastify `onRequest` hook doing the same:
 * `fastify.addHook("onRequest", fastifyHook(client, options))`.
 */
function fastifyHook(client, options = {}) {
  return async function tollgate(request, reply) {
    const d = await decide(client, request, options);
    if (!d) return reply.code(400).type("text/plain").send("missing API key\n");
    reply.headers(d.headers);
    if (!d.allowed) return reply.code(429).type("text/plain").send(REFUSED);
  };
}

module.exports = { Tollgate, RateLimited, TollgateError, expressMiddleware, fastifyHook };
