"""A real HTTP file server on 127.0.0.1 for packed sets at a URL, in the tests and in
bench/url_reading.py: with Range requests answered (206), or ignored as plain static servers
do (Python's own handler), failing a given number of requests first (503), and asking for a
user name and password (401 without them)."""

import base64
import functools
import http.server
import io
import os
import threading


class _Files(http.server.SimpleHTTPRequestHandler):
    """A static file server; `ranges`: answers Range requests with 206 (Python's own handler
    ignores them, as plain static servers do); `failures`: that many requests answered 503
    first, as an overloaded server."""

    ranges, failures, auth, requests = True, [0], None, [0]

    def log_message(self, *args) -> None:
        pass

    def send_head(self):
        self.requests[0] += 1
        if self.auth and self.headers.get("Authorization") != f"Basic {self.auth}":
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="files"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        if self.failures[0] > 0:
            self.failures[0] -= 1
            self.send_error(503, "busy")
            return None
        wanted = self.headers.get("Range")
        path = self.translate_path(self.path)
        if not (self.ranges and wanted and os.path.isfile(path)):
            return super().send_head()
        start, end = (int(x) for x in wanted.removeprefix("bytes=").split("-"))
        with open(path, "rb") as f:
            f.seek(start)
            body = f.read(end - start + 1)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/*")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        return io.BytesIO(body)


def serve(
    root, ranges: bool = True, failures: int = 0, auth: str | None = None
) -> http.server.ThreadingHTTPServer:
    """A server for the files under root, in a thread until its shutdown(); auth: the
    "user:password" it asks for. Its `requests` holds the count of requests answered."""
    token = base64.b64encode(auth.encode()).decode() if auth else None
    counted = [0]
    fields = {"ranges": ranges, "failures": [failures], "auth": token, "requests": counted}
    handler = type("Handler", (_Files,), fields)
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(root))
    )
    server.requests = counted
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server
