"""A Hugging Face folder that lies is refused before anything is allocated, on every rank.

Folders made by transformers and then edited as a user's wrong or altered folder would be
(``tests/support.py``: LYING_FOLDERS), each given as ``model.weights=hf:PATH`` to the real
Trainer's set-up, on 1 process and on 2 (FSDP2): each is refused with a message naming the
tensor, the shapes or the file, and the process's peak memory over all of them stays under 1 GB,
where the widest folder's config.json claims a model of 137 GB. The same folder unedited is set
up. A model too large for the memory given (``parallel.memory_per_rank_gib``) is refused with the
per-rank figure. Each layout is one launch (``_hf_refusal_worker.py``)."""

from __future__ import annotations

import json
import math

import pytest

from sdnet_trainer.training.fits import in_units
from tests.support import CPU, LYING_FOLDERS, REPO, lying_hf_folders, main_in_process, run_cli

WORKER = REPO / "tests" / "distributed" / "_hf_refusal_worker.py"
PEAK_BYTES = 1 << 30
BASE = [
    "+recipe=llama3_debug",
    *CPU,
    "data.vocab_size=96",
    "data.seq_len=32",
    "data.train_size=64",
    "data.val_size=16",
    "loop.global_batch_size=8",
    "logging.trackers=[]",
]
pytest.importorskip("transformers", reason="the llm extra is not installed")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return lying_hf_folders(tmp_path_factory.mktemp("hf"))


def _stored_numel(folder) -> int:
    from safetensors import safe_open

    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    return total


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_lying_folder_is_refused_on_every_rank_before_anything_is_allocated(
    folders, tmp_path, nproc
):
    cases = {name: [*BASE, f"model.weights=hf:{folders[name]}"] for name in LYING_FOLDERS}
    ok = [*BASE, f"model.weights=hf:{folders['ok']}"]
    cases["too_large"] = [*ok, "parallel.memory_per_rank_gib=0.0001"]
    cases["fits"] = ok
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    launch = run_cli(
        [str(tmp_path), str(tmp_path / "cases.json")],
        cwd=tmp_path,
        nproc=None if nproc == 1 else nproc,
        script=WORKER,
        timeout=300,
    )
    assert launch.returncode == 0, launch.output[-6000:]
    ranks = json.loads((tmp_path / "refusals.json").read_text())
    assert [r["rank"] for r in ranks] == list(range(nproc))
    # AdamW (the recipe's): weights, gradients and two moments, fp32; FSDP2 halves each over 2
    # ranks (every dimension it splits is even here).
    state = 4 * 4 * _stored_numel(folders["ok"]) // nproc
    for rank in ranks:
        said = rank["said"]
        assert said["fits"] is None, said["fits"]
        for case, words in LYING_FOLDERS.items():
            assert said[case] is not None, f"{case} was set up"
            for word in words:
                assert word in said[case], (case, said[case])
        assert f"training state needs {in_units(state)}" in said["too_large"]
        assert "parallel.memory_per_rank_gib=0.0001" in said["too_large"]
        assert rank["peak_rss_bytes"] < PEAK_BYTES, rank


@pytest.mark.usefixtures("main_in_this_process")
def test_the_command_exits_2_naming_the_tensor(folders, tmp_path, monkeypatch, capfd):
    args = [*BASE, f"model.weights=hf:{folders['wider']}", f"hydra.run.dir={tmp_path / 'run'}"]
    code, output = main_in_process(args, monkeypatch, capfd)
    assert code == 2, output[-3000:]
    assert LYING_FOLDERS["wider"][0] in output and "Traceback" not in output
