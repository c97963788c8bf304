"""A model of one of this project's families as the ``transformers`` model of its own tensors:
its twin, which serving's :class:`~sdnet_trainer.serve.decoding.CausalLMDecoder` runs with a KV
cache (prefill once, then one token per step, left-padded batches).

The family gives what ``format=hf`` writes: the config.json fields of the model and its tensors
under Hugging Face's names, here in the layout of the transformers model as this release builds
it (a mixture of experts' experts per expert, or fused as transformers 5 holds them). The twin is
built on the meta device and handed those tensors (``assign``), so no weight is initialised and,
where the layouts agree, none is copied; its rotary frequencies, a buffer no state dict holds, are
then computed on the model's device. Without ``transformers`` the model is served without a
cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

# The twin's own tensor names and shapes -> the model's tensors under those names.
TwinTensors = Callable[[Mapping[str, torch.Size]], dict[str, torch.Tensor]]


def transformers_twin(
    model: nn.Module, *, config: dict[str, Any], tensors: TwinTensors
) -> nn.Module | None:
    """The ``transformers`` causal LM of ``config`` (config.json's fields, ``model_type``
    included) holding ``tensors``, in eval mode; None without ``transformers``."""
    try:
        import transformers
    except ImportError:
        logger.warning(
            "serving without a KV cache: transformers is not installed "
            "(pip install 'sdnet_trainer[llm]')"
        )
        return None
    fields = dict(config)
    hf_config = transformers.CONFIG_MAPPING[fields.pop("model_type")].from_dict(fields)
    with torch.device("meta"):
        lm: Any = transformers.AutoModelForCausalLM.from_config(hf_config)
    wanted = {name: value.shape for name, value in lm.state_dict().items()}
    # Not strict: a tied output layer is the embedding, tied back below.
    unexpected = lm.load_state_dict(tensors(wanted), assign=True, strict=False).unexpected_keys
    if unexpected:
        raise RuntimeError(f"{type(lm).__name__} has no tensors named {sorted(unexpected)[:5]}")
    if hf_config.tie_word_embeddings:
        lm.tie_weights()
    device = next(model.parameters()).device
    # The rotary frequencies: a non-persistent buffer, still on the meta device.
    lm.model.rotary_emb = type(lm.model.rotary_emb)(config=hf_config).to(device)
    on_meta = [name for name, t in [*lm.named_parameters(), *lm.named_buffers()] if t.is_meta]
    if on_meta:  # a transformers release with other state outside the state dict
        raise RuntimeError(f"{type(lm).__name__} left {on_meta[:5]} unset")
    return lm.eval()


__all__ = ["TwinTensors", "transformers_twin"]
