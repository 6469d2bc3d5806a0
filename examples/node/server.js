// node examples/node/server.js PORT TOLLGATE_ADDR TENANT [TIMEOUT_MS]
// (TIMEOUT_MS: how long to wait for Tollgate before letting the request
// through; 50 by default)
"use strict";

const http = require("http");
const { tollgate } = require("./middleware");

const [port, target, tenant, timeout] = process.argv.slice(2);
const limit = tollgate({
  target,
  tenant,
  key: (req) => req.headers["x-api-key"],
  timeoutMs: timeout === undefined ? undefined : Number(timeout),
});

http
  .createServer((req, res) =>
    limit(req, res, () => {
      res.writeHead(200, { "Content-Type": "text/plain" });
      res.end("hello from the application\n");
    }),
  )
  .listen(Number(port), "127.0.0.1", () => console.log(`listening on 127.0.0.1:${port}`));
