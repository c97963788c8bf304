"""The docs stay true to the code: the generated config reference is current, and every config key
or group option the hand-written docs name exists."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys

import pytest
from omegaconf import OmegaConf

from sdnet_trainer import Config
from tests.support import REPO

HAND_WRITTEN = [
    "docs/troubleshooting.md",
    "docs/subclassing.md",
    "docs/getting-started.md",
    "docs/recipes.md",
    "docs/overrides.md",
    "docs/parallel.md",
    "docs/data.md",
    "docs/checkpoints.md",
    "docs/monitoring.md",
]
# Pages that name only a few config keys each: checked together, so that the check that the pattern
# still finds keys has enough of them to count.
FEW_KEYS = [
    "README.md",
    "CONTRIBUTING.md",
    "docs/export.md",
    "docs/serving.md",
    "docs/benchmarks.md",
    "docs/multinode.md",
    "docs/sweeps.md",
    "docs/gpu.md",
    "docs/testing.md",
]
# Words shaped like keys that are file names in the docs (`checkpoint.lock`, `model.onnx`).
FILE_SUFFIXES = {"lock", "pt", "pt2", "onnx", "safetensors", "json", "jsonl", "yaml", "csv", "log"}
# Keys the docs misspell on purpose, to show the error a misspelt key gets.
MISSPELT_ON_PURPOSE = {"optim.lrr"}


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location(
        "gen_config_docs", REPO / "scripts" / "docs" / "gen_config_docs.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_current(generator):
    expected = generator.render()
    current = generator.OUTPUT.read_text() if generator.OUTPUT.exists() else ""
    if current != expected:
        pytest.fail(
            f"docs/configuration.md is stale: run python scripts/docs/gen_config_docs.py\n"
            f"{generator.stale_summary(current, expected)}",
            pytrace=False,
        )


def _leaf_keys(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict) and value:
            yield from _leaf_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def test_the_reference_lists_every_key_of_the_schema(generator):
    documented = [key.name for section in generator.walk(Config) for key in section.keys]
    schema = OmegaConf.to_container(OmegaConf.structured(Config), resolve=False)
    assert sorted(documented) == sorted(_leaf_keys(schema))
    by_name = {key.name: key for section in generator.walk(Config) for key in section.keys}
    assert (
        by_name["loop.max_steps"].type == "Optional[int]"
        and by_name["loop.max_steps"].default == "100"
    )
    assert by_name["model.gpt.seq_len"].doc.startswith(
        "the context length"
    )  # a comment on the field's line
    assert (
        "(plain all-reduce" in by_name["comm.powersgd.rank"].doc
    )  # a comment block over several lines


def test_check_mode_reports_a_stale_file(generator, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(generator, "OUTPUT", tmp_path / "configuration.md")
    assert generator.main(["--check"]) == 1
    assert "run python scripts/docs/gen_config_docs.py" in capsys.readouterr().out
    assert generator.main([]) == 0 and generator.main(["--check"]) == 0


def _schema_has(path: list[str]) -> bool:
    node: object = Config
    for part in path:
        if not dataclasses.is_dataclass(node):
            return False
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            return False
        default = (
            fields[part].default_factory()
            if fields[part].default_factory is not dataclasses.MISSING
            else fields[part].default
        )
        if isinstance(default, dict):
            return True  # model.kwargs.width: a free-form dict takes any key
        node = type(default) if dataclasses.is_dataclass(default) else None
    return True


def _named_settings(text: str):
    """``key.path`` / ``key.path=value`` / ``group=option`` words inside inline code spans."""
    for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text):
        for word in span.split():
            if m := re.fullmatch(r"([a-z_]+(?:\.[A-Za-z_0-9]+)*)(=\S*)?", word):
                yield m[1], (m[2] or "")[1:]


@pytest.mark.parametrize("docs", [[doc] for doc in HAND_WRITTEN] + [FEW_KEYS], ids=str)
def test_hand_written_docs_name_only_real_keys(docs):
    top = {f.name for f in dataclasses.fields(Config)}
    groups = {p.name for p in (REPO / "configs").iterdir() if p.is_dir()}
    wrong = []
    checked = 0
    doc = ", ".join(docs)
    text = "\n".join((REPO / name).read_text() for name in docs)
    for key, value in _named_settings(text):
        path = key.split(".")
        if path[0] not in top or (path[0] == "trainer" and path[1:] != ["_target_"]):
            continue  # a module path, a file name, an export argument, a hook's trainer.step
        if key in MISSPELT_ON_PURPOSE or (len(path) == 2 and path[1] in FILE_SUFFIXES):
            continue
        checked += 1
        if len(path) == 1:
            if (
                path[0] in groups
                and value
                and not (REPO / "configs" / path[0] / f"{value}.yaml").exists()
            ):
                wrong.append(f"{key}={value} (no configs/{path[0]}/{value}.yaml)")
        elif not _schema_has(path):
            wrong.append(key)
    assert checked > 10, f"{doc}: found only {checked} config keys; is the pattern still right?"
    assert not wrong, f"{doc} names settings the config does not have: {wrong}"
