// Copies Tollgate's proto into the package before `npm pack` / `npm publish`,
// so the installed package carries the API it loads.
"use strict";
const fs = require("fs");
const path = require("path");

const from = path.resolve(__dirname, "../../../proto/tollgate/v1/tollgate.proto");
const to = path.resolve(__dirname, "../proto/tollgate/v1/tollgate.proto");
fs.mkdirSync(path.dirname(to), { recursive: true });
fs.copyFileSync(from, to);
