"""Generation with a KV cache: the prompts' prefill once, then one token per step.

A batch holds prompts of different lengths, padded on the LEFT to the longest: every row's last
position is then its newest token, so each step appends one column for all rows. The attention
mask hides the padding, and position ids count each row's real tokens only (0 at its first), so
a row computes what it would alone (up to float rounding). A row stops at its ``max_new_tokens``
or at a stop token (kept as its last token); finished rows are fed padding until every row is
done.

:class:`CausalLMDecoder` runs a ``transformers`` causal LM this way, its cache
(``DynamicCache``) kept between steps; with ``use_cache=False`` it recomputes the whole sequence
at every step instead, with the same masks and positions (the reference the cache is checked
against).

Sampling: ``temperature=0`` is greedy (argmax); above 0 the token is drawn from
``softmax(logits / temperature)`` cut to its ``top_p`` nucleus (the most likely tokens whose
probabilities add up to ``top_p``), with a generator seeded per request, so a request with a seed
draws the same tokens again.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
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


def generate(
    decoder: Decoder, jobs: Sequence[Job], *, stop_ids: Sequence[int] = (), pad_id: int = 0
) -> list[list[int]]:
    """The new tokens of every job, generated together: one prefill, then one step per token.
    ``stop_ids`` (the model's end-of-sequence tokens) end every job, as its own ``stop`` ids do."""
    longest = max(len(job.tokens) for job in jobs)
    ids = torch.full((len(jobs), longest), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(jobs), longest), dtype=torch.int64)
    for row, job in enumerate(jobs):
        ids[row, longest - len(job.tokens) :] = torch.tensor(job.tokens, dtype=torch.int64)
        mask[row, longest - len(job.tokens) :] = 1
    stops = [set(stop_ids) | set(job.stop) for job in jobs]
    generators = [_generator(job) for job in jobs]
    results: list[list[int]] = [[] for _ in jobs]
    live = [job.max_new_tokens > 0 for job in jobs]
    if not any(live):
        return results
    logits, state = decoder.prefill(ids, mask)
    while True:
        picks = []
        for row, job in enumerate(jobs):
            token = pad_id
            if live[row]:
                token = pick(logits[row], job.temperature, job.top_p, generators[row])
                results[row].append(token)
                live[row] = token not in stops[row] and len(results[row]) < job.max_new_tokens
            picks.append(token)
        if not any(live):
            return results
        mask = torch.cat([mask, torch.ones((len(jobs), 1), dtype=torch.int64)], dim=1)
        logits, state = decoder.step(state, torch.tensor(picks, dtype=torch.int64), mask)


def _generator(job: Job) -> torch.Generator | None:
    return torch.Generator().manual_seed(job.seed) if job.seed is not None else None


def until_stop(tokens: list[int], stop: set[int]) -> list[int]:
    """``tokens`` up to and including the first stop token."""
    for i, token in enumerate(tokens):
        if token in stop:
            return tokens[: i + 1]
    return tokens


def pick(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> int:
    """The next token from one row's logits (see the module docstring)."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()):  # a temperature so small that it overflows
        return int(logits.argmax())
    if top_p < 1.0:
        ranked, order = probs.sort(descending=True)
        # A token stays while the tokens ranked above it hold less than top_p: the first always.
        keep = (ranked.cumsum(0) - ranked) < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], ranked[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


__all__ = ["CausalLMDecoder", "Decoder", "Job", "generate", "pick", "until_stop"]
