"""The application (sdnet_trainer.serve.app) over real HTTP in this process, on models of a few
lines: request bodies are prepared off the event loop, a few at a time."""

from __future__ import annotations

import io
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("uvicorn", reason="the serve extra is not installed")

import uvicorn  # noqa: E402

from sdnet_trainer.serve import app as app_module  # noqa: E402
from sdnet_trainer.serve.app import create_app  # noqa: E402
from sdnet_trainer.serve.args import ServeArgs  # noqa: E402
from sdnet_trainer.serve.client import Client  # noqa: E402
from sdnet_trainer.serve.images import ImageModel  # noqa: E402
from sdnet_trainer.serve.language import Codec, LanguageModel  # noqa: E402

VOCAB = 16
WAIT = 20  # seconds: the most any step here may take before the test fails


@contextmanager
def running(app: object) -> Iterator[str]:
    """``app`` served by uvicorn in a thread on a free port of loopback; its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + WAIT
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(WAIT)
        sock.close()


class Gate:
    """A step that blocks until opened, counting the threads inside it at once."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.lock = threading.Lock()
        self.inside = self.peak = 0

    def __enter__(self) -> None:
        with self.lock:
            self.inside += 1
            self.peak = max(self.peak, self.inside)

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.inside -= 1

    def wait(self) -> None:
        assert self.opened.wait(WAIT), "the gate was never opened"

    def until_inside(self, count: int) -> None:
        deadline = time.monotonic() + WAIT
        while self.inside < count:
            assert time.monotonic() < deadline, f"{self.inside} inside, not {count}"
            time.sleep(0.01)


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _in_threads(url: str, count: int, send) -> tuple[list[threading.Thread], list]:
    """``send(client)`` from ``count`` threads at once, each with its own client; the threads and
    the list their replies land in."""
    replies: list = [None] * count

    def one(i: int) -> None:
        client = Client(url, timeout=WAIT)
        replies[i] = send(client)
        client.close()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads, replies


def test_images_are_preprocessed_a_few_at_a_time_off_the_event_loop(monkeypatch):
    monkeypatch.setattr(app_module, "_cpu_count", lambda: 2)
    gate = Gate()

    def transform(image: Image.Image) -> torch.Tensor:
        with gate:
            gate.wait()
        return torch.zeros(3, 4, 4)

    model = ImageModel(
        lambda x: x.flatten(1)[:, :3],
        input_shape=(3, 4, 4),
        classes=["a", "b", "c"],
        transform=transform,
        max_pixels=100,
        top_k=2,
    )
    with running(create_app(model, ServeArgs(checkpoint="x"), source="test")) as url:
        png = _png()

        threads, replies = _in_threads(url, 5, lambda c: c.post_file("/v1/predict", png))
        gate.until_inside(2)
        time.sleep(0.3)  # time for the other three to come in, were they let in
        assert gate.peak == 2
        assert Client(url, timeout=WAIT).get("/healthz").status == 200
        gate.opened.set()
        for thread in threads:
            thread.join(WAIT)
    assert [reply.status for reply in replies] == [200] * 5, [r.body for r in replies]
    assert gate.peak == 2


class SlowTokenizer:
    """Tokenizes any text as [1, 2], once its gate opens."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def encode(self, texts: list[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        with self.gate:
            self.gate.wait()
        return [[1, 2] for _ in texts]

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


def _next_is_plus_one(ids: torch.Tensor) -> torch.Tensor:
    """Logits whose most likely next token is the last one plus one."""
    return torch.nn.functional.one_hot((ids + 1) % VOCAB, VOCAB).float()


def test_prompts_are_tokenized_off_the_event_loop_and_max_new_tokens_defaults_to_the_limit():
    gate = Gate()
    model = LanguageModel(
        _next_is_plus_one,
        context=8,
        vocab_size=VOCAB,
        codec=Codec("tokenizer", SlowTokenizer(gate)),
        max_new_tokens=4,  # under the default of 32: a request that does not say gets 4
    )
    with running(create_app(model, ServeArgs(checkpoint="x"), source="test")) as url:
        prompt = {"prompt": "hello"}  # no max_new_tokens
        threads, replies = _in_threads(url, 1, lambda c: c.post_json("/v1/predict", prompt))
        gate.until_inside(1)
        # The event loop answers while the prompt is being tokenized.
        assert Client(url, timeout=5).get("/healthz").status == 200
        gate.opened.set()
        threads[0].join(WAIT)
        client = Client(url, timeout=WAIT)
        plain = client.request("POST", "/v1/predict", b"hello", {"Content-Type": "text/plain"})
        assert plain.status == 415 and "application/json" in plain.detail
        broken = client.request("POST", "/v1/predict", b"{", {"Content-Type": "application/json"})
        assert broken.status == 400 and "not valid JSON" in broken.detail
        client.close()
    assert replies[0].status == 200, replies[0].body
    assert replies[0].json() == {"tokens": [3, 4, 5, 6], "text": "3 4 5 6", "prompt_tokens": 2}
