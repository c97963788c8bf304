"""The OpenAI API for language models: ``GET /v1/models``, ``POST /v1/completions`` and
``POST /v1/chat/completions``, with ``stream=true`` as server-sent events.

What the API documents, as vLLM serves it: ``model`` (this server's one model:
``served_model_name``, else the ``checkpoint`` argument as given), ``prompt`` (text, token ids,
or a list of either) or ``messages`` (rendered by the model's chat template:
:meth:`~sdnet_trainer.serve.language.LanguageModel.chat_prompt`), ``max_tokens`` (chat:
``max_completion_tokens`` too; completions default to 16, chat to what the context and the
server's ``max_new_tokens`` leave), ``temperature`` (default 1), ``top_p``, ``n``, ``stop`` (up
to 4 strings: the text ends before the first, which is not returned), ``seed`` (choice ``i`` of
``n`` draws with ``seed + i``), ``stream`` and ``stream_options.include_usage``; beyond the API,
``top_k`` and ``stop_token_ids`` as vLLM takes them. Options this server does not implement
(``logprobs``, ``echo``, ``suffix``, ``best_of`` above 1, penalties, tools, a JSON response
format) are refused with 422 naming them rather than ignored. Other unknown fields are ignored,
as OpenAI's clients send new ones first.

Responses carry ``id``, ``object``, ``created``, ``model``, ``choices[]`` with
``finish_reason`` (``stop``: a stop token or string; ``length``: ``max_tokens``) and ``usage``.
A stream sends one chunk per token (its new text: a token that ends inside a UTF-8 character or
could begin a stop string is held back until it is settled; tokens that came while the previous
chunk was being sent go together), the last chunk of each choice with
its ``finish_reason``, the usage chunk when asked, then ``data: [DONE]``. A client that
disconnects mid-stream aborts its requests: they leave the decoding batch at the next step.

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the status
of the same refusal on ``/v1/predict``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from typing import Any, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from sdnet_trainer.serve.decoding import STOP, Job
from sdnet_trainer.serve.errors import InputError, first_line, one_line
from sdnet_trainer.serve.language import LanguageModel

ROUTES = frozenset({"/v1/models", "/v1/completions", "/v1/chat/completions"})
# What the API says a completion gets when max_tokens is not given.
COMPLETION_DEFAULT_TOKENS = 16
MAX_CHOICES = 16  # n: each choice is a request of its own
MAX_STOP_STRINGS = 4

Prepare = Callable[..., Awaitable[Any]]


class Streaming(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class Sampling(BaseModel):
    """What both endpoints take."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[StrictStr] = None
    max_tokens: Optional[int] = Field(None, ge=0)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: Optional[int] = Field(None, ge=-1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: Union[None, StrictStr, list[StrictStr]] = None
    stop_token_ids: list[StrictInt] = Field(default_factory=list, max_length=256)
    seed: Optional[int] = Field(None, ge=0, lt=2**63 - MAX_CHOICES)
    stream: bool = False
    stream_options: Optional[Streaming] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None

    def unsupported(self) -> dict[str, Any]:
        """The options set that this server does not implement."""
        return {
            "presence_penalty": self.presence_penalty or None,
            "frequency_penalty": self.frequency_penalty or None,
            "logit_bias": self.logit_bias or None,
        }


class CompletionRequest(Sampling):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def unsupported(self) -> dict[str, Any]:
        return {
            **super().unsupported(),
            "echo": self.echo or None,
            "logprobs": self.logprobs,
            "suffix": self.suffix,
            "best_of": self.best_of if self.best_of not in (None, 1) else None,
        }


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: StrictStr = Field(min_length=1, max_length=64)
    content: Union[StrictStr, list[TextPart]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None

    def unsupported(self) -> dict[str, Any]:
        text_format = self.response_format is None or self.response_format.get("type") == "text"
        return {
            **super().unsupported(),
            "logprobs": self.logprobs or None,
            "top_logprobs": self.top_logprobs,
            "tools": self.tools or None,
            "tool_choice": self.tool_choice if self.tool_choice not in (None, "none") else None,
            "response_format": None if text_format else self.response_format,
        }


# ---------------------------------------------------------------------- text as it is generated


class TextCut:
    """A choice's text as its tokens arrive: what may be sent now (the text settled so far), cut
    before the first stop string (then :attr:`stopped`)."""

    def __init__(self, model: LanguageModel, stops: Sequence[str]) -> None:
        self.model = model
        self.stops = [s for s in stops if s]
        self.tokens: list[int] = []
        self.sent = 0  # characters of the text sent so far
        self.text = ""
        self.stopped = False

    def add(self, token: int) -> str:
        """The new text that is settled after ``token``."""
        self.tokens.append(token)
        text = self.model.text(self.tokens) or ""
        cut = self._first_stop(text)
        if cut is not None:
            self.text, self.stopped = text[:cut], True
            return self._send(len(self.text))
        self.text = text
        settled = len(text)
        while settled > self.sent and text[settled - 1] == "\ufffd":
            settled -= 1  # a character whose UTF-8 bytes have not all come
        settled -= self._stop_prefix(text[:settled])
        return self._send(settled)

    def rest(self) -> str:
        """The text not sent yet, once the choice ended."""
        return self._send(len(self.text))

    def _send(self, end: int) -> str:
        end = max(end, self.sent)
        new, self.sent = self.text[self.sent : end], end
        return new

    def _first_stop(self, text: str) -> int | None:
        # A stop string that ends in the new text starts at most its length before the end of
        # what was already sent.
        start = max(0, self.sent - max((len(s) for s in self.stops), default=0))
        found = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _stop_prefix(self, text: str) -> int:
        """The length of the longest end of ``text`` that begins a stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest


# ---------------------------------------------------------------------- the routes


def error_response(status: int, reason: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """A refusal in the OpenAI API's shape; ``param`` is the field the reason starts with."""
    kinds = {404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}
    kind = kinds.get(status, "invalid_request_error" if status < 500 else "server_error")
    field = reason.split(":", 1)[0] if ":" in reason else ""
    param = field if field.replace(".", "").replace("_", "").isalnum() else None
    body = {"error": {"message": reason, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


# One generation: the job's tokens as they come, then how it ended (the engine's Stream, or the
# whole result of a batch for a model without a KV cache).
Generate = Callable[[Job], Awaitable[Any]]


def add_openai_routes(
    app: FastAPI,
    model: LanguageModel,
    *,
    name: str,
    generate: Generate,
    prepare: Prepare,
) -> None:
    """The three routes on ``app``, serving ``model`` under ``name``; ``generate`` starts a
    job's stream (raising QueueFull or Stopped as /v1/predict does)."""
    created = int(time.time())

    @app.get("/v1/models", summary="The served model (OpenAI API)")
    async def models() -> dict[str, Any]:
        card = {"id": name, "object": "model", "created": created, "owned_by": "sdnet_trainer"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", summary="Continue prompts (OpenAI API)")
    async def completions(request: Request) -> Any:
        body = await _parse(request, CompletionRequest, name)
        prompts = _completion_prompts(body)
        return await _answer(model, body, prompts, generate, prepare, name, chat=False)

    @app.post("/v1/chat/completions", summary="Answer a conversation (OpenAI API)")
    async def chat(request: Request) -> Any:
        body = await _parse(request, ChatRequest, name)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt = await prepare(model.chat_prompt, messages)
        return await _answer(model, body, [prompt], generate, prepare, name, chat=True)


async def _parse(request: Request, kind: type[Sampling], name: str) -> Any:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise InputError(415, f"content type {media}: send application/json")
    try:
        body = kind.model_validate_json(await request.body())
    except ValidationError as err:
        raise InputError(*one_line(list(err.errors()))) from None
    for key, value in body.unsupported().items():
        if value is not None:
            raise InputError(422, f"{key}: this server does not implement it")
    if body.model is not None and body.model != name:
        raise InputError(
            404, f"model: the model {body.model!r} does not exist; this server serves {name!r}"
        )
    stops = _stop_strings(body)
    if len(stops) > MAX_STOP_STRINGS or any(not stop for stop in stops):
        raise InputError(422, f"stop: up to {MAX_STOP_STRINGS} non-empty strings")
    return body


def _completion_prompts(body: CompletionRequest) -> list[Any]:
    """The request's prompts: one, or each of a list of texts or of token-id lists."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise InputError(422, "prompt: empty; it needs at least one token")
    return list(prompt)


def _stop_strings(body: Sampling) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


def _jobs(model: LanguageModel, body: Any, prompts: list[Any], *, chat: bool) -> list[Job]:
    """Each prompt's ``n`` jobs, in the order of the choices (prompts tokenized here, off the
    event loop)."""
    if model.codec.kind == "ids":
        raise InputError(
            400, "prompt: this model's data has no text form (data=tokens): use /v1/predict"
        )
    key, limit = "max_tokens", body.max_tokens
    if chat and body.max_completion_tokens is not None:
        key, limit = "max_completion_tokens", body.max_completion_tokens
    temperature = 1.0 if body.temperature is None else body.temperature
    seed = body.seed
    if seed is None and temperature > 0:
        seed = secrets.randbits(62)
    return [
        model.job(
            prompt,
            max_new_tokens=limit,
            temperature=temperature,
            seed=None if seed is None else seed + i,
            top_p=1.0 if body.top_p is None else body.top_p,
            stop=body.stop_token_ids,
            top_k=max(body.top_k or 0, 0),
            default_new_tokens=model.max_new_tokens if chat else COMPLETION_DEFAULT_TOKENS,
            limit_key=key,
        )
        for prompt in prompts
        for i in range(body.n)
    ]


async def _answer(
    model: LanguageModel,
    body: Any,
    prompts: list[Any],
    generate: Generate,
    prepare: Prepare,
    name: str,
    *,
    chat: bool,
) -> Any:
    jobs = await prepare(partial(_jobs, chat=chat), model, body, prompts)
    prompt_tokens = sum(len(jobs[p * body.n].tokens) for p in range(len(prompts)))
    started: list[Any] = []
    try:
        for job in jobs:
            started.append(await generate(job))
    except BaseException:
        for stream in started:  # a full queue refuses the whole request
            stream.abort()
        raise
    stops = _stop_strings(body)
    choices = [_Choice(i, stream, TextCut(model, stops)) for i, stream in enumerate(started)]
    reply = _Reply(name, chat=chat, prompt_tokens=prompt_tokens)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(
            reply.events(choices, usage=usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        await asyncio.gather(*(choice.run() for choice in choices))
    finally:
        for choice in choices:
            choice.abort()
    return reply.whole(choices)


class _Choice:
    """One choice's generation: its stream of tokens as text deltas."""

    def __init__(self, index: int, stream: Any, text: TextCut) -> None:
        self.index = index
        self.stream = stream
        self.cut = text
        self.finish_reason: str | None = None

    async def deltas(self) -> AsyncIterator[str]:
        async for token in self.stream:
            new = self.cut.add(token)
            for later in self.stream.ready():  # tokens that came meanwhile: one chunk
                if self.cut.stopped:
                    break
                new += self.cut.add(later)
            if self.cut.stopped:
                self.stream.abort()  # a stop string: the request leaves the batch
                self.finish_reason = STOP
                if new:
                    yield new
                return
            if new:
                yield new
        self.finish_reason = self.stream.finish_reason
        rest = self.cut.rest()
        if rest:
            yield rest

    async def run(self) -> None:
        async for _ in self.deltas():
            pass

    def abort(self) -> None:
        """The caller is gone before the choice ended: its request leaves the batch."""
        if self.finish_reason is None:
            self.stream.abort()

    @property
    def completion_tokens(self) -> int:
        return len(self.cut.tokens)


class _Reply:
    def __init__(self, name: str, *, chat: bool, prompt_tokens: int) -> None:
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.chat = chat
        self.name = name
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens

    def _usage(self, choices: list[_Choice]) -> dict[str, int]:
        done = sum(choice.completion_tokens for choice in choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done,
        }

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        if chunk and self.chat:
            kind = "chat.completion.chunk"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.name}

    def whole(self, choices: list[_Choice]) -> dict[str, Any]:
        out = []
        for choice in choices:
            entry: dict[str, Any] = {"index": choice.index, "finish_reason": choice.finish_reason}
            if self.chat:
                entry["message"] = {"role": "assistant", "content": choice.cut.text}
            else:
                entry["text"] = choice.cut.text
            entry["logprobs"] = None
            out.append(entry)
        return {**self._head(False), "choices": out, "usage": self._usage(choices)}

    def _chunk(self, index: int, text: str | None, finish: str | None, role: bool = False) -> str:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        return _event({**self._head(True), "choices": [choice]})

    async def events(self, choices: list[_Choice], *, usage: bool) -> AsyncIterator[str]:
        """The server-sent events of every choice, as their tokens come; a client that leaves
        (this generator closed) aborts the choices still running."""
        # (choice, new text, its error, whether it ended), from one task per choice.
        queue: asyncio.Queue[tuple[int, str, BaseException | None, bool]] = asyncio.Queue()

        async def pump(choice: _Choice) -> None:
            try:
                async for text in choice.deltas():
                    queue.put_nowait((choice.index, text, None, False))
            except Exception as err:  # the model failed, or the server stops
                queue.put_nowait((choice.index, "", err, True))
            else:
                queue.put_nowait((choice.index, "", None, True))

        tasks = [asyncio.ensure_future(pump(choice)) for choice in choices]
        try:
            if self.chat:
                for choice in choices:
                    yield self._chunk(choice.index, "", None, role=True)
            ended = 0
            while ended < len(choices):
                index, text, error, done = await queue.get()
                if error is not None:  # a ModelError's line, or the server stopping
                    yield _event({"error": {"message": first_line(error), "type": "server_error"}})
                    return
                if done:
                    ended += 1
                    finish = choices[index].finish_reason
                    yield self._chunk(index, None if self.chat else "", finish)
                elif text:
                    yield self._chunk(index, text, None)
            if usage:
                yield _event({**self._head(True), "choices": [], "usage": self._usage(choices)})
            yield "data: [DONE]\n\n"
        finally:
            for choice, task in zip(choices, tasks):
                choice.abort()
                task.cancel()


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


__all__ = ["ROUTES", "TextCut", "add_openai_routes", "error_response"]
