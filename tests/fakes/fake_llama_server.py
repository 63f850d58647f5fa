#!/usr/bin/env python3
"""A stand-in for llama.cpp's ``llama-server`` that speaks its ``/health`` and streaming
``/completion`` protocol (standard library only), for the engine benchmark's adapter tests.

Token ``i`` of a completion is ``(sum of the prompt ids + i) % 1000`` (a string prompt counts
its length), so a test can check that the token-id prompt arrived intact. A body without the
greedy, EOS-ignoring, token-returning fields the benchmark must send is answered with 400.
"""

import argparse
import json
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

from json_http import JSONHandler  # beside this file: run as a script, its directory is on sys.path

REQUIRED = {"temperature": 0.0, "top_k": 1, "ignore_eos": True, "return_tokens": True, "stream": True}


class Handler(JSONHandler):
    def do_GET(self):
        if self.path != "/health":
            self.send_error(404)
            return
        self.send_json(200, {"status": "ok"})

    def do_POST(self):
        if self.path != "/completion":
            self.send_error(404)
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        wrong = {k: body.get(k) for k, v in REQUIRED.items() if body.get(k) != v}
        if wrong:
            self.send_json(400, {"error": {"message": f"unexpected fields {wrong}"}})
            return
        prompt = body["prompt"]
        base = len(prompt) if isinstance(prompt, str) else sum(int(t) for t in prompt)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(int(body["n_predict"])):
            time.sleep(0.001)
            self._event({"content": f"t{i}", "tokens": [(base + i) % 1000], "stop": False})
        self._event({"content": "", "tokens": [], "stop": True, "stop_type": "limit"})

    def _event(self, data):
        self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("-m", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("-np", type=int, required=True)
    parser.add_argument("-c", type=int, required=True)
    args, _ = parser.parse_known_args()
    if not Path(args.m).is_file():
        print(f"error: model file {args.m} not found", file=sys.stderr)
        return 1
    ThreadingHTTPServer.request_queue_size = 128  # all benchmark clients connect at once
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    time.sleep(600)  # never outlives a test run; the benchmark terminates it long before
    return 0


if __name__ == "__main__":
    sys.exit(main())
