"""A small HTTP client of the server and a way to run one, on the standard library alone
(scripts/bench/bench_serve.py and the tests use them).

One :class:`Client` holds one keep-alive connection: use one per thread.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def detail(self) -> str:
        """The one-line reason of an error reply."""
        try:
            return str(self.json().get("detail", ""))
        except (ValueError, AttributeError):
            return self.body.decode(errors="replace")


def multipart(fields: dict[str, tuple[str, bytes, str]]) -> tuple[bytes, str]:
    """A multipart/form-data body of files ``{field: (filename, data, content type)}`` and its
    Content-Type header."""
    boundary = secrets.token_hex(16)
    parts = []
    for name, (filename, data, kind) in fields.items():
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; '
            f'filename="{filename}"\r\nContent-Type: {kind}\r\n\r\n'
        )
        parts.append(head.encode() + data + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


class Client:
    def __init__(self, url: str, *, timeout: float = 60) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def request(
        self,
        method: str,
        path: str,
        body: bytes | Iterable[bytes] | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        """One request; a connection the server closed is opened again once (keep-alive)."""
        for attempt in (0, 1):
            conn = self._connection()
            try:
                conn.request(
                    method,
                    path,
                    body=body,
                    headers=headers or {},
                    encode_chunked=body is not None and not isinstance(body, bytes),
                )
                response = conn.getresponse()
                data = response.read()
            except (http.client.RemoteDisconnected, ConnectionError, BrokenPipeError):
                self.close()
                if attempt or (body is not None and not isinstance(body, bytes)):
                    raise
                continue
            except BaseException:
                # A timeout, or anything else mid-request, leaves the connection in an unknown
                # state (http.client would refuse the next request on it): the next opens anew.
                self.close()
                raise
            if response.will_close:
                self.close()
            return Reply(response.status, data, {k.lower(): v for k, v in response.getheaders()})
        raise AssertionError("unreachable")

    def get(self, path: str) -> Reply:
        return self.request("GET", path)

    def post_json(self, path: str, payload: Any) -> Reply:
        body = json.dumps(payload).encode()
        return self.request("POST", path, body, {"Content-Type": "application/json"})

    def post_file(
        self, path: str, data: bytes, *, field: str = "file", kind: str = "image/png"
    ) -> Reply:
        body, content_type = multipart({field: ("upload", data, kind)})
        return self.request("POST", path, body, {"Content-Type": content_type})

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class ServerProcess:
    """``python -m sdnet_trainer.serve ARGS port=0`` in a process group of its own: started,
    waited for until /readyz answers 200 (its URL read from its output), stopped with SIGTERM
    (SIGKILL after ``stop_timeout``). For scripts and tests; a context manager."""

    LISTENING = re.compile(r"listening on (http://\S+)")

    def __init__(
        self,
        args: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        start_timeout: float = 180,
        stop_timeout: float = 30,
    ) -> None:
        self.args = [*args, "port=0"]
        self.command = [sys.executable, "-m", "sdnet_trainer.serve", *self.args]
        self.env, self.cwd = env, cwd
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self.lines: list[str] = []
        self.url = ""
        self.proc: subprocess.Popen[str] | None = None
        self.returncode: int | None = None

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def start(self) -> ServerProcess:
        """Start the server and wait until it is ready; on any failure (or an interrupt) while
        waiting, the server is stopped before the exception goes on."""
        self.proc = subprocess.Popen(
            self.command,
            env=self.env,
            cwd=self.cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            self._wait_ready(self.proc)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, proc: subprocess.Popen[str]) -> None:
        reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
        reader.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.url:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{self.output}")
            match = self.LISTENING.search(self.output)
            self.url = match[1] if match else ""
            time.sleep(0.05)
        client = Client(self.url, timeout=5)
        try:
            while True:
                try:
                    if client.get("/readyz").status == 200:
                        return
                except (OSError, http.client.HTTPException):
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not become ready:\n{self.output}")
                time.sleep(0.05)
        finally:
            client.close()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line)

    def stop(self) -> int | None:
        """SIGTERM to the server's process group; its exit code (None if it had to be killed)."""
        proc = self.proc
        if proc is None or self.returncode is not None:
            return self.returncode
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return None
        self.returncode = proc.returncode
        return self.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
