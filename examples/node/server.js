// node examples/node/server.js PORT TOLLGATE_ADDR TENANT [TIMEOUT_MS] [budget|slot]
// (TIMEOUT_MS: how long to wait for Tollgate before letting the request
// through; 50 by default. "budget": the reserve -> call -> settle middleware
// around a stand-in LLM: estimate from x-max-tokens, usage from
// x-want-tokens, a failure when x-fail is set. "slot": the hold-a-slot
// middleware around work that takes x-work-ms.)
"use strict";

const http = require("http");
const { tollgate, tollgateBudget, tollgateSlot } = require("./middleware");

const [port, target, tenant, timeout, mode] = process.argv.slice(2);
const options = {
  target,
  tenant,
  key: (req) => req.headers["x-api-key"],
  timeoutMs: timeout === undefined ? undefined : Number(timeout),
};

function hello(req, res) {
  res.writeHead(200, { "Content-Type": "text/plain" });
  res.end("hello from the application\n");
}

function completion(req, res) {
  if (req.headers["x-fail"]) {
    res.writeHead(500, { "Content-Type": "text/plain" });
    res.end("the model failed\n");
    return;
  }
  res.setHeader("X-Usage-Tokens", req.headers["x-want-tokens"] || "1");
  res.writeHead(200, { "Content-Type": "text/plain" });
  res.end("a completion\n");
}

function work(req, res) {
  setTimeout(() => {
    res.writeHead(200, { "Content-Type": "text/plain" });
    res.end("work done\n");
  }, Number(req.headers["x-work-ms"] || 0));
}

const [guard, handler] =
  mode === "budget"
    ? [tollgateBudget({ ...options, estimate: (req) => Number(req.headers["x-max-tokens"] || 1) }), completion]
    : mode === "slot"
      ? [tollgateSlot(options), work]
      : [tollgate(options), hello];

http
  .createServer((req, res) => guard(req, res, () => handler(req, res)))
  .listen(Number(port), "127.0.0.1", () => console.log(`listening on 127.0.0.1:${port}`));
