"""A real HTTP server on loopback that serves test images, for the image-URL paths (no mocks).

Routes: ``/<name>`` serves a registered body (``image/png``); ``/redirect?to=URL`` answers 302 to ``URL``
(``&code=307``: that status);
``/endless`` streams chunks without a Content-Length until the client goes; ``/stall`` sends its headers
and then nothing until the server stops (a fetch's time limit ends it).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


@dataclass
class ImageServer:
    port: int
    bodies: dict[str, bytes] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    #: Paths requested, in order (a refused URL must never reach the server).
    requests: list[str] = field(default_factory=list)
    #: The Authorization header of each request, in order (None: none sent).
    authorizations: list[str | None] = field(default_factory=list)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


@contextlib.contextmanager
def image_server() -> Iterator[ImageServer]:
    state: ImageServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            return None

        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            state.requests.append(parts.path)
            state.authorizations.append(self.headers.get("Authorization"))
            if parts.path == "/redirect":
                self.send_response(int(parse_qs(parts.query).get("code", ["302"])[0]))
                self.send_header("Location", parse_qs(parts.query)["to"][0])
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif parts.path == "/endless":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                chunk = b"\x89PNG" + b"\0" * 65532
                with contextlib.suppress(OSError):
                    while not state.stop.is_set():
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            elif parts.path == "/stall":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", "1000")
                self.end_headers()
                self.wfile.flush()
                state.stop.wait()
            elif parts.path.lstrip("/") in state.bodies:
                body = state.bodies[parts.path.lstrip("/")]
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state = ImageServer(int(server.server_address[1]))
    thread = threading.Thread(target=server.serve_forever, name="image-server", daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.stop.set()
        server.shutdown()
        server.server_close()
