"""Process group, device and data-parallel wrapping on native torch.distributed."""

from sdnet_trainer.distributed.ddp import wrap_data_parallel
from sdnet_trainer.distributed.env import DistEnv, distributed_session, launched_world_size
from sdnet_trainer.distributed.ops import all_gather_floats, all_reduce_sum, is_distributed

__all__ = [
    "DistEnv",
    "all_gather_floats",
    "all_reduce_sum",
    "distributed_session",
    "is_distributed",
    "launched_world_size",
    "wrap_data_parallel",
]
