"""A stand-in engine node for the `kvpool cluster restart` tests: starts in a blink, answers
GET /health with its pid, command line and the FAKE_NODE_MARK environment variable, and
runs until SIGTERM (Python's default action: exit).

    python -m tests.kvpool_harness.fake_node --node-id node-0 --port 8123
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the http.server hook's name
        body = json.dumps({"pid": os.getpid(), "argv": sys.argv[1:],
                           "mark": os.environ.get("FAKE_NODE_MARK", "")}).encode()
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the hook's signature
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--node-id", required=True)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    HTTPServer(("127.0.0.1", args.port), Health).serve_forever()  # SO_REUSEADDR: the port again at once


if __name__ == "__main__":
    main()
