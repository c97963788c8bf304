"""The entries of a checkpoint: a ``Part`` per stateful piece of a run, and the two that need
torch's distributed state-dict helpers (``ModelState``, ``OptimizerState``), so the same code
serves DDP, FSDP, tensor and pipeline parallel and ZeRO-1, and a checkpoint loads into any layout
and world size. The training loop's Checkpointer (sdnet_trainer.training.checkpointer) saves and
restores them; the fault-tolerance room hands them to a joining group."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from sdnet_trainer.checkpoint.untrusted import Checkpoint
from sdnet_trainer.distributed.ddp import unwrap
from sdnet_trainer.distributed.zero import (
    load_zero_param_groups,
    materialize_zero_state,
    zero_state_dict,
)


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@dataclass(frozen=True)
class Part:
    """One entry of the checkpoint. ``per_rank``: saved under ``NAME/rankR`` and restored only
    when the writer had the same world size; otherwise ``reset`` runs (after every other part is
    loaded, so it may read the restored step). ``optional``: a checkpoint without it keeps the
    live value (e.g. the fp16 loss scaler, absent from a bf16 run's checkpoint)."""

    state: Stateful
    per_rank: bool = False
    optional: bool = False
    reset: Callable[[], None] | None = None


class ModelState:
    """The model's weights through ``get_model_state_dict``: full names, sharded tensors kept
    sharded (DTensors), so DCP reshards them for any layout. ``trainable_only`` (model.lora's
    adapters): the parameters that train, not the frozen ones, which the run rebuilds from its
    own source (``model.weights``, or the seeded init) and which would be a second copy of the
    base model in every checkpoint."""

    def __init__(self, model: nn.Module, *, trainable_only: bool = False) -> None:
        self.model = model
        self.trainable_only = trainable_only
        self.options = StateDictOptions(
            ignore_frozen_params=trainable_only, strict=not trainable_only
        )

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model, options=self.options)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        loaded = set_model_state_dict(self.model, state, options=self.options)
        if self.trainable_only and loaded.unexpected_keys:
            raise RuntimeError(f"the model has no place for {sorted(loaded.unexpected_keys)}")


class OptimizerState:
    """The optimizer state keyed by parameter name, the same form under every layout (ZeRO-1's
    shards included, see distributed/zero.py)."""

    def __init__(self, model: nn.Module, optimizer: Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            return zero_state_dict(unwrap(self.model), self.optimizer)
        untouched = not self.optimizer.state
        state = get_optimizer_state_dict(self.model, self.optimizer)
        if untouched:
            # The helper materialises optimizer state with a zero-lr step (AdamW would then count
            # step 1); keep the live optimizer as it was, the copy above is enough to save.
            self.optimizer.state.clear()
        return state

    def load_request(self, checkpoint: Checkpoint, key: str) -> dict[str, Any]:
        """The state dict for DCP to fill: live tensors of the right shapes, without entries the
        checkpoint lacks (parameters that never had a gradient have no optimizer state)."""
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            materialize_zero_state(self.optimizer)
        state = self.state_dict()
        per_param = state["state"]
        for name in [n for n in per_param if not checkpoint.has_key(f"{key}.state.{n}")]:
            del per_param[name]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            load_zero_param_groups(self.optimizer, state["param_groups"])
        else:
            # Not strict: parameters without a gradient so far rightly have no optimizer state.
            set_optimizer_state_dict(
                self.model, self.optimizer, state, options=StateDictOptions(strict=False)
            )
