"""python -m sdnet_trainer.serve over real HTTP on loopback: a CNN checkpoint written by 2
processes, a GPT checkpoint, and an export folder on onnxruntime; each server is
started on a free port and stopped (SIGTERM) by the test."""

from __future__ import annotations

import base64
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

from sdnet_trainer import Trainer
from sdnet_trainer.checkpoint import find_checkpoint
from sdnet_trainer.data.augment import IMAGENET_MEAN, IMAGENET_STD
from sdnet_trainer.data.transforms import build_transforms
from sdnet_trainer.export import ExportArgs, export, load_model, training_config
from sdnet_trainer.serve import cli as serve_main
from sdnet_trainer.serve.args import parse_args
from sdnet_trainer.serve.client import Client, ServerProcess
from sdnet_trainer.serve.model import load, resolve
from tests.support import CPU, REPO, TINY, cli_env, run_cli, start_command, wait_until
from tests.unit.test_serve_args import unloadable_export_folder

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("onnxruntime", reason="the export extra is not installed")

IMAGE_SIZE = 16  # TINY's data.image_size
GPT = [
    *CPU,
    "model=gpt_tiny",
    "data=tokens",
    "model.gpt.dim=32",
    "model.gpt.n_layers=1",
    "model.gpt.seq_len=16",
    "data.train_size=256",
    "data.val_size=32",
    "optim=adamw",
    "optim.lr=0.01",
    "sched=constant",
    "loop.eval_at_epoch_end=false",
    "loop.max_steps=20",
    "loop.global_batch_size=32",
    "checkpoint.every_n_steps=20",
    "logging.log_every_n_steps=10",
    "model.ema.enabled=true",  # a moving average of the weights beside them, for ema=true
    "model.ema.decay=0.9",
]
CONTEXT = 16
BODY_LIMIT_MB = 0.25


# ---------------------------------------------------------------------- fixtures


def _train(args: list[str], run_dir, *, nproc: int | None = None) -> None:
    launch = run_cli(
        [*args, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, nproc=nproc, timeout=240
    )
    assert launch.returncode == 0, launch.output


def _reference(checkpoints) -> tuple[torch.nn.Module, object]:
    """The PyTorch model of the newest checkpoint, loaded as export loads it, and its config."""
    checkpoint = find_checkpoint(checkpoints, key="checkpoint")
    cfg = training_config(checkpoint)
    return load_model(Trainer(cfg), checkpoint), cfg


@pytest.fixture(scope="module")
def cnn_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("serve_cnn") / "run"
    _train(
        [*TINY, "loop.max_steps=4", "loop.global_batch_size=32", "checkpoint.every_n_steps=4"],
        run_dir,
        nproc=2,
    )
    return run_dir


@pytest.fixture(scope="module")
def cnn(cnn_run):
    return _reference(cnn_run / "checkpoints")


def _serve(args: list[str], env: dict[str, str] | None = None):
    server = ServerProcess(args, env={**cli_env(), **(env or {})}, cwd=REPO, start_timeout=240)
    server.start()
    yield server
    assert server.stop() == 0, server.output  # SIGTERM: a clean shutdown
    assert "Traceback" not in server.output, server.output


@pytest.fixture(scope="module")
def image_server(cnn_run, s3_module):
    """The CNN served from object storage: its checkpoints copied to a local S3 server, which the
    server finds through its environment (docs/checkpoints.md). The tests compare its replies
    with the model loaded from the local copy (``cnn``)."""
    store = f"{s3_module.url}/cnn/checkpoints"
    s3_module.fs.put(f"{cnn_run / 'checkpoints'}/", s3_module.key(f"{store}/"), recursive=True)
    yield from _serve(
        [
            f"checkpoint={store}",
            "max_wait_ms=50",
            "max_batch_size=8",
            f"max_body_mb={BODY_LIMIT_MB}",
        ],
        env=s3_module.env,
    )


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("serve_gpt") / "run"
    _train(GPT, run_dir)
    return run_dir


@pytest.fixture(scope="module")
def gpt(gpt_run):
    return _reference(gpt_run / "checkpoints")


@pytest.fixture(scope="module")
def gpt_server(gpt_run):
    yield from _serve(
        [
            f"checkpoint={gpt_run / 'checkpoints'}",
            "max_new_tokens=64",
            "max_wait_ms=20",
            "max_body_mb=1",
        ]
    )


@pytest.fixture
def image_client(image_server):
    client = Client(image_server.url)
    yield client
    client.close()


@pytest.fixture
def gpt_client(gpt_server):
    client = Client(gpt_server.url)
    yield client
    client.close()


# ---------------------------------------------------------------------- inputs and references


def _image(seed: int, size: tuple[int, int] = (23, 19)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def _expected(model, cfg, image: Image.Image) -> torch.Tensor:
    """The model's class probabilities for ``image`` through the data layer's eval transform."""
    _, val = build_transforms(cfg.data)
    with torch.no_grad():
        return torch.softmax(model(val(image)[None]), dim=-1)[0]


def _probabilities(reply, classes: int) -> torch.Tensor:
    assert reply.status == 200, reply.body
    probs = torch.full((classes,), float("nan"), dtype=torch.float64)
    for entry in reply.json()["predictions"]:
        probs[entry["index"]] = entry["probability"]
        assert entry["label"] == str(entry["index"])  # synthetic data: no class names
    return probs


def _assert_matches(reply, expected: torch.Tensor) -> None:
    got = _probabilities(reply, len(expected))
    assert int(got.nan_to_num(-1).argmax()) == int(expected.argmax())
    torch.testing.assert_close(got, expected.double(), rtol=0, atol=1e-5)


def _metric(client: Client, name: str, **labels: str) -> float:
    """The value of one series of /metrics (0 when absent)."""
    text = client.get("/metrics").body.decode()
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.partition("}")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _greedy(model, prompt: list[int], steps: int) -> list[int]:
    """The model's own greedy decode: the whole sequence each step, cropped to the context."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            logits = model(ids[:, -CONTEXT:])[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


# ---------------------------------------------------------------------- image models


def test_uploaded_images_get_the_pytorch_models_probabilities(image_client, cnn):
    model, cfg = cnn
    png, jpeg = _image(1), _image(2, size=(40, 30))
    expected = _expected(model, cfg, png)
    _assert_matches(image_client.post_file("/v1/predict?top_k=10", _encoded(png, "PNG")), expected)
    # JPEG as base64 JSON: the server decodes the same bytes the reference does.
    data = _encoded(jpeg, "JPEG")
    reply = image_client.post_json(
        "/v1/predict", {"image": base64.b64encode(data).decode(), "top_k": 10}
    )
    _assert_matches(reply, _expected(model, cfg, Image.open(io.BytesIO(data)).convert("RGB")))
    top = image_client.post_file("/v1/predict", _encoded(png, "PNG")).json()["predictions"]
    assert len(top) == 5 and top[0]["index"] == int(expected.argmax())  # top_k=5 by default


def test_preprocessing_is_the_eval_transform_and_tensors_skip_it(image_client, cnn):
    """A 16x16 image needs no resizing or cropping: its input is (pixels / 255 - mean) / std,
    computed here by hand; sent as a tensor, the same input gives the same probabilities."""
    model, _ = cnn
    image = _image(3, size=(IMAGE_SIZE, IMAGE_SIZE))
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255
    mean, std = torch.tensor(IMAGENET_MEAN), torch.tensor(IMAGENET_STD)
    inputs = (pixels - mean[:, None, None]) / std[:, None, None]
    with torch.no_grad():
        expected = torch.softmax(model(inputs[None]), dim=-1)[0]
    reply = image_client.post_file("/v1/predict?top_k=10", _encoded(image, "PNG"))
    _assert_matches(reply, expected)
    reply = image_client.post_json("/v1/predict", {"tensor": inputs.tolist(), "top_k": 10})
    _assert_matches(reply, expected)


def test_concurrent_requests_run_in_batches_with_the_same_results(image_server, cnn):
    model, cfg = cnn
    images = [_image(10 + i) for i in range(8)]
    replies: list = [None] * len(images)
    batches_before = _metric(Client(image_server.url), "sdnet_serve_batch_size_count")

    def send(i: int) -> None:
        client = Client(image_server.url)
        replies[i] = client.post_file("/v1/predict?top_k=10", _encoded(images[i], "PNG"))
        client.close()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(images))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for image, reply in zip(images, replies):
        _assert_matches(reply, _expected(model, cfg, image))
    batches = _metric(Client(image_server.url), "sdnet_serve_batch_size_count") - batches_before
    assert 1 <= batches < len(images)  # arriving within max_wait_ms=50, they shared batches


BAD_IMAGE_REQUESTS = {
    # name: (what to send, status, words of the reason)
    "not an image": ("file", b"\x00garbage" * 50, 415, "not a PNG or JPEG"),
    "truncated PNG": ("truncated", None, 400, "cannot decode"),
    "GIF": ("gif", None, 415, "not a PNG or JPEG"),
    "empty file": ("file", b"", 400, "empty"),
    "wrong tensor shape": ("json", {"tensor": [[[0.0] * 4] * 4] * 3}, 422, "shape [3, 4, 4]"),
    "ragged tensor": ("json", {"tensor": [[1.0, 2.0], [3.0]]}, 422, "rectangular"),
    "image and tensor": ("json", {"image": "aGk=", "tensor": [1.0]}, 422, "exactly one"),
    "unknown field": ("json", {"images": "aGk="}, 422, "images"),
    "bad base64": ("json", {"image": "not base64!"}, 400, "base64"),
    "wrong JSON": ("raw", b'{"image": ', 400, "not valid JSON"),
    "JSON not an object": ("raw", b"[1, 2]", 422, "body"),
    "no file field": ("field", None, 422, "'file'"),
    "plain text": ("text", b"hello", 415, "content type text/plain"),
    "top_k 0": ("topk0", None, 422, "top_k"),
    "oversize body": ("file", b"\x89PNG" + bytes(int(BODY_LIMIT_MB * 2**20)), 413, "max_body_mb"),
    "oversize chunked body": ("chunked", None, 413, "max_body_mb"),
}


def _send_bad(client: Client, kind: str, payload) -> object:
    png = _encoded(_image(4), "PNG")
    if kind == "file":
        return client.post_file("/v1/predict", payload)
    if kind == "truncated":
        return client.post_file("/v1/predict", png[: len(png) // 2])
    if kind == "gif":
        return client.post_file("/v1/predict", _encoded(_image(4), "GIF"), kind="image/gif")
    if kind == "json":
        return client.post_json("/v1/predict", payload)
    if kind == "raw":
        return client.request("POST", "/v1/predict", payload, {"Content-Type": "application/json"})
    if kind == "field":
        return client.post_file("/v1/predict", png, field="image")
    if kind == "text":
        return client.request("POST", "/v1/predict", payload, {"Content-Type": "text/plain"})
    if kind == "topk0":
        return client.post_file("/v1/predict?top_k=0", png)
    assert kind == "chunked"  # no Content-Length: refused once the bytes received pass the limit
    chunks = (b"x" * 65536 for _ in range(int(BODY_LIMIT_MB * 16) + 2))
    return client.request("POST", "/v1/predict", chunks, {"Content-Type": "application/json"})


@pytest.mark.parametrize("name", list(BAD_IMAGE_REQUESTS))
def test_bad_image_requests_get_a_4xx_and_the_next_request_is_served(image_client, cnn, name):
    kind, payload, status, words = BAD_IMAGE_REQUESTS[name]
    reply = _send_bad(image_client, kind, payload)
    assert reply.status == status, (reply.status, reply.body)
    assert words in reply.detail and "\n" not in reply.detail, reply.detail
    model, cfg = cnn
    image = _image(5)
    # The same client: its connection is opened again where the server closed it.
    _assert_matches(
        image_client.post_file("/v1/predict?top_k=10", _encoded(image, "PNG")),
        _expected(model, cfg, image),
    )


def test_metrics_count_the_requests_made(image_client):
    def counts() -> tuple[float, float, float]:
        return (
            _metric(image_client, "sdnet_serve_requests_total", route="/v1/predict", status="200"),
            _metric(image_client, "sdnet_serve_requests_total", route="/v1/predict", status="415"),
            _metric(image_client, "sdnet_serve_errors_total", route="/v1/predict", kind="client"),
        )

    before = counts()
    latency_before = _metric(
        image_client, "sdnet_serve_request_duration_seconds_count", route="/v1/predict"
    )
    for seed in range(3):
        assert image_client.post_file("/v1/predict", _encoded(_image(seed), "PNG")).status == 200
    assert image_client.post_file("/v1/predict", b"nope").status == 415
    after = counts()
    assert [b - a for a, b in zip(before, after)] == [3, 1, 1]
    latency = _metric(
        image_client, "sdnet_serve_request_duration_seconds_count", route="/v1/predict"
    )
    assert latency - latency_before == 4
    assert _metric(image_client, "sdnet_serve_ready") == 1


def test_health_readiness_and_the_openapi_page(image_client):
    assert image_client.get("/healthz").json() == {"status": "ok"}
    assert image_client.get("/readyz").json() == {"status": "ready"}
    body = image_client.get("/openapi.json").json()["paths"]["/v1/predict"]["post"]["requestBody"]
    assert {"multipart/form-data", "application/json"} <= set(body["content"])
    info = image_client.get("/v1/model").json()
    assert info["kind"] == "image" and info["input_shape"] == [3, IMAGE_SIZE, IMAGE_SIZE]
    assert (
        info["source"].startswith("step 4 of s3://") and "/cnn/checkpoints/step_" in info["source"]
    )


@pytest.fixture(scope="module")
def export_folder(cnn_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve_export") / "export"
    export(ExportArgs(checkpoint=str(cnn_run / "checkpoints"), format="pt,onnx", out=str(out)))
    return out


def test_an_export_folder_serves_on_onnxruntime(export_folder, cnn):
    model, cfg = cnn
    image = _image(6)
    with ServerProcess(
        [f"checkpoint={export_folder}", "backend=onnx"], env=cli_env(), cwd=REPO, start_timeout=240
    ) as server:
        client = Client(server.url)
        assert client.get("/v1/model").json()["backend"] == "onnx"
        reply = client.post_file("/v1/predict?top_k=10", _encoded(image, "PNG"))
        _assert_matches(reply, _expected(model, cfg, image))
        assert client.post_file("/v1/predict", b"nope").status == 415
        client.close()
    assert server.returncode == 0, server.output


def test_an_export_folders_model_pt_loads_as_the_checkpoint(export_folder, cnn):
    """backend=torch on the folder (its config.yaml and model.pt), in this process."""
    model, cfg = cnn
    args = parse_args([f"checkpoint={export_folder}"])
    served = load(args, resolve(args))
    image = _image(7)
    (probs,) = served.run([served.from_image(_encoded(image, "PNG"))])
    torch.testing.assert_close(probs, _expected(model, cfg, image), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- language models


PROMPTS = [[5], [1, 2, 3, 4, 5], list(range(7, 7 + CONTEXT))]


def test_greedy_continuations_equal_the_models_own(gpt_client, gpt):
    model, _ = gpt
    for prompt in PROMPTS:  # the last fills the context: every new token crops it
        reply = gpt_client.post_json("/v1/predict", {"prompt": prompt, "max_new_tokens": 12})
        assert reply.status == 200, reply.body
        body = reply.json()
        assert body["tokens"] == _greedy(model, prompt, 12)
        assert body["prompt_tokens"] == len(prompt) and body["text"] is None  # data=tokens


def test_concurrent_prompts_batch_with_the_same_continuations(gpt_server, gpt):
    model, _ = gpt
    prompts = [[i, i + 1, i + 2] for i in range(6)] + [[9], [3, 1]]
    replies: list = [None] * len(prompts)

    def send(i: int) -> None:
        client = Client(gpt_server.url)
        replies[i] = client.post_json("/v1/predict", {"prompt": prompts[i], "max_new_tokens": 8})
        client.close()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for prompt, reply in zip(prompts, replies):
        assert reply.status == 200, reply.body
        assert reply.json()["tokens"] == _greedy(model, prompt, 8)


def test_sampling_follows_the_seed(gpt_client):
    def sample(seed: int) -> list[int]:
        payload = {"prompt": [1, 2], "max_new_tokens": 10, "temperature": 1.0, "seed": seed}
        reply = gpt_client.post_json("/v1/predict", payload)
        assert reply.status == 200, reply.body
        return reply.json()["tokens"]

    first = sample(7)
    assert first == sample(7) and len(first) == 10 and all(0 <= t < 64 for t in first)


BAD_PROMPTS = {
    "over the context": ({"prompt": list(range(CONTEXT + 1))}, 422, "longer than the model's"),
    "outside the vocabulary": ({"prompt": [1, 64]}, 422, "outside the vocabulary"),
    "text without a tokenizer": ({"prompt": "hello"}, 422, "send token ids"),
    "empty prompt": ({"prompt": []}, 422, "empty"),
    "too many new tokens": ({"prompt": [1], "max_new_tokens": 65}, 422, "max_new_tokens"),
    "negative temperature": ({"prompt": [1], "temperature": -1}, 422, "temperature"),
    "prompt of the wrong type": ({"prompt": 5}, 422, "prompt"),
    "missing prompt": ({"max_new_tokens": 3}, 422, "prompt"),
    "wrong JSON": (b'{"prompt": [1,', 400, "not valid JSON"),
    "oversize body": (b'{"prompt": [' + b"1," * 800_000 + b"1]}", 413, "max_body_mb"),
}


@pytest.mark.parametrize("name", list(BAD_PROMPTS))
def test_bad_prompts_get_a_4xx_and_the_next_prompt_is_served(gpt_client, gpt, name):
    payload, status, words = BAD_PROMPTS[name]
    if isinstance(payload, bytes):
        headers = {"Content-Type": "application/json"}
        reply = gpt_client.request("POST", "/v1/predict", payload, headers)
    else:
        reply = gpt_client.post_json("/v1/predict", payload)
    assert reply.status == status, (reply.status, reply.body)
    assert words in reply.detail and "\n" not in reply.detail, reply.detail
    good = gpt_client.post_json("/v1/predict", {"prompt": [4, 2], "max_new_tokens": 5})
    assert good.json()["tokens"] == _greedy(gpt[0], [4, 2], 5)


def test_ema_true_serves_the_moving_average(gpt_run, gpt):
    """In this process: the checkpoint's EMA weights, as export loads them, not the weights."""
    checkpoint = find_checkpoint(gpt_run / "checkpoints", key="checkpoint")
    average = load_model(Trainer(training_config(checkpoint)), checkpoint, ema=True)
    args = parse_args([f"checkpoint={gpt_run / 'checkpoints'}", "ema=true"])
    served = load(args, resolve(args))
    prompt = [1, 2, 3]
    job = served.job(prompt, max_new_tokens=8, temperature=0.0, seed=None)
    assert served.run([job]) == [_greedy(average, prompt, 8)]
    tokens = torch.tensor([prompt])
    with torch.no_grad():
        assert not torch.allclose(average(tokens), gpt[0](tokens))  # another model indeed


def test_ema_true_without_an_average_exits_2(cnn_run, capsys):
    assert serve_main.main([f"checkpoint={cnn_run / 'checkpoints'}", "ema=true"]) == 2
    err = capsys.readouterr().err
    assert "ema=true" in err and "Traceback" not in err


# ---------------------------------------------------------------------- worker processes


SUPERVISOR = """
import uvicorn
from sdnet_trainer.serve.cli import _supervisor_class, listen

config = uvicorn.Config(
    "tests.e2e._asgi_app:app", workers=1, timeout_worker_healthcheck=120, log_level="info"
)
_supervisor_class()(config, sockets=[listen("127.0.0.1", 0)]).run()
"""


def test_the_supervisor_sees_a_worker_die_with_a_ping_unanswered(tmp_path):
    """A worker that cannot answer (stopped) is pinged, then killed: the supervisor sees the death
    at once and replaces it, where uvicorn's own would wait out the whole health-check timeout
    (120 s here) on its copy of the worker's pipe end (cli._supervisor_class)."""
    log = tmp_path / "server.log"
    server = start_command([sys.executable, "-c", SUPERVISOR], cwd=REPO, log=log)
    try:
        started = re.compile(r"Started server process \[(\d+)\]")
        wait_until(lambda: started.search(log.read_text()), timeout=60, what="the worker")
        worker = int(started.search(log.read_text())[1])
        os.kill(worker, signal.SIGSTOP)
        time.sleep(1.5)  # the supervisor's next ping (every 0.5 s) goes unanswered
        os.kill(worker, signal.SIGKILL)
        wait_until(
            lambda: f"Child process [{worker}] died" in log.read_text(),
            timeout=20,
            what="the supervisor to see the death",
        )
        wait_until(lambda: len(started.findall(log.read_text())) == 2, timeout=60, what="a new one")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_workers_that_cannot_load_the_model_stop_the_server_with_exit_2(tmp_path):
    """The workers' own failure to load (the parent's load first is skipped here): uvicorn's
    supervisor stops the server instead of restarting them, and the server exits 2. No worker
    was taken for hung while it imported torch on a busy machine (cli.WORKER_HEALTHCHECK_S)."""
    folder = unloadable_export_folder(tmp_path / "export")
    code = (
        "import sys; from sdnet_trainer.serve import cli as m; "
        "m.check_loads = lambda args: None; sys.exit(m.main(sys.argv[1:]))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, f"checkpoint={folder}", "workers=2", "port=0"],
        env=cli_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the server did not exit:\n{output}")
    assert proc.returncode == 2, output
    assert "weights do not fit" in output and "could not start" in output, output
    assert "Traceback" not in output, output
    assert "died" not in output, output  # uvicorn's word for a worker it killed and replaced
