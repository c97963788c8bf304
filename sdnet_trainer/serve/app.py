"""The FastAPI application: ``POST /v1/predict``, ``GET /v1/model``, ``/healthz``, ``/readyz``
and ``/metrics`` (:mod:`~sdnet_trainer.serve.metrics`), and for a language model the OpenAI API
(:mod:`~sdnet_trainer.serve.openai_api`); its OpenAPI page is ``/docs``.

Every request the model cannot take is answered with a 4xx and ``{"detail": "<one line>"}`` (on
the OpenAI routes, the OpenAI API's error shape): an image that does not decode (400) or is not
PNG/JPEG (415), a tensor of the wrong shape (422), malformed JSON (400), JSON of the wrong form
(422), a prompt longer than the context (422), a body larger than ``max_body_mb`` (413, before it
is read when the client sends Content-Length). The server goes on serving the next request as
before. 503 means not ready, shutting down or too many requests waiting (``max_queue``); 500 only
a failure of the model itself.

A language model with a KV cache generates in the continuous-batching engine
(:mod:`~sdnet_trainer.serve.engine`); other models' requests run in the dynamic batcher
(:mod:`~sdnet_trainer.serve.batching`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Optional, Union

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sdnet_trainer.serve.args import ServeArgs
from sdnet_trainer.serve.batching import Batcher, QueueFull, Stopped
from sdnet_trainer.serve.engine import Whole, engine_for
from sdnet_trainer.serve.errors import InputError, ModelError, one_line
from sdnet_trainer.serve.images import ImageModel
from sdnet_trainer.serve.language import Job, LanguageModel
from sdnet_trainer.serve.metrics import MetricsMiddleware, ServeMetrics
from sdnet_trainer.serve.openai_api import ROUTES as OPENAI_ROUTES
from sdnet_trainer.serve.openai_api import add_openai_routes, error_response

logger = logging.getLogger(__name__)

PREDICT = "/v1/predict"
ROUTES = (
    frozenset(
        {
            PREDICT,
            "/v1/model",
            "/healthz",
            "/readyz",
            "/metrics",
            "/docs",
            "/redoc",
            "/openapi.json",
        }
    )
    | OPENAI_ROUTES
)


# ---------------------------------------------------------------------- request and response bodies


class ImageRequest(BaseModel):
    """An image classifier's input as JSON: exactly one of ``image`` and ``tensor``."""

    model_config = ConfigDict(extra="forbid")
    image: Optional[str] = Field(
        None, description="A PNG or JPEG file, base64-encoded (a data: URL prefix is allowed)."
    )
    tensor: Optional[list[Any]] = Field(
        None,
        description="A preprocessed input as nested lists, channels first: [C][H][W] numbers "
        "of the model's input shape (GET /v1/model says it); no transform is applied.",
    )
    top_k: Optional[int] = Field(None, ge=1, description="How many classes to return.")


class ClassScore(BaseModel):
    index: int
    label: str
    probability: float


class ImagePrediction(BaseModel):
    predictions: list[ClassScore] = Field(description="The most likely classes, most likely first.")


class GenerateRequest(BaseModel):
    """A language model's input."""

    model_config = ConfigDict(extra="forbid")
    prompt: Union[StrictStr, list[StrictInt]] = Field(
        description="Text (encoded as the training data was: UTF-8 bytes or its tokenizer) or "
        "token ids; at most the model's context long."
    )
    max_new_tokens: Optional[int] = Field(
        None,
        ge=0,
        description="How many tokens to generate; null: 32, or the server's max_new_tokens if "
        "that is lower.",
    )
    temperature: float = Field(
        0.0, ge=0.0, allow_inf_nan=False, description="0: greedy; above 0: sampled."
    )
    seed: Optional[int] = Field(
        None, ge=0, lt=2**63, description="Seed of the sampling (temperature > 0)."
    )
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="Sampling draws from the most likely tokens holding this much probability.",
    )
    stop: list[StrictInt] = Field(
        default_factory=list,
        max_length=256,
        description="Token ids that end the generation (returned last), beside the model's "
        "end-of-sequence ids.",
    )


class Generation(BaseModel):
    tokens: list[int] = Field(description="The generated token ids.")
    text: Optional[str] = Field(description="The generated tokens as text; null without text form.")
    prompt_tokens: int


_MULTIPART_BODY = {
    "type": "object",
    "properties": {"file": {"type": "string", "format": "binary", "description": "PNG or JPEG"}},
    "required": ["file"],
}


class BodyLimit:
    """413 for a request body over ``max_bytes``: at once when Content-Length says so, else as
    soon as the bytes received pass it (the handler reading the body gets an HTTPException)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _reason(self, size: int, *, exact: bool) -> str:
        what = f"{size} bytes" if exact else f"more than {self.max_bytes} bytes"
        return (
            f"the request body ({what}) is larger than this server takes "
            f"({self.max_bytes} bytes, max_body_mb)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            response = JSONResponse(
                {"detail": self._reason(int(length), exact=True)}, status_code=413
            )
            await response(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._reason(received, exact=False))
            return message

        await self.app(scope, limited, send)


# ---------------------------------------------------------------------- errors


def _detail(status: int, reason: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": reason}, status_code=status, headers=headers)


# ---------------------------------------------------------------------- the application


def create_app(model: Union[ImageModel, LanguageModel], args: ServeArgs, *, source: str) -> FastAPI:
    """The application serving ``model``; its batcher runs while the application does (its
    lifespan), and /readyz answers 200 only then."""
    metrics = ServeMetrics(args.max_batch_size)
    batcher: Batcher[Any, Any] = Batcher(
        model.run,
        max_batch_size=args.max_batch_size,
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        observe=metrics.batch_size.observe,
    )
    engine = engine_for(model, args, metrics.engine) if isinstance(model, LanguageModel) else None
    metrics.queue.set_function(lambda: batcher.waiting + (engine.waiting if engine else 0))
    ready = {"now": False}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        if engine is not None:
            engine.start()
        ready["now"] = True
        metrics.ready.set(1)
        try:
            yield
        finally:
            ready["now"] = False
            metrics.ready.set(0)
            await batcher.stop()
            if engine is not None:
                await engine.stop()

    app = FastAPI(
        title="sdnet_trainer serve",
        description=f"Serving {source} ({model.kind} model, backend={args.backend}).",
        lifespan=lifespan,
    )
    app.add_middleware(BodyLimit, max_bytes=int(args.max_body_mb * 2**20))
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=ROUTES)

    def refusal(request: Request, status: int, reason: str, **headers: str) -> JSONResponse:
        # The OpenAI routes answer in the shape OpenAI's clients read.
        if request.url.path in OPENAI_ROUTES:
            return error_response(status, reason, headers or None)
        return _detail(status, reason, headers or None)

    @app.exception_handler(InputError)
    async def refused(request: Request, err: InputError) -> JSONResponse:
        return refusal(request, err.status, err.reason)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return refusal(request, *one_line(list(err.errors())))

    @app.exception_handler(HTTPException)
    async def failed(request: Request, err: HTTPException) -> JSONResponse:
        return refusal(request, err.status_code, str(err.detail), **(err.headers or {}))

    @app.exception_handler(QueueFull)
    async def busy(request: Request, err: QueueFull) -> JSONResponse:
        reason = f"the server is busy: {err}; retry later"
        return refusal(request, 503, reason, **{"Retry-After": "1"})

    @app.exception_handler(Stopped)
    async def stopped(request: Request, err: Stopped) -> JSONResponse:
        return refusal(request, 503, str(err))

    @app.exception_handler(ModelError)
    async def model_failed(request: Request, err: ModelError) -> JSONResponse:
        return refusal(request, 500, str(err))

    async def submit(item: Any) -> Any:
        if not ready["now"]:
            raise Stopped("the model is not ready")
        try:
            return await batcher.submit(item)
        except (InputError, QueueFull, Stopped):
            raise
        except Exception as err:
            logger.exception("the model failed on a batch")
            raise ModelError.of(err) from None

    @app.get("/healthz", summary="Alive: the process answers")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", summary="Ready: the model is loaded and takes requests")
    async def readyz() -> JSONResponse:
        if ready["now"]:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready"}, status_code=503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/model", summary="What the served model takes and returns")
    async def describe() -> dict[str, Any]:
        return {
            **model.info(),
            "source": source,
            "backend": args.backend,
            "max_batch_size": args.max_batch_size,
            "max_wait_ms": args.max_wait_ms,
            "batching": args.batching,
            "continuous_batching": engine is not None and engine.continuous,
        }

    # Request bodies are parsed, decoded and preprocessed in threads, off the event loop that
    # answers /healthz and /readyz, but a few at a time: starlette's pool has 40 threads, and 40
    # images decoding at once (each up to max_image_pixels) would take gigabytes.
    preparing = asyncio.Semaphore(_cpu_count())

    async def prepare(work: Callable[..., Any], *args: Any) -> Any:
        async with preparing:
            return await run_in_threadpool(work, *args)

    if isinstance(model, ImageModel):
        _image_route(app, model, submit, prepare)
        return app

    async def generate(job: Job) -> Any:
        """The job's tokens as they come: from the engine, or a batch's whole result."""
        if not ready["now"]:
            raise Stopped("the model is not ready")
        if engine is not None:
            return engine.submit(job)
        return Whole(asyncio.ensure_future(submit(job)), {*model.stop_ids, *job.stop})

    _language_route(app, model, generate, prepare)
    add_openai_routes(
        app,
        model,
        name=args.served_model_name or args.checkpoint,
        generate=generate,
        prepare=prepare,
    )
    return app


def _cpu_count() -> int:
    """The CPUs this process may run on (its affinity, which a container may narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


Prepare = Callable[..., Awaitable[Any]]


def _image_route(
    app: FastAPI, model: ImageModel, submit: Callable[[Any], Awaitable[Any]], prepare: Prepare
) -> None:
    request_body = {
        "required": True,
        "content": {
            "multipart/form-data": {"schema": _MULTIPART_BODY},
            "application/json": {"schema": ImageRequest.model_json_schema()},
        },
    }

    @app.post(
        PREDICT,
        response_model=ImagePrediction,
        summary="Classify an image",
        description="An image as a multipart upload (field `file`) or base64 JSON (`image`), or "
        "a preprocessed `tensor`; returns the top-k classes with their probabilities.",
        openapi_extra={"requestBody": request_body},
    )
    async def predict(
        request: Request,
        top_k: Optional[int] = Query(None, ge=1, description="How many classes to return."),
    ) -> dict[str, Any]:
        media = _media_type(request)
        if media == "multipart/form-data":
            data = await _uploaded_file(request)
            inputs = await prepare(model.from_image, data)
        elif _is_json(media):
            inputs, asked = await prepare(_json_inputs, model, await request.body())
            top_k = asked or top_k
        else:
            raise InputError(
                415,
                f"content type {media or '(none)'}: send multipart/form-data with the image in "
                f"the field 'file', or application/json",
            )
        probs = await submit(inputs)
        return {"predictions": model.top(probs, top_k)}


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def _is_json(media: str) -> bool:
    return media == "application/json" or media.endswith("+json")


def _json_inputs(model: ImageModel, body: bytes) -> tuple[Any, Optional[int]]:
    """An image request's JSON body as the model's input and the top_k it asks for."""
    parsed = _image_request(body)
    if parsed.image is not None:
        return model.from_image(_base64(parsed.image)), parsed.top_k
    return model.from_tensor(parsed.tensor), parsed.top_k


async def _uploaded_file(request: Request) -> bytes:
    form = await request.form(max_files=1, max_fields=8)
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise InputError(422, "file: the multipart body has no file in the field 'file'")
        return await upload.read()
    finally:
        await form.close()


def _image_request(body: bytes) -> ImageRequest:
    try:
        parsed = ImageRequest.model_validate_json(body)
    except ValidationError as err:
        raise InputError(*one_line(list(err.errors()))) from None
    if (parsed.image is None) == (parsed.tensor is None):
        raise InputError(422, "body: give exactly one of image (base64 PNG/JPEG) and tensor")
    return parsed


def _base64(text: str) -> bytes:
    if text.startswith("data:"):
        text = text.partition(",")[2]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(400, "image: not valid base64") from None


def _language_route(
    app: FastAPI, model: LanguageModel, generate: Callable[[Job], Awaitable[Any]], prepare: Prepare
) -> None:
    request_body = {
        "required": True,
        "content": {"application/json": {"schema": GenerateRequest.model_json_schema()}},
    }

    # The body is read here rather than declared as a GenerateRequest parameter, which FastAPI
    # would parse on the event loop.
    @app.post(
        PREDICT,
        response_model=Generation,
        summary="Continue a prompt",
        description="Generates up to max_new_tokens tokens after the prompt (greedy at "
        "temperature 0), ending early at a stop token.",
        openapi_extra={"requestBody": request_body},
    )
    async def predict(request: Request) -> dict[str, Any]:
        media = _media_type(request)
        if media and not _is_json(media):
            raise InputError(415, f"content type {media}: send application/json")
        job = await prepare(_job, model, await request.body())
        tokens: list[int] = []
        if job.max_new_tokens:
            stream = await generate(job)
            try:
                tokens = await stream.tokens()
            finally:
                if stream.finish_reason is None:
                    stream.abort()
        return {"tokens": tokens, "text": model.text(tokens), "prompt_tokens": len(job.tokens)}


def _job(model: LanguageModel, body: bytes) -> Job:
    """A generation request's JSON body as the model's job (the prompt tokenized)."""
    try:
        parsed = GenerateRequest.model_validate_json(body)
    except ValidationError as err:
        raise InputError(*one_line(list(err.errors()))) from None
    return model.job(
        parsed.prompt,
        max_new_tokens=parsed.max_new_tokens,
        temperature=parsed.temperature,
        seed=parsed.seed,
        top_p=parsed.top_p,
        stop=parsed.stop,
    )
