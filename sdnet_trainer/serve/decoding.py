"""Generation with a KV cache: each prompt's prefill once, then one token per step.

A batch holds sequences of different lengths, padded on the LEFT to the longest: every row's
last position is then its newest token, so each step appends one column for all rows. The
attention mask hides the padding, and position ids count each row's real tokens only (0 at its
first), so a row computes what it would alone (up to float rounding).

:class:`RunningBatch` keeps such a batch between steps, and rows join and leave it between steps
(continuous batching, :mod:`sdnet_trainer.serve.engine`): newcomers are prefilled together, their
cache padded on the left to the running batch's length (or the batch's to theirs) and stacked
under it; a row that ends (its ``max_new_tokens``, a stop token, kept as its last token, or an
abort) leaves at once, and the columns no row needs any more are cut from the left.
:func:`generate` is one batch that every job joins at the start.

:class:`CausalLMDecoder` runs a ``transformers`` causal LM this way, its cache (``DynamicCache``)
kept between steps; with ``use_cache=False`` it recomputes the whole sequence at every step
instead, with the same masks and positions (the reference the cache is checked against).

Sampling: ``temperature=0`` is greedy (argmax); above 0 the token is drawn from
``softmax(logits / temperature)`` cut to its ``top_k`` most likely tokens (0: all) and to its
``top_p`` nucleus (the most likely tokens whose probabilities add up to ``top_p``), with a
generator seeded per request, so a request with a seed draws the same tokens again.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Job:
    """One request's generation."""

    tokens: list[int]
    max_new_tokens: int
    temperature: float
    seed: int | None
    top_p: float = 1.0
    stop: tuple[int, ...] = ()  # token ids that end it, beside the model's own
    top_k: int = 0  # sampling keeps the k most likely tokens; 0: all


class Decoder(Protocol):
    """Runs a causal LM over a left-padded batch: ``prefill`` the prompts, then ``step`` one new
    token per row; both return the logits of each row's newest position (B, vocab) and the state
    the next step continues from. ``mask`` is the whole sequence's attention mask so far."""

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, Any]: ...

    def step(
        self, state: Any, tokens: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, Any]: ...


class CausalLMDecoder:
    """A ``transformers`` causal LM (``input_ids``, ``attention_mask``, ``position_ids`` and a
    cache: ``cache`` in recent releases, ``past_key_values`` before) in eval mode on ``device``."""

    def __init__(self, lm: nn.Module, device: torch.device, *, use_cache: bool = True) -> None:
        self.lm = lm.to(device).eval()
        self.device = device
        self.use_cache = use_cache
        params = inspect.signature(lm.forward).parameters
        self.cache_key = "cache" if "cache" in params else "past_key_values"
        # Only the last position's logits are needed (where the model can skip the rest).
        self.last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if not self.use_cache:
            return self._whole(ids, mask), ids
        output = self._forward(ids, mask, _positions(mask), cache=self._new_cache())
        return output.logits[:, -1].float().cpu(), _cache_of(output)

    def step(
        self, state: Any, tokens: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, Any]:
        if not self.use_cache:
            ids = torch.cat([state, tokens[:, None]], dim=1)
            return self._whole(ids, mask), ids
        positions = _positions(mask)[:, -1:]
        output = self._forward(tokens[:, None], mask, positions, cache=state)
        return output.logits[:, -1].float().cpu(), _cache_of(output)

    def _new_cache(self) -> Any:
        """None where the model makes its own cache (from its config: sliding-window layers);
        releases before the ``cache`` keyword make a legacy tuple cache unless given one."""
        if self.cache_key == "cache":
            return None
        from transformers import DynamicCache

        return DynamicCache()

    def _whole(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        output = self._forward(ids, mask, _positions(mask), cache=None, use_cache=False)
        return output.logits[:, -1].float().cpu()

    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        *,
        cache: Any,
        use_cache: bool = True,
    ) -> Any:
        kwargs: dict[str, Any] = {self.cache_key: cache} if cache is not None else {}
        with torch.inference_mode():
            return self.lm(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                use_cache=use_cache,
                **kwargs,
                **self.last_only,
            )


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Each token's position among its row's real tokens (padding: 0, never attended to)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _cache_of(output: Any) -> Any:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


# Why a row ended: a stop token ("stop", as the OpenAI API says), its max_new_tokens
# ("length"), or its caller went away ("abort").
STOP, LENGTH, ABORT = "stop", "length", "abort"


@dataclass(eq=False)
class Row:
    """One job in a :class:`RunningBatch`: the tokens it generated so far; ``finish_reason``
    once it ended."""

    job: Job
    stops: frozenset[int]
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class RunningBatch:
    """Rows decoding together over one left-padded state (see the module docstring): ``add``
    prefills new jobs and returns their rows, ``step`` generates one token for every row and
    returns the rows it stepped (a row's newest token is ``row.tokens[-1]``); rows that ended
    (``finish_reason`` set) are out of :attr:`rows` when either returns."""

    def __init__(self, decoder: Decoder, *, stop_ids: Sequence[int] = (), pad_id: int = 0) -> None:
        self.decoder = decoder
        self.stop_ids = frozenset(stop_ids)
        self.pad_id = pad_id
        self.rows: list[Row] = []
        self._state: Any = None  # the decoder's: a KV cache, or the ids themselves
        self._mask = torch.zeros((0, 0), dtype=torch.int64)  # (rows, columns); 0: padding

    @property
    def columns(self) -> int:
        """The state's length: the longest row's tokens (what the cache holds per row)."""
        return int(self._mask.shape[1])

    def add(self, jobs: Sequence[Job]) -> list[Row]:
        """Prefill ``jobs`` together; each picks its first token and joins the batch. Returns
        their rows, in order (a job of ``max_new_tokens`` 0 ends at once, without a token)."""
        rows = [Row(job, self.stop_ids | frozenset(job.stop), _generator(job)) for job in jobs]
        for row in rows:
            if row.job.max_new_tokens <= 0:
                row.finish_reason = LENGTH
        live = [row for row in rows if row.finish_reason is None]
        if not live:
            return rows
        ids, mask = left_padded([row.job.tokens for row in live], self.pad_id)
        logits, state = self.decoder.prefill(ids, mask)
        if self.rows:
            self._state, self._mask = _stacked(
                (self._state, self._mask), (state, mask), self.pad_id
            )
        else:
            self._state, self._mask = state, mask
        self.rows += live
        self._picked(live, logits)
        return rows

    def step(self) -> list[Row]:
        """One token for every row."""
        if not self.rows:
            return []
        self._mask = torch.cat([self._mask, torch.ones((len(self.rows), 1), dtype=torch.int64)], 1)
        # Each row's newest token: the one token of it not in the state yet.
        next_tokens = torch.tensor([row.tokens[-1] for row in self.rows], dtype=torch.int64)
        logits, self._state = self.decoder.step(self._state, next_tokens, self._mask)
        return self._picked(list(self.rows), logits)

    def drop(self, rows: Sequence[Row], reason: str = ABORT) -> None:
        """Take ``rows`` out of the batch before the next step."""
        for row in rows:
            row.finish_reason = row.finish_reason or reason
        self._keep([i for i, row in enumerate(self.rows) if row.finish_reason is None])

    def _picked(self, rows: list[Row], logits: torch.Tensor) -> list[Row]:
        """Each of ``rows`` (the rows of ``logits``, in order) picks its next token; those that end
        leave the batch."""
        for i, row in enumerate(rows):
            job = row.job
            token = pick(logits[i], job.temperature, job.top_p, row.generator, job.top_k)
            row.tokens.append(token)
            if token in row.stops:
                row.finish_reason = STOP
            elif len(row.tokens) >= job.max_new_tokens:
                row.finish_reason = LENGTH
        if any(row.finish_reason is not None for row in rows):
            self._keep([i for i, row in enumerate(self.rows) if row.finish_reason is None])
        return rows

    def _keep(self, index: list[int]) -> None:
        """Keep these rows; cut the columns that are padding in every row left."""
        if len(index) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in index]
        if not self.rows:
            self._state, self._mask = None, torch.zeros((0, 0), dtype=torch.int64)
            return
        rows = torch.tensor(index, dtype=torch.int64)
        mask = self._mask[rows]
        used = torch.nonzero(mask.any(dim=0))
        start = int(used[0]) if len(used) else 0
        self._mask = mask[:, start:]
        self._state = _map_state(self._state, lambda t: _rows_from(t, rows, start))


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one (rows, longest) batch, padded on the left, and its attention mask."""
    longest = max(len(tokens) for tokens in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), longest), dtype=torch.int64)
    for row, tokens in enumerate(prompts):
        ids[row, longest - len(tokens) :] = torch.tensor(list(tokens), dtype=torch.int64)
        mask[row, longest - len(tokens) :] = 1
    return ids, mask


def _rows_from(t: torch.Tensor, rows: torch.Tensor, start: int) -> torch.Tensor:
    """Rows ``rows`` of a state tensor, from column ``start`` (ids: dim 1; keys/values: dim -2)."""
    t = t.index_select(0, rows.to(t.device))
    return t[:, start:] if t.dim() == 2 else t[..., start:, :]


def _stacked(
    top: tuple[Any, torch.Tensor], bottom: tuple[Any, torch.Tensor], pad_id: int
) -> tuple[Any, torch.Tensor]:
    """Two batches' (state, mask) as one: the shorter padded on the left, rows stacked."""
    columns = max(top[1].shape[1], bottom[1].shape[1])

    def pad(t: torch.Tensor, width: int, value: int = 0) -> torch.Tensor:
        extra = columns - width
        if extra == 0:
            return t
        if t.dim() == 2:
            return F.pad(t, (extra, 0), value=value)
        return F.pad(t, (0, 0, extra, 0))  # keys/values (rows, heads, columns, dim)

    (state, mask), (new_state, new_mask) = top, bottom
    width, new_width = mask.shape[1], new_mask.shape[1]
    if isinstance(state, torch.Tensor):  # the decoder without a cache keeps the ids
        ids = torch.cat([pad(state, width, pad_id), pad(new_state, new_width, pad_id)])
        stacked_state: Any = ids
    else:
        pairs = zip(_kv_pairs(state), _kv_pairs(new_state))
        stacked = [
            (
                torch.cat([pad(k, width), pad(nk, new_width)]),
                torch.cat([pad(v, width), pad(nv, new_width)]),
            )
            for (k, v), (nk, nv) in pairs
        ]
        _set_kv_pairs(state, stacked)
        stacked_state = state
    return stacked_state, torch.cat([pad(mask, width), pad(new_mask, new_width)])


def _map_state(state: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(state, torch.Tensor):
        return fn(state)
    _set_kv_pairs(state, [(fn(k), fn(v)) for k, v in _kv_pairs(state)])
    return state


def _kv_pairs(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (keys, values) of every layer of a ``transformers`` DynamicCache: ``layers`` of full
    attention in recent releases, ``key_cache``/``value_cache`` lists before. Another cache (a
    sliding window's, which drops old columns itself) is not split or stacked here."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        if all(type(layer).__name__ == "DynamicLayer" for layer in layers):
            return [(layer.keys, layer.values) for layer in layers]
    elif type(cache).__name__ == "DynamicCache" and hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    raise TypeError(
        f"a {type(cache).__name__} of "
        f"{sorted({type(layer).__name__ for layer in layers or []})} layers cannot take rows "
        "between steps (continuous batching needs a DynamicCache of full-attention layers)"
    )


def _set_kv_pairs(cache: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer, (keys, values) in zip(layers, pairs):
            layer.keys, layer.values = keys, values
    else:
        cache.key_cache = [k for k, _ in pairs]
        cache.value_cache = [v for _, v in pairs]


def splittable(decoder: Decoder) -> str | None:
    """None when rows can join and leave ``decoder``'s batches between steps, else why not (a
    prefill of one token shows what state the model keeps)."""
    _, state = decoder.prefill(
        torch.zeros((1, 1), dtype=torch.int64), torch.ones((1, 1), dtype=torch.int64)
    )
    if isinstance(state, torch.Tensor):
        return None
    try:
        _kv_pairs(state)
    except TypeError as err:
        return str(err)
    return None


def generate(
    decoder: Decoder, jobs: Sequence[Job], *, stop_ids: Sequence[int] = (), pad_id: int = 0
) -> list[list[int]]:
    """The new tokens of every job, generated together: one prefill, then one step per token.
    ``stop_ids`` (the model's end-of-sequence tokens) end every job, as its own ``stop`` ids do."""
    batch = RunningBatch(decoder, stop_ids=stop_ids, pad_id=pad_id)
    rows = batch.add(jobs)
    while batch.rows:
        batch.step()
    return [row.tokens for row in rows]


def _generator(job: Job) -> torch.Generator | None:
    return torch.Generator().manual_seed(job.seed) if job.seed is not None else None


def until_stop(tokens: list[int], stop: set[int]) -> list[int]:
    """``tokens`` up to and including the first stop token."""
    for i, token in enumerate(tokens):
        if token in stop:
            return tokens[: i + 1]
    return tokens


def pick(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    top_k: int = 0,
) -> int:
    """The next token from one row's logits (see the module docstring)."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()):  # a temperature so small that it overflows
        return int(logits.argmax())
    if 0 < top_k < probs.numel():
        kept, where = probs.topk(top_k)
        probs = torch.zeros_like(probs).scatter(0, where, kept / kept.sum())
    if top_p < 1.0:
        ranked, order = probs.sort(descending=True)
        # A token stays while the tokens ranked above it hold less than top_p: the first always.
        keep = (ranked.cumsum(0) - ranked) < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], ranked[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


__all__ = [
    "ABORT",
    "LENGTH",
    "STOP",
    "CausalLMDecoder",
    "Decoder",
    "Job",
    "Row",
    "RunningBatch",
    "generate",
    "left_padded",
    "pick",
    "splittable",
    "until_stop",
]
