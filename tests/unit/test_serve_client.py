"""The standard-library client of the server (sdnet_trainer.serve.client): a connection that
failed mid-request is not used again, and a server that fails to start is stopped."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sdnet_trainer.serve.client import Client, ServerProcess


class Handler(BaseHTTPRequestHandler):
    """GET /slow answers after a second, anything else at once."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the server under test

    def do_GET(self) -> None:
        if self.path == "/slow":
            time.sleep(1)
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # the client closes the connection of /slow before the answer is written


@pytest.fixture
def http_url() -> Iterator[str]:
    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_timed_out_request_leaves_the_client_usable(http_url):
    client = Client(http_url, timeout=0.2)
    with pytest.raises(TimeoutError):
        client.get("/slow")
    reply = client.get("/fast")  # a new connection: the old one still awaits its response
    assert (reply.status, reply.body) == (200, b"ok")
    client.close()


def test_a_server_that_fails_while_starting_is_stopped(monkeypatch):
    server = ServerProcess([], start_timeout=30, stop_timeout=10)
    # A stand-in server that says where it listens and never answers.
    server.command = [
        sys.executable,
        "-c",
        "import time; print('listening on http://127.0.0.1:9', flush=True); time.sleep(60)",
    ]

    def fail(self: Client, path: str) -> None:
        raise RuntimeError("the readiness check broke")

    monkeypatch.setattr(Client, "get", fail)
    try:
        with pytest.raises(RuntimeError, match="readiness check broke"):
            server.start()
        assert server.proc is not None and server.proc.poll() is not None  # stopped
    finally:
        if server.proc is not None and server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(10)
