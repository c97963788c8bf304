"""Serving throughput and latency on loopback: /v1/predict with dynamic batching on and off, and
streamed OpenAI completions with continuous batching on and off.

What it measures
    predict: two models, each trained for a few steps first (the figures do not depend on how
    well they predict): the quickstart recipe's CNN (32x32 images, 10 classes) and
    ``model=gpt_tiny`` on ``data=tokens`` (context 32, vocabulary 64). Each is served by
    ``python -m sdnet_trainer.serve`` twice, one process at a time on the CPU: batching off
    (``max_batch_size=1``) and on (``max_batch_size=32 max_wait_ms=5``). Against each server,
    a fixed number of requests (--requests) is sent at each concurrency (1, 8, 32 clients, each
    a thread with its own keep-alive connection, taking the next request when its last one is
    answered), after a few warm-up requests. The CNN gets a 32x32 PNG upload (multipart), the
    GPT a prompt of 8 token ids to continue by --new-tokens tokens (greedy).

    req/s: requests over the wall time of the whole level; p50 / p99: per-request latency (the
    client's time from sending to the full response). on/off: batching on over off, for req/s.

    llm: a transformers Llama of random weights (hidden 128, 4 layers, context 512) with a
    byte-level BPE of 300 tokens, saved as a Hugging Face folder made here (nothing is
    downloaded), served on the CPU by two servers up at once, both ``max_batch_size=32``:
    ``continuous_batching=true`` (on: requests join the decoding batch at the next step and
    leave when they end) and ``continuous_batching=false`` (off, static batching: a batch forms,
    waiting up to the default max_wait_ms, and runs until its last request ends). The official
    ``openai`` client (AsyncOpenAI) streams /v1/completions from N streams at once (1, 8, 32),
    each taking the next request when its last one ended, N x --llm-turns requests a level
    (at least LLM_LEAST_REQUESTS, 16, so that one stream's level is not over in a second):
    prompts of 5 to 151 tokens and max_tokens of 16 to 64, varied independently, greedy
    (temperature 0). The model has no EOS id, so every stream runs to its max_tokens (checked
    with the usage chunk, stream_options.include_usage) and both servers do the same work. Each
    round measures every level against one server, then the other (their order alternating
    round by round); the table gives the medians over --llm-rounds rounds, and each round's
    tokens/s follow it (on a shared machine, how far they spread says what the medians are
    worth).

    tokens/s: generated tokens (the usage chunks' completion_tokens) over the wall time of the
    whole level; TTFT p50: the median time from sending a request to its first chunk with text
    (the first token the server could turn into text); rows/step: tokens per decode step (the
    server's sdnet_serve_decode_steps on /metrics; a request's first token comes from its
    prefill), the decoding batch's mean size; on/off: continuous over static, for tokens/s. A
    request whose text differs between the servers or rounds (greedy: it should not), or a
    stream short of its max_tokens, is printed above the table.

    The servers and the clients share the machine's cores (the servers run one torch thread,
    OMP_NUM_THREADS=1); on a shared machine the figures move with its load, printed at the end.

Run (from the repository root)
    python scripts/bench/bench_serve.py                 # both: about four minutes on 2 CPU cores
    python scripts/bench/bench_serve.py --only predict  # about two minutes
    python scripts/bench/bench_serve.py --only llm      # about two minutes
    python scripts/bench/bench_serve.py --requests 256 --concurrency 1,8,32,64
    python scripts/bench/bench_serve.py --only llm --llm-rounds 5 --llm-turns 8

Exit status 0 with the tables printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import io
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _launch import REPO, run_launch  # scripts/ is on sys.path when run as a script
from PIL import Image

from sdnet_trainer.serve.client import Client, Reply, ServerProcess

TRAIN = {
    "quickstart": ["+recipe=quickstart", "loop.max_steps=10", "loop.eval_every_n_steps=10"],
    "gpt_tiny": ["model=gpt_tiny", "data=tokens", "optim=adamw", "loop.max_steps=10"],
}
COMMON = ["dist.device=cpu", "checkpoint.every_n_steps=10", "loop.eval_at_epoch_end=false"]
MODES = {"off": ["max_batch_size=1"], "on": ["max_batch_size=32", "max_wait_ms=5"]}
WARMUP = 4
SECTIONS = ("predict", "llm")

# The language-model section: a Llama of transformers (random weights) with a byte-level BPE of
# 300 tokens, served twice with max_batch_size=32 (max_wait_ms as the server's default).
LLM_NAME = "bench-llama"
LLM_SIZES: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
LLM_MODES = {
    "off": ["max_batch_size=32", "continuous_batching=false"],
    "on": ["max_batch_size=32", "continuous_batching=true"],
}
SENTENCE = "the cat sat on a mat while dogs ran far away from home and birds sang loud"
WORDS = SENTENCE.split()
LLM_LEAST_REQUESTS = 16  # a level's requests at the least


@dataclass(frozen=True)
class Level:
    rate: float  # requests per second
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True)
class Streamed:
    """One level of the language-model section in one round."""

    tokens_per_s: float
    ttft_p50_ms: float
    tokens: int
    texts: dict[int, str]  # request index -> its completion
    steps: float | None = None  # the server's decode steps (its /metrics), None if not found

    @property
    def rows_per_step(self) -> float | None:
        """Tokens per decode step: the batch's mean size (a request's first token comes from
        its prefill, not a step)."""
        if not self.steps:
            return None
        return (self.tokens - len(self.texts)) / self.steps


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=96, help="requests per level (default 96)")
    p.add_argument(
        "--concurrency",
        default="1,8,32",
        help="clients (predict) and streams (llm) at once, comma-separated (default 1,8,32)",
    )
    p.add_argument(
        "--new-tokens", type=int, default=16, help="tokens the GPT generates per request"
    )
    p.add_argument(
        "--models", default="quickstart,gpt_tiny", help="predict: which of the two to run"
    )
    p.add_argument(
        "--only",
        choices=SECTIONS,
        default=None,
        help="one section: predict (the CNN and GPT on /v1/predict) or llm (streamed "
        "completions, continuous batching on and off); default both",
    )
    p.add_argument(
        "--llm-rounds", type=int, default=3, help="LLM section: rounds, medians over them"
    )
    p.add_argument(
        "--llm-turns",
        type=int,
        default=4,
        help="LLM section: requests per stream and level (N streams send N times this)",
    )
    p.add_argument("--workdir", default=None, help="where the runs go (default: a temp folder)")
    return p.parse_args()


def train(name: str, workdir: Path) -> Path:
    run_dir = workdir / name
    cmd = [sys.executable, "-m", "sdnet_trainer", *TRAIN[name], *COMMON]
    run_launch([*cmd, f"hydra.run.dir={run_dir}"], workdir / f"{name}.log", timeout=300)
    return run_dir / "checkpoints"


def request_factory(name: str, new_tokens: int) -> Callable[[Client, int], Reply]:
    if name == "quickstart":
        pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        png = buffer.getvalue()
        return lambda client, i: client.post_file("/v1/predict", png)
    return lambda client, i: client.post_json(
        "/v1/predict",
        {"prompt": [(i + k) % 64 for k in range(8)], "max_new_tokens": new_tokens},
    )


def run_level(url: str, send: Callable[[Client, int], Reply], requests: int, clients: int) -> Level:
    """``requests`` requests from ``clients`` threads, each taking the next one when free."""
    latencies: list[float] = []
    failures: list[str] = []
    counter = iter(range(requests))
    lock = threading.Lock()

    def worker() -> None:
        client = Client(url)
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                break
            started = time.perf_counter()
            reply = send(client, i)
            elapsed = time.perf_counter() - started
            with lock:
                latencies.append(elapsed)
                if reply.status != 200:
                    failures.append(f"{reply.status} {reply.detail}")
        client.close()

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    wall = time.perf_counter() - started
    if failures or len(latencies) != requests:
        raise RuntimeError(f"{len(failures)} failed requests, e.g. {failures[:1]}")
    ms = sorted(x * 1000 for x in latencies)
    return Level(requests / wall, statistics.median(ms), ms[min(len(ms) - 1, int(0.99 * len(ms)))])


def bench_model(
    name: str, checkpoint: Path, args: argparse.Namespace, levels: list[int]
) -> dict[str, dict[int, Level]]:
    send = request_factory(name, args.new_tokens)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    results: dict[str, dict[int, Level]] = {}
    for mode, options in MODES.items():
        server = ServerProcess(
            [f"checkpoint={checkpoint}", "device=cpu", *options], env=env, cwd=REPO
        )
        with server:
            warm = Client(server.url)
            for i in range(WARMUP):
                send(warm, i)
            warm.close()
            results[mode] = {c: run_level(server.url, send, args.requests, c) for c in levels}
        print(f"  {name}: batching {mode} done", flush=True)
    return results


# ---------------------------------------------------------------------- the language-model section


def line_of_words(i: int) -> str:
    """Line ``i`` of the tokenizer's corpus and the prompts: 4 to 8 of WORDS."""
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(4 + i % 5))


def llm_requests(count: int) -> list[tuple[str, int]]:
    """``count`` requests (prompt, max_tokens): prompts of 1 to 16 lines (5 to 151 tokens)
    and max_tokens of 16 to 64, varied independently (the same for both servers)."""
    return [
        (" ".join(line_of_words(i + k) for k in range(1 + (i * 5) % 16)), 16 + (i * 19) % 49)
        for i in range(count)
    ]


def llm_folder(out: Path) -> Path:
    """A Hugging Face folder, as tests/unit/test_serve_openai.py makes one (nothing is
    downloaded): a transformers Llama of random weights (seed 0, peaked logits) without an EOS
    id, so that every stream runs to its max_tokens (vLLM's ignore_eos), and a byte-level BPE of
    300 tokens trained on the prompts' words, with the ChatML template."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from sdnet_trainer.data.chat import TEMPLATES

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([line_of_words(i) for i in range(200)], trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"eos_token": special[0], "bos_token": None, "chat_template": TEMPLATES["chatml"]}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=300, eos_token_id=None, bos_token_id=None, **LLM_SIZES)
    )
    with torch.no_grad():  # no near-ties for a batch's float rounding to flip
        lm.lm_head.weight.mul_(20)
    lm.save_pretrained(out)
    return out


async def stream_level(
    client: Any, requests: list[tuple[str, int]], streams: int, problems: list[str]
) -> Streamed:
    """``requests`` from ``streams`` clients at once, each streaming the next when its last one
    ended; what went wrong (an error, a stream short of its max_tokens) goes to ``problems``."""
    pending = list(enumerate(requests))[::-1]
    ttfts: list[float] = []
    tokens: list[int] = []
    texts: dict[int, str] = {}

    async def worker() -> None:
        while pending:
            i, (prompt, max_tokens) = pending.pop()
            started = time.perf_counter()
            first: float | None = None
            parts: list[str] = []
            finish, done = None, None
            stream = await client.completions.create(
                model=LLM_NAME,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                if chunk.choices:
                    choice = chunk.choices[0]
                    if first is None and (choice.text or choice.finish_reason):
                        first = time.perf_counter() - started
                    parts.append(choice.text)
                    finish = choice.finish_reason or finish
                if chunk.usage is not None:
                    done = chunk.usage.completion_tokens
            if done != max_tokens or finish != "length" or first is None:
                problems.append(
                    f"request {i} (max_tokens {max_tokens}): {done} tokens, finish_reason {finish}"
                )
            ttfts.append(first or 0.0)
            tokens.append(done or 0)
            texts[i] = "".join(parts)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(streams)))
    wall = time.perf_counter() - started
    return Streamed(sum(tokens) / wall, statistics.median(ttfts) * 1000, sum(tokens), texts)


def decode_steps(url: str) -> float | None:
    """The server's decode steps so far (sdnet_serve_decode_steps on /metrics)."""
    client = Client(url)
    try:
        reply = client.get("/metrics")
    finally:
        client.close()
    for line in reply.body.decode().splitlines():
        if line.startswith("sdnet_serve_decode_steps_total "):
            return float(line.split()[1])
    return None


async def llm_rounds(
    urls: dict[str, str], args: argparse.Namespace, levels: list[int], problems: list[str]
) -> dict[str, dict[int, list[Streamed]]]:
    """Every level against both servers, round after round, the servers' order alternating."""
    import openai

    clients = {
        mode: openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        for mode, url in urls.items()
    }
    try:
        warm = llm_requests(8)
        for client in clients.values():  # the first batches of a process are slow
            await stream_level(client, warm[:1], 1, problems)
            await stream_level(client, warm, 8, problems)
        results: dict[str, dict[int, list[Streamed]]] = {m: {c: [] for c in levels} for m in urls}
        for r in range(args.llm_rounds):
            order = list(urls) if r % 2 == 0 else list(urls)[::-1]
            for mode in order:
                for c in levels:
                    before = decode_steps(urls[mode])
                    level = stream_level(
                        clients[mode],
                        llm_requests(max(c * args.llm_turns, LLM_LEAST_REQUESTS)),
                        c,
                        problems,
                    )
                    run = await asyncio.wait_for(level, timeout=600)
                    after = decode_steps(urls[mode])
                    steps = None if before is None or after is None else after - before
                    results[mode][c].append(dataclasses.replace(run, steps=steps))
            print(f"  llm: round {r + 1} of {args.llm_rounds} done", flush=True)
        return results
    finally:
        for client in clients.values():
            await client.close()


def bench_llm(
    workdir: Path, args: argparse.Namespace, levels: list[int]
) -> dict[str, dict[int, list[Streamed]]]:
    """Both servers up at once (one idles while the other is measured), each level of each
    round against one then the other."""
    folder = llm_folder(workdir / "llama")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    problems: list[str] = []
    with contextlib.ExitStack() as stack:
        servers = {
            mode: stack.enter_context(
                ServerProcess(
                    [
                        f"checkpoint={folder}",
                        "device=cpu",
                        f"served_model_name={LLM_NAME}",
                        *options,
                    ],
                    env=env,
                    cwd=REPO,
                )
            )
            for mode, options in LLM_MODES.items()
        }
        try:
            results = asyncio.run(
                llm_rounds({m: s.url for m, s in servers.items()}, args, levels, problems)
            )
        except BaseException:
            for mode, server in servers.items():
                print(f"--- the {mode} server's last output:\n{server.output[-4000:]}")
            raise
    if problems:
        print(f"{len(problems)} streams went wrong, e.g.:", *problems[:5], sep="\n  ")
    for c in levels:  # greedy: each request's text the same from both servers, every round
        runs = [run.texts for mode in results for run in results[mode][c]]
        differ = sum(len({texts[i] for texts in runs}) > 1 for i in runs[0])
        if differ:
            print(f"{c} streams: {differ} of {len(runs[0])} completions differ between runs")
    return results


def llm_table(results: dict[str, dict[int, list[Streamed]]], levels: list[int]) -> str:
    head = (
        "| streams | off tokens/s | off TTFT p50 ms | off rows/step | on tokens/s | "
        "on TTFT p50 ms | on rows/step | on/off tokens/s |"
    )
    rows = [head, "|" + "---|" * 8]
    for c in levels:
        rate = {m: statistics.median(r.tokens_per_s for r in results[m][c]) for m in results}
        cells = [str(c)]
        for mode in ("off", "on"):
            runs = results[mode][c]
            sizes = [r.rows_per_step for r in runs]
            known = [size for size in sizes if size is not None]
            cells += [
                f"{rate[mode]:.0f}",
                f"{statistics.median(r.ttft_p50_ms for r in runs):.1f}",
                f"{statistics.median(known):.1f}" if len(known) == len(sizes) else "-",
            ]
        cells.append(f"{rate['on'] / rate['off']:.2f}")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def table(all_results: dict[str, dict[str, dict[int, Level]]], levels: list[int]) -> str:
    head = (
        "| model | clients | off req/s | off p50 ms | off p99 ms | on req/s | on p50 ms | "
        "on p99 ms | on/off req/s |"
    )
    rows = [head, "|" + "---|" * 9]
    for name, results in all_results.items():
        for c in levels:
            off, on = results["off"][c], results["on"][c]
            rows.append(
                f"| {name} | {c} | {off.rate:.1f} | {off.p50_ms:.1f} | {off.p99_ms:.1f} | "
                f"{on.rate:.1f} | {on.p50_ms:.1f} | {on.p99_ms:.1f} | {on.rate / off.rate:.2f} |"
            )
    return "\n".join(rows)


def main() -> int:
    args = parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(TRAIN))
    if unknown:
        print(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(TRAIN)}")
        return 2
    sections = [args.only] if args.only else list(SECTIONS)
    if args.llm_rounds < 1 or args.llm_turns < 1:
        print("--llm-rounds and --llm-turns: 1 or more")
        return 2
    load_before = os.getloadavg()[0]
    results: dict[str, Any] = {}
    llm: dict[str, dict[int, list[Streamed]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_serve_", dir=args.workdir) as tmp:
        if "predict" in sections:
            for name in models:
                print(f"training {name} for a few steps ...", flush=True)
                checkpoint = train(name, Path(tmp))
                results[name] = bench_model(name, checkpoint, args, levels)
        if "llm" in sections:
            print("LLM: streamed completions, continuous batching on and off ...", flush=True)
            llm = bench_llm(Path(tmp), args, levels)
    if results:
        print(
            f"\n/v1/predict: {args.requests} requests per level; GPT: 8-token prompts, "
            f"{args.new_tokens} new tokens; batching on: max_batch_size=32 max_wait_ms=5; off: "
            f"max_batch_size=1\n"
        )
        print(table(results, levels))
    if llm:
        sizes = LLM_SIZES
        print(
            f"\n/v1/completions, streamed: Llama (hidden {sizes['hidden_size']}, "
            f"{sizes['num_hidden_layers']} layers, context {sizes['max_position_embeddings']}, "
            f"vocabulary 300), greedy; N streams send {args.llm_turns}N requests per level "
            f"(at least {LLM_LEAST_REQUESTS}) "
            f"(prompts of 5-151 tokens, max_tokens 16-64, every stream to its max_tokens); "
            f"max_batch_size=32, continuous_batching on / off (static); medians of "
            f"{args.llm_rounds} rounds\n"
        )
        print(llm_table(llm, levels))
        print("\ntokens/s of each round, off | on:")
        for c in levels:
            rounds = {m: ", ".join(f"{r.tokens_per_s:.0f}" for r in llm[m][c]) for m in llm}
            print(f"  {c} streams: {rounds['off']} | {rounds['on']}")
    print(f"\nload average (1 min) before {load_before:.2f}, after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
