"""The OpenAI API of the server (sdnet_trainer.serve.openai_api) and its continuous batching
(sdnet_trainer.serve.engine), checked with the official ``openai`` client against the server on
127.0.0.1 (uvicorn in a thread of the test), serving a tiny transformers Llama with a byte-level
BPE tokenizer and a ChatML chat template, both made here (no download): greedy completions and
chats, whole and streamed, equal transformers' ``generate``; 32 concurrent streams each equal
their request served alone, and share decode steps; a client that disconnects frees its slot at
the next step; what the server cannot take is a 4xx naming the field."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from sdnet_trainer.data.chat import TEMPLATES, ChatRenderer, encode_conversations  # noqa: E402
from sdnet_trainer.serve.app import create_app  # noqa: E402
from sdnet_trainer.serve.args import ServeArgs  # noqa: E402
from sdnet_trainer.serve.batching import QueueFull  # noqa: E402
from sdnet_trainer.serve.decoding import Job, RunningBatch, generate  # noqa: E402
from sdnet_trainer.serve.engine import Engine  # noqa: E402
from sdnet_trainer.serve.model import load_served  # noqa: E402
from sdnet_trainer.serve.openai_api import TextCut  # noqa: E402
from tests.support import tiny_llama_config, write_bpe_tokenizer  # noqa: E402

CONTEXT, NAME = 160, "tiny-chat"
USER = [{"role": "user", "content": "the cat sat on a mat"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A transformers folder: the Llama (EOS 0, the tokenizer's) and its tokenizer files."""
    out = write_bpe_tokenizer(tmp_path_factory.mktemp("chat_llama"), template=TEMPLATES["chatml"])
    config = tiny_llama_config(
        vocab_size=300,
        intermediate_size=64,
        max_position_embeddings=CONTEXT,
        eos_token_id=0,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # peaked logits: no near-ties for float rounding to flip
        lm.lm_head.weight.mul_(20)
    lm.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def served(folder):
    args = ServeArgs(
        checkpoint=str(folder), device="cpu", max_new_tokens=96, served_model_name=NAME
    )
    model, source = load_served(args)
    return model, args, source


@pytest.fixture(scope="module")
def url(served):
    """The server's base URL: uvicorn in a thread, on a free port of 127.0.0.1."""
    model, args, source = served
    server = uvicorn.Server(
        uvicorn.Config(create_app(model, args, source=source), port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _reference(folder, ids: list[int], max_tokens: int) -> list[int]:
    """transformers' own greedy generate, stopping at the model's EOS as the server does."""
    lm = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    prompt = torch.tensor([ids])
    out = lm.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


# ---------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_greedy_completions_and_chats_are_transformers_generate(folder, served, client, stream):
    model = served[0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    # What apply_chat_template(tokenize=True) does: render, then tokenize without special tokens.
    rendered = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    chat_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert model.chat_prompt(USER) == chat_ids  # the template rendered as transformers does
    cases = {
        "completion": (
            model.job("the cat sat", max_new_tokens=1, temperature=0.0, seed=None).tokens,
            24,
        ),
        "chat": (chat_ids, 40),
    }
    for kind, (ids, max_tokens) in cases.items():
        expected = _reference(folder, ids, max_tokens)
        request = {"model": NAME, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        if kind == "chat":
            reply = client.chat.completions.create(messages=USER, **request)
        else:
            reply = client.completions.create(prompt="the cat sat", **request)
        if stream:
            chunks = list(reply)
            assert len(chunks) >= 3, kind  # in pieces as the tokens come, not one body
            pieces = [
                (c.choices[0].delta.content if kind == "chat" else c.choices[0].text) or ""
                for c in chunks
            ]
            text, finish = "".join(pieces), chunks[-1].choices[0].finish_reason
            assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
            assert len({c.id for c in chunks}) == 1
        else:
            choice = reply.choices[0]
            text = choice.message.content if kind == "chat" else choice.text
            finish = choice.finish_reason
            assert reply.usage.prompt_tokens == len(ids)
            assert reply.usage.completion_tokens == len(expected)
            assert reply.model == NAME
        assert text == tokenizer.decode(expected, skip_special_tokens=True), kind
        assert finish == ("stop" if expected[-1] == 0 else "length"), kind


def test_the_served_chat_prompt_is_where_training_put_the_reply(served, tmp_path):
    """data=chat trains the assistant's tokens right after the tokens of the conversation before
    it and the opened reply: the served prompt is exactly those."""
    model = served[0]
    tokenizer = model.codec.tokenizer
    renderer = ChatRenderer(TEMPLATES["chatml"], tokenizer=tokenizer, source="chatml")
    conversation = [*USER, {"role": "assistant", "content": "dogs ran far away"}]
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": conversation}) + "\n")
    [(ids, trained, _)] = list(encode_conversations([data], tokenizer, renderer, eos=0))
    prompt = model.chat_prompt(USER)
    assert ids[: len(prompt)] == prompt
    assert not any(trained[: len(prompt)]) and trained[len(prompt)] == 1


def test_models_lists_the_one_model(client):
    assert [m.id for m in client.models.list().data] == [NAME]


# ---------------------------------------------------------------------- continuous batching


def test_rows_that_join_and_leave_a_running_batch_decode_as_alone(served):
    decoder = served[0].decoder
    jobs = [Job([5, 17, 3, 9], 12, 0.0, None), Job(list(range(30, 52)), 5, 0.0, None)]
    alone = [generate(decoder, [job])[0] for job in jobs]
    batch = RunningBatch(decoder)
    [first] = batch.add([jobs[0]])
    for _ in range(3):
        batch.step()
    [second] = batch.add([jobs[1]])  # joins a batch 4 tokens in, with a longer prompt
    while batch.rows:
        batch.step()
    assert [first.tokens, second.tokens] == alone
    assert batch.columns == 0  # the state is released with its last row


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "static"])
def test_a_request_joins_the_running_batch_only_with_continuous_batching(served, continuous):
    """A long request runs; a short one arrives after its first token. Continuous: the short
    one joins at the next step and ends first. Static (continuous_batching=false): it waits for
    the batch to end. Either way each gets the tokens it would alone."""
    decoder = served[0].decoder
    long, short = Job([5, 17, 3, 9], 30, 0.0, None), Job([40, 41, 42], 3, 0.0, None)
    alone = [generate(decoder, [job])[0] for job in (long, short)]

    async def run() -> tuple[list[list[int]], list[str]]:
        engine = Engine(
            decoder, max_batch_size=8, max_queue=8, context=CONTEXT, continuous=continuous
        )
        engine.start()
        ended: list[str] = []
        try:
            first = engine.submit(long)
            tokens = [await first.__anext__()]

            async def rest_of(name, stream, tokens):
                tokens += [token async for token in stream]
                ended.append(name)
                return tokens

            results = await asyncio.gather(
                rest_of("long", first, tokens), rest_of("short", engine.submit(short), [])
            )
        finally:
            await engine.stop()
        return list(results), ended

    results, ended = asyncio.run(run())
    assert results == alone
    assert ended == (["short", "long"] if continuous else ["long", "short"])


def test_requests_beyond_the_queue_are_refused_and_an_aborted_waiter_never_runs(served):
    decoder = served[0].decoder

    async def run() -> None:
        engine = Engine(decoder, max_batch_size=1, max_queue=1, context=CONTEXT)
        engine.start()
        try:
            running = engine.submit(Job([5, 6, 7], 60, 0.0, None))
            await running.__anext__()  # it runs: the one slot is taken
            waiting = engine.submit(Job([8, 9], 5, 0.0, None))
            with pytest.raises(QueueFull):
                engine.submit(Job([8, 9], 5, 0.0, None))
            waiting.abort()
            assert await waiting.tokens() == [] and waiting.finish_reason == "abort"
            assert len(await running.tokens()) == 59 or running.finish_reason == "stop"
        finally:
            await engine.stop()

    asyncio.run(run())


def test_32_concurrent_streams_share_decode_steps_and_each_is_its_request_alone(served, url):
    model = served[0]
    prompts = [("the cat sat on a mat while dogs ran " * 3)[: 4 + 3 * i] for i in range(32)]
    limits = [8 + (7 * i) % 25 for i in range(32)]
    alone = [
        model.text(model.run([model.job(p, max_new_tokens=n, temperature=0.0, seed=None)])[0])
        for p, n in zip(prompts, limits)
    ]
    before = _metrics(url)

    async def one(client, prompt, limit):
        stream = await client.completions.create(
            model=NAME, prompt=prompt, max_tokens=limit, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def everyone():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused") as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, limits)))

    assert asyncio.run(everyone()) == alone
    after = _metrics(url)
    steps = after["sdnet_serve_decode_steps_total"] - before["sdnet_serve_decode_steps_total"]
    tokens = (
        after["sdnet_serve_generation_tokens_total"] - before["sdnet_serve_generation_tokens_total"]
    )
    # One request after another would take a step per token; together they took about as many
    # steps as the longest request has tokens.
    assert steps < tokens / 4, (steps, tokens)
    assert after["sdnet_serve_num_requests_running"] == 0


def test_a_client_that_disconnects_frees_its_slot_at_the_next_step(served, url, monkeypatch):
    model = served[0]
    decoder_step = model.decoder.step

    def slow_step(*args):  # 20 ms a token: the stream is still running when the client leaves
        time.sleep(0.02)
        return decoder_step(*args)

    monkeypatch.setattr(model.decoder, "step", slow_step)
    before = _metrics(url)
    body = {"model": NAME, "prompt": [5, 6, 7], "max_tokens": 90, "temperature": 0, "stream": True}
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
    )
    reply = connection.getresponse()
    assert reply.status == 200
    events = [reply.fp.readline().decode() for _ in range(6)]  # a few tokens, then it leaves
    connection.close()
    assert any(e.startswith("data: {") for e in events)
    aborted = 'sdnet_serve_requests_finished_total{finish_reason="abort"}'
    deadline = time.monotonic() + 20
    while (after := _metrics(url)).get(aborted, 0) <= before.get(aborted, 0):
        assert time.monotonic() < deadline, "the aborted stream never left the batch"
        time.sleep(0.02)
    assert after["sdnet_serve_num_requests_running"] == 0
    count = "sdnet_serve_request_abort_steps_count"
    total = "sdnet_serve_request_abort_steps_sum"
    assert after[count] - before.get(count, 0) == 1
    assert after[total] - before.get(total, 0) <= 1  # freed within one decode step
    # Far fewer steps than the 90 tokens it asked for.
    steps = after["sdnet_serve_decode_steps_total"] - before["sdnet_serve_decode_steps_total"]
    assert steps < 45


def test_a_model_without_a_cache_answers_the_same_api_in_whole_batches():
    """The project's GPT and ONNX graphs keep no cache: their requests run as whole batches and
    a stream sends the result when it is done, framed as any stream."""
    from fastapi.testclient import TestClient

    from sdnet_trainer.serve.language import Codec, LanguageModel

    def next_byte_is_plus_one(ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot((ids + 1) % 256, 256).float()

    model = LanguageModel(
        next_byte_is_plus_one, context=32, vocab_size=256, codec=Codec("bytes"), max_new_tokens=8
    )
    app = create_app(model, ServeArgs(checkpoint="plus-one"), source="test")
    body = {"model": "plus-one", "prompt": "ab", "max_tokens": 4, "temperature": 0}
    with TestClient(app) as client:
        assert client.get("/v1/model").json()["continuous_batching"] is False
        whole = client.post("/v1/completions", json=body).json()
        assert whole["choices"][0]["text"] == "cdef"
        assert whole["choices"][0]["finish_reason"] == "length"
        assert whole["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
        lines = client.post("/v1/completions", json={**body, "stream": True}).text.split("\n\n")
    events = [line.removeprefix("data: ") for line in lines if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "cdef"
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"

    def broken(ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no memory left")

    model.runner = broken  # its failure is said once, in one line, on every route
    failed = "the model failed: RuntimeError: no memory left"
    with TestClient(app) as client:
        predict = client.post("/v1/predict", json={"prompt": "ab", "max_new_tokens": 2})
        assert (predict.status_code, predict.json()) == (500, {"detail": failed})
        whole = client.post("/v1/completions", json=body)
        assert (whole.status_code, whole.json()["error"]["message"]) == (500, failed)
        streamed = client.post("/v1/completions", json={**body, "stream": True}).text
    assert json.loads(streamed.removeprefix("data: "))["error"]["message"] == failed


def test_a_model_that_fails_is_a_500_in_one_line_and_the_server_goes_on(served, url, monkeypatch):
    """A failure in a decode step reaches the request as one line (500; a stream's error event),
    said once, and the next request is served."""
    model = served[0]
    decoder_step = model.decoder.step

    def failing_step(*args):
        raise RuntimeError("no memory left\nsecond line")

    monkeypatch.setattr(model.decoder, "step", failing_step)
    body = {"model": NAME, "prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0}
    code, reply = _post(f"{url}/v1/completions", json.dumps(body).encode())
    assert code == 500
    assert reply["error"]["message"] == "the model failed: RuntimeError: no memory left"
    code, reply = _post(
        f"{url}/v1/predict", json.dumps({"prompt": [5, 6], "max_new_tokens": 3}).encode()
    )
    assert (code, reply) == (500, {"detail": "the model failed: RuntimeError: no memory left"})
    monkeypatch.setattr(model.decoder, "step", decoder_step)
    code, reply = _post(f"{url}/v1/completions", json.dumps(body).encode())
    assert code == 200 and reply["usage"]["completion_tokens"] >= 1


# ---------------------------------------------------------------------- text and refusals


def test_stop_strings_cut_the_text_and_are_held_back_while_undecided(served):
    model = served[0]
    ids = model.codec.tokenizer.encode(["the cat sat on a mat"])[0]
    cut = TextCut(model, ["sat on"])
    sent = "".join(cut.add(token) for token in ids)
    assert cut.stopped and sent == cut.text == "the cat "
    cut = TextCut(model, ["mat!"])  # "mat" might begin the stop string: held until the end
    sent = "".join(cut.add(token) for token in ids)
    assert (
        not cut.stopped and not sent.endswith("mat") and sent + cut.rest() == "the cat sat on a mat"
    )


def test_a_stop_string_ends_the_choice_with_reason_stop(client):
    full = client.completions.create(model=NAME, prompt="the", max_tokens=20, temperature=0)
    text = full.choices[0].text
    stop = text[3:6]
    assert stop, text
    cut = client.completions.create(
        model=NAME, prompt="the", max_tokens=20, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_sampling_with_a_seed_repeats_and_n_choices_differ(client):
    request = {"model": NAME, "prompt": "the cat", "max_tokens": 12, "temperature": 1.0}
    first = client.completions.create(seed=3, n=3, **request)
    again = client.completions.create(seed=3, n=3, **request)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices] and len(set(texts)) > 1
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert first.usage.prompt_tokens == len(served_tokens(client, "the cat"))


def served_tokens(client, text):
    """The prompt's tokens, as the server counts them (usage of a one-token completion)."""
    reply = client.completions.create(model=NAME, prompt=text, max_tokens=1, temperature=0)
    return [None] * reply.usage.prompt_tokens


@pytest.mark.parametrize(
    ("route", "body", "status", "words"),
    [
        ("completions", {"prompt": "x", "model": "other"}, 404, "model"),
        ("completions", {"prompt": "x", "max_tokens": 10_000}, 422, "max_tokens"),
        ("completions", {"prompt": "x" * 20_000}, 422, "prompt"),
        ("completions", {"prompt": "x", "logprobs": 2}, 422, "logprobs"),
        ("completions", {"prompt": "x", "n": 99}, 422, "n"),
        ("completions", {"prompt": "x", "temperature": 9}, 422, "temperature"),
        ("completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 422, "stop"),
        ("completions", {"prompt": [1, 2, 10**6]}, 422, "prompt"),
        ("chat/completions", {"messages": []}, 422, "messages"),
        ("chat/completions", {"messages": [{"role": "user"}]}, 422, "messages.0.content"),
        ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 422, "messages"),
        ("chat/completions", {"messages": USER, "tools": [{"type": "function"}]}, 422, "tools"),
    ],
)
def test_what_the_server_cannot_take_is_a_4xx_naming_the_field(url, route, body, status, words):
    code, reply = _post(f"{url}/v1/{route}", json.dumps(body).encode())
    assert code == status, reply
    error = reply["error"]
    assert words in error["message"] and error["code"] == status
    assert re.fullmatch(r"[a-z_]+_error", error["type"])


def test_a_body_that_is_not_json_or_too_large_is_refused(url, client):
    code, reply = _post(f"{url}/v1/chat/completions", b"{not json")
    assert code == 400 and "JSON" in reply["error"]["message"]
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model=NAME, prompt="x" * (17 * 2**20), max_tokens=1)
    assert refused.value.status_code == 413
