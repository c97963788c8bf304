"""model=hf_causal_lm (a transformers Llama built from a config.json, no download) under FSDP2 on
2 gloo processes, plain, with activation checkpointing and compile, and with context parallel over
the two: the same losses and final parameters as one process without a process group; one FSDP2
unit per decoder layer. The cases run in one launch."""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed._hf_causal_lm_worker import HFRecorder
from tests.support import REPO, run_cli
from tests.unit.test_hf_causal_lm import hf_run, tiny_config

transformers = pytest.importorskip("transformers")

WORKER = REPO / "tests" / "distributed" / "_hf_causal_lm_worker.py"
CASES = {
    "fsdp": ["parallel=fsdp"],
    "fsdp_ac_compile": [
        "parallel=fsdp",
        "parallel.activation_checkpointing=full",
        "compile=on",
        "compile.backend=eager",  # dynamo traces each layer; no C++ build on a CPU test machine
    ],
    # Context parallel through transformers' attention-function registry and position_ids.
    "fsdp_cp": ["parallel=fsdp", "parallel.cp=2"],
}


@pytest.mark.timeout(600)
def test_fsdp2_on_two_processes_trains_as_one_process(tmp_path):
    folder = tiny_config(tmp_path / "config")
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps({k: [*hf_run(folder), *v] for k, v in CASES.items()}))
    launch = run_cli(
        [str(tmp_path / "out"), str(spec)], cwd=tmp_path, nproc=2, script=WORKER, timeout=500
    )
    assert launch.returncode == 0, launch.output
    from sdnet_trainer.config import compose

    single = HFRecorder(compose([*hf_run(folder), "parallel=ddp"]), output_dir=tmp_path / "single")
    try:
        reference = single.record(single.fit())
    finally:
        single.close()
    assert len(reference["losses"]) == 3 and reference["losses"][-1] < reference["losses"][0]
    for name in CASES:
        sharded = torch.load(tmp_path / "out" / f"{name}.pt")
        # The root, then one unit per decoder layer.
        layers = [u for u in sharded["fsdp_units"] if "DecoderLayer" in u]
        assert len(layers) == 2 and len(sharded["fsdp_units"]) == 3, sharded["fsdp_units"]
        torch.testing.assert_close(sharded["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        assert sharded["params"].keys() == reference["params"].keys()
        for key, value in reference["params"].items():
            torch.testing.assert_close(sharded["params"][key], value, rtol=1e-4, atol=1e-6, msg=key)
