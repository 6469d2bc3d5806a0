#!/usr/bin/env python3
"""Receives Tollgate's quota alerts.

Checks each POST's signature (HMAC-SHA256 over the body with the secret
Tollgate was given as --alert-secret / TOLLGATE_ALERT_SECRET), prints each
alert as one JSON line, marking a repeat of an idempotency key already seen
(possible only when a Tollgate instance died between sending and recording
a delivery), and answers 204.

    TOLLGATE_ALERT_SECRET=s3cret python3 receiver.py 9000
"""
import hashlib
import hmac
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SECRET = os.environ["TOLLGATE_ALERT_SECRET"].encode()
seen = set()
lock = threading.Lock()  # requests are served on threads of their own


class Alerts(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        want = "sha256=" + hmac.new(SECRET, body, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, self.headers.get("Tollgate-Signature", "")):
            self.send_response(401)
            self.end_headers()
            return
        key = self.headers["Idempotency-Key"]
        alert = json.loads(body)
        with lock:
            alert["repeat"] = key in seen
            seen.add(key)
            print(json.dumps(alert), flush=True)
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


port = int(sys.argv[1]) if len(sys.argv) > 1 else 9000
ThreadingHTTPServer(("127.0.0.1", port), Alerts).serve_forever()
