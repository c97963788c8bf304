"""A Llama checkpoint of this project served with a KV cache: the same weights as a
``transformers.LlamaForCausalLM``, which :class:`~sdnet_trainer.serve.decoding.CausalLMDecoder`
runs (prefill once, then one token per step, left-padded batches).

The Hugging Face model is built in memory from ``format=hf``'s config and name mapping
(``models/llama/hf.py``: ``hf_config_of``, ``to_hf_name``): built on the meta device and given the
served model's own tensors (``assign``), so no weight is copied or initialised; its rotary
frequencies, a buffer no state dict holds, are then computed on the model's device. Both models
use the same rotary layout (``rotate_half``), so the weights need no permutation; their logits
agree to float rounding (tests/unit/test_serve_decoding.py checks greedy tokens against the no-cache
path and ``transformers``' ``generate``). Without ``transformers`` the model is served without a
cache, as before.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from sdnet_trainer.models.llama.hf import hf_config_of, to_hf_name
from sdnet_trainer.models.llama.model import Llama

logger = logging.getLogger(__name__)


def hf_llama_of(model: nn.Module | None) -> nn.Module | None:
    """``model`` (a :class:`Llama`) as a ``transformers.LlamaForCausalLM`` sharing its tensors,
    in eval mode; None for another model or without ``transformers``."""
    if not isinstance(model, Llama):
        return None
    try:
        import transformers
    except ImportError:
        logger.warning(
            "serving a Llama without a KV cache: transformers is not installed "
            "(pip install 'sdnet_trainer[llm]')"
        )
        return None
    state = model.state_dict()
    first = next(iter(state.values()))
    config = transformers.LlamaConfig.from_dict(hf_config_of(model, dtype=first.dtype))
    with torch.device("meta"):
        lm: Any = transformers.LlamaForCausalLM(config)
    lm.load_state_dict({to_hf_name(name): value for name, value in state.items()}, assign=True)
    if model.tie_embeddings:
        lm.tie_weights()
    # The rotary frequencies: a non-persistent buffer, still on the meta device.
    lm.model.rotary_emb = type(lm.model.rotary_emb)(config=config).to(first.device)
    on_meta = [name for name, t in [*lm.named_parameters(), *lm.named_buffers()] if t.is_meta]
    if on_meta:  # a transformers release with other state outside the state dict
        raise RuntimeError(f"LlamaForCausalLM left {on_meta} unset")
    return lm.eval()


__all__ = ["hf_llama_of"]
