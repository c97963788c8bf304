"""Keys brought from nanoGPT, Hugging Face and torchtitan, and ``X.name=`` values that meant a
config group, answered with this project's own names (issue 56, items 1 and 2)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sdnet_trainer.config import compose
from sdnet_trainer.config.synonyms import SOURCES, SYNONYMS, name_override_hints, synonym_of
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.preflight import validate

REPO = Path(__file__).resolve().parents[2]

CASES = [
    ("model=gpt_tiny", "model.gpt.n_embd=128", "model.gpt.dim"),
    ("model=gpt_tiny", "model.gpt.hidden_size=128", "model.gpt.dim"),
    ("model=llama3_debug", "model.llama.hidden_size=64", "model.llama.dim"),
    ("model=llama3_debug", "model.llama.n_embd=64", "model.llama.dim"),
    ("model=moe_debug", "model.moe.num_experts_per_tok=2", "model.moe.top_k"),
]


@pytest.mark.parametrize("plus", ["", "+"])
@pytest.mark.parametrize("group, override, ours", CASES)
def test_compose_names_our_key_for_a_synonym(group, override, ours, plus):
    with pytest.raises(ConfigError, match=rf"did you mean {re.escape(ours)}\?"):
        compose([group, plus + override])


def test_our_own_keys_and_unknown_names_are_no_synonyms():
    assert synonym_of("model.gpt", "dim") is None
    assert synonym_of("model.gpt", "wibble") is None
    assert synonym_of("model.gpt", "N_EMBD") == "dim"
    assert synonym_of("model.llama", "num_key_value_heads") == "n_kv_heads"
    assert synonym_of("model.lora", "n_embd") is None


@pytest.mark.parametrize("plus", ["", "+"])
def test_the_cli_answers_both_forms_with_our_key(plus):
    """The real command line, ``--cfg job``: Hydra would print the job for ``+`` and say only
    "Key not in GPTConfig" without it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "sdnet_trainer", "model=gpt_tiny", f"{plus}model.gpt.n_embd=128"]
        + ["--cfg", "job"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "did you mean model.gpt.dim?" in proc.stderr


def test_optim_name_names_the_group_to_choose():
    cfg = compose(["optim.name=AdamW"])
    with pytest.raises(
        ConfigError, match=r"optim\.name=AdamW: choose .* optim=adamw \(the groups:"
    ):
        validate(cfg, world_size=1)


def test_every_name_override_of_a_group_gets_its_hint():
    hints = name_override_hints(["optim.NAME=sgd", "sched.name=Cosine", "loop.max_steps=3"])
    assert len(hints) == 2
    assert "optim=sgd" in hints[0]
    assert "sched=cosine" in hints[1]
    assert name_override_hints(["optim.name=Adam"]) == []  # no group of that name


def _docs_tables() -> dict[str, dict[str, tuple[tuple[str, ...], ...]]]:
    text = (REPO / "docs" / "language-models.md").read_text()
    section_text = text.split("## Names from nanoGPT, Hugging Face and torchtitan", 1)[1]
    section_text = re.split(r"\n## ", section_text, maxsplit=1)[0]
    tables: dict[str, dict[str, tuple[tuple[str, ...], ...]]] = {}
    current = None
    for line in section_text.splitlines():
        if m := re.fullmatch(r"### `(model\.\w+)`", line):
            current = m[1]
            tables[current] = {}
        elif current and line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            ours = cells[0].strip("`").removeprefix(f"{current}.")
            tables[current][ours] = tuple(
                () if c == "—" else tuple(n.strip().strip("`") for n in c.split(","))
                for c in cells[1:]
            )
        elif current and line.startswith("| our key"):
            assert [c.strip() for c in line.strip("|").split("|")][1:] == list(SOURCES)
    return tables


def test_the_docs_table_is_the_codes_table():
    assert _docs_tables() == SYNONYMS
