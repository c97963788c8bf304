"""model=hf_causal_lm through the real Trainer, one case per config (see _fsdp_accum_worker.py).

    torchrun --standalone --nproc_per_node=N _hf_causal_lm_worker.py OUT CASES_JSON

Rank 0 saves ``OUT/<name>.pt``: every step's global loss, the full final parameters, and the
classes of the modules ``fully_shard`` made units of, in order.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from torch.distributed.fsdp import FSDPModule

from sdnet_trainer.lazy import freeze_imports
from tests.distributed._fsdp_accum_worker import AccumulationRecorder
from tests.distributed._layout_worker import run_cases


class HFRecorder(AccumulationRecorder):
    def record(self, fit_result: object = None) -> dict:
        units = [type(m).__name__ for m in self.model.modules() if isinstance(m, FSDPModule)]
        return {**super().record(fit_result), "fsdp_units": units}


if __name__ == "__main__":
    freeze_imports()  # as the CLI does in its processes
    run_cases(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), HFRecorder)
