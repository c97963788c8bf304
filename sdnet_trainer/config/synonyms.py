"""The names other code bases give the language models' keys, so that a key brought from nanoGPT,
Hugging Face or torchtitan is answered with this project's own (``model.gpt.n_embd`` → did you
mean ``model.gpt.dim``?), and the config groups a ``X.name=`` value may have meant to choose.

Plain data and lookups: docs/models.md shows the same table (a test holds the two equal).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from importlib import resources

from sdnet_trainer.config.language_models import GPTConfig, LlamaConfig, MoEConfig
from sdnet_trainer.config.store import CONFIG_MODULE
from sdnet_trainer.errors import ConfigError

# The columns of the table: whose names they are.
SOURCES = ("nanoGPT", "Hugging Face", "torchtitan")

_LLAMA_ROWS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "vocab_size": (("vocab_size",), ("vocab_size",), ("vocab_size",)),
    "seq_len": (("block_size",), ("max_position_embeddings",), ("max_seq_len",)),
    "dim": (("n_embd",), ("hidden_size",), ("dim",)),
    "n_layers": (("n_layer",), ("num_hidden_layers",), ("n_layers",)),
    "n_heads": (("n_head",), ("num_attention_heads",), ("n_heads",)),
    "n_kv_heads": ((), ("num_key_value_heads",), ("n_kv_heads",)),
    "norm_eps": ((), ("rms_norm_eps",), ("norm_eps",)),
    "rope_theta": ((), ("rope_theta",), ("rope_theta",)),
    "tie_embeddings": ((), ("tie_word_embeddings",), ()),
}

# Per family section: our key → its names in SOURCES' order (an empty tuple: none there).
SYNONYMS: dict[str, dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]]] = {
    "model.gpt": {
        "vocab_size": (("vocab_size",), ("vocab_size",), ("vocab_size",)),
        "seq_len": (("block_size",), ("n_positions", "max_position_embeddings"), ("max_seq_len",)),
        "dim": (("n_embd",), ("hidden_size",), ("dim",)),
        "n_layers": (("n_layer",), ("num_hidden_layers",), ("n_layers",)),
        "n_heads": (("n_head",), ("num_attention_heads",), ("n_heads",)),
        "dropout": (("dropout",), ("resid_pdrop",), ()),
    },
    "model.llama": {
        **_LLAMA_ROWS,
        # torchtitan derives the MLP's width from dim, multiple_of and ffn_dim_multiplier.
        "hidden_dim": ((), ("intermediate_size",), ("multiple_of", "ffn_dim_multiplier")),
    },
    "model.moe": {
        **_LLAMA_ROWS,
        "head_dim": ((), ("head_dim",), ("head_dim",)),
        "num_experts": ((), ("num_experts", "num_local_experts"), ("num_experts",)),
        "top_k": ((), ("num_experts_per_tok",), ("top_k",)),
        "moe_hidden_dim": ((), ("moe_intermediate_size", "intermediate_size"), ("moe_inter_dim",)),
        "num_shared_experts": ((), ("n_shared_experts",), ("n_shared_experts",)),
        "norm_topk_prob": ((), ("norm_topk_prob",), ()),
        "aux_loss_coeff": ((), ("router_aux_loss_coef",), ()),
    },
}

# The dataclass of each section, whose fields are the keys that exist.
SECTIONS: dict[str, type] = {
    "model.gpt": GPTConfig,
    "model.llama": LlamaConfig,
    "model.moe": MoEConfig,
}

# What choosing an option of each config group chooses, for the hint to a ``X.name=`` value.
_GROUP_NOUNS = {
    "optim": "the optimizer",
    "sched": "the schedule",
    "model": "the model",
    "data": "the data set",
    "parallel": "the layout",
    "precision": "the precision",
}


def synonym_of(section: str, key: str) -> str | None:
    """This project's key in ``section`` (``model.gpt``) for another code base's ``key``
    (``n_embd`` → ``dim``); None where the key is unknown there or already ours."""
    schema = SECTIONS.get(section)
    if schema is None or key in {f.name for f in dataclasses.fields(schema)}:
        return None
    wanted = key.lower()
    for ours, names in SYNONYMS[section].items():
        if any(wanted == name.lower() for column in names for name in column):
            return ours
    return None


def synonym_hint(dotted_key: str) -> str | None:
    """``model.gpt.n_embd`` → "did you mean model.gpt.dim? (n_embd in nanoGPT)"; None for a key
    that is no known synonym."""
    section, _, key = dotted_key.rpartition(".")
    ours = synonym_of(section, key)
    if ours is None:
        return None
    owners = [
        source
        for source, column in zip(SOURCES, SYNONYMS[section][ours])
        if key.lower() in (n.lower() for n in column)
    ]
    return f"did you mean {section}.{ours}? ({key} in {' and '.join(owners)})"


def group_options(group: str) -> list[str]:
    """The options of the config group ``group`` (configs/<group>/*.yaml); [] for no group."""
    folder = resources.files(CONFIG_MODULE).joinpath(group)
    if not folder.is_dir():
        return []
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def group_hint(group: str, value: object) -> str | None:
    """For ``optim.name=AdamW``: "optim.name=AdamW: choose the optimizer with the config group,
    optim=adamw (the groups: adamw, sgd)", where an option of the group ``group`` matches
    ``value`` (case aside; or, failing that, options named ``value_*``); None where none does."""
    options = group_options(group)
    wanted = str(value).lower()
    chosen = [o for o in options if o.lower() == wanted] or [
        o for o in options if o.lower().startswith(f"{wanted}_")
    ]
    if not chosen:
        return None
    noun = _GROUP_NOUNS.get(group, f"the {group}")
    choices = " or ".join(f"{group}={o}" for o in chosen)
    return (
        f"{group}.name={value}: choose {noun} with the config group, {choices} "
        f"(the groups: {', '.join(options)})"
    )


def split_override(override: str) -> tuple[str, str] | None:
    """``+model.gpt.n_embd=128`` → (``model.gpt.n_embd``, ``128``); None for a flag or a
    deletion without a value."""
    if override.startswith("-") or "=" not in override:
        return None
    key, _, value = override.lstrip("+~").partition("=")
    return key.strip(), value.strip()


def check_overrides(overrides: Sequence[str]) -> None:
    """A command line's overrides, before Hydra composes them: a key brought from nanoGPT, Hugging
    Face or torchtitan (``model.gpt.n_embd=128``, with or without ``+``) is a ConfigError that
    names this project's key, instead of Hydra's generic "Key not in GPTConfig"."""
    for override in overrides:
        parts = split_override(override)
        hint = synonym_hint(parts[0]) if parts else None
        if parts and hint:
            raise ConfigError(f"unknown config key {parts[0]} in {override!r}; {hint}")


def name_override_hints(overrides: Sequence[str]) -> list[str]:
    """The group to choose for each ``X.name=value`` (any case of ``name``) among ``overrides``
    whose value names an option of the config group ``X`` (see ``group_hint``)."""
    hints = []
    for override in overrides:
        parts = split_override(override)
        if parts is None:
            continue
        group, _, leaf = parts[0].rpartition(".")
        hint = group_hint(group, parts[1]) if leaf.lower() == "name" and group else None
        if hint:
            hints.append(hint)
    return hints


__all__ = [
    "SOURCES",
    "SYNONYMS",
    "check_overrides",
    "split_override",
    "group_hint",
    "group_options",
    "name_override_hints",
    "synonym_hint",
    "synonym_of",
]
