"""The built-in model families registered (``models/registry.py``): the GPT, the Llama, the
mixture of experts and transformers' causal language models. Imported by the package
(``models/__init__.py``), so every import of the models registers them first."""

from __future__ import annotations

from sdnet_trainer.models import gpt, hf_causal_lm, llama, moe
from sdnet_trainer.models.registry import register_family

BUILT_IN = (gpt.FAMILY, llama.FAMILY, moe.FAMILY, hf_causal_lm.FAMILY)
for _family in BUILT_IN:
    register_family(_family)


__all__ = ["BUILT_IN"]
