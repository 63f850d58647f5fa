"""A quiet request handler that answers JSON, for the tests' stand-in servers (standard library only:
``fake_llama_server.py`` runs as a script and imports it from its own directory)."""

import json
from http.server import BaseHTTPRequestHandler


class JSONHandler(BaseHTTPRequestHandler):
    """``send_json`` writes one JSON answer with its length; requests are not logged to stderr."""

    def log_message(self, *args) -> None:
        pass

    def send_json(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
