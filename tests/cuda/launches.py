"""Every config the CUDA tests compose or launch, as data: the overrides word for word.

A CUDA test runs only on a GPU node lent for minutes, so a mistake in its overrides (a key the
schema lacks, a shared list put after the test's own keys so that its ``model=`` wins, a layout
that preflight refuses) would cost that node. Kept here, each launch is checked on the CPU by
tests/unit/test_cuda_launches.py: composed through the command line with ``dist.device=cpu``,
validated as on the GPU (the CUDA queries faked), and, where ``cpu_step``, trained one step on
the CPU. The same test lints tests/cuda/ so that every ``compose(`` and ``run_cli(`` there takes
its keys from ``LAUNCHES``, and that every entry here is used.

A test appends only what belongs to its own run: paths (``hydra.run.dir=``, ``checkpoint.dir=``,
``checkpoint.resume=``) and values computed while it runs (a model as wide as the GPU's memory).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tests.support import CUDA, TINY_RUN


@dataclass(frozen=True)
class CudaLaunch:
    """One config of a CUDA test. ``keys``: the overrides exactly as composed or launched, device
    keys included. ``nproc``: None for a run without a process group (in the test's process or
    one plain process); N for a world of N ranks (torchrun's N processes, or the CUDA tests'
    ``one_rank`` group in the test's process for N = 1). ``cpu_step``: whether one training step
    of it fits a CPU test (False: what only CUDA has, a kernel or FSDP's CPU offload; an inductor
    compile, minutes on two cores; a launch that trains nothing)."""

    keys: tuple[str, ...]
    nproc: int | None = None
    cpu_step: bool = True


def override_key(override: str) -> str:
    """``model=x`` -> ``model``; ``+a.b=1`` -> ``a.b``: what an override sets."""
    return override.split("=", 1)[0].lstrip("+~")


def merged(*parts: Iterable[str]) -> tuple[str, ...]:
    """The parts' overrides in order, shared ones first, each key once: a later part's key
    replaces an earlier part's value of it where it stands. Hydra would let the last of two
    ``model=`` win silently, whichever list it came from; here the list says what is launched."""
    keys: list[str] = []
    for part in parts:
        for override in part:
            place = [i for i, key in enumerate(keys) if override_key(key) == override_key(override)]
            if place:
                keys[place[0]] = override
            else:
                keys.append(override)
    return tuple(keys)


# ---------------------------------------------------------------------- test_two_ranks_cuda.py
# Two ranks sharing one GPU over gloo against one process (both launched by _two_rank_worker.py),
# and test_context_parallel_cuda.py's Llama on the same two ranks.
TWO_RANK_STEPS = 8
TWO_RANK_RUN = merged(
    TINY_RUN,
    CUDA,
    [
        "dist.backend=gloo",
        "precision.tf32=false",  # fp32 math: the two layouts agree to rounding
        f"loop.max_steps={TWO_RANK_STEPS}",
        "loop.global_batch_size=32",
        "loop.eval_at_end=false",
        "checkpoint.every_n_steps=4",
        "checkpoint.async_save=true",
        "checkpoint.keep_last=2",
    ],
)
CP_LLAMA = [
    "model=llama3_debug",
    "data=tokens",
    "data.seq_len=64",
    "data.vocab_size=256",
    "data.val_size=32",
]

# ---------------------------------------------------------------------- test_fit_cuda.py
# ResNet-18 (ImageNet stem) on 64x64 synthetic images; gpt_tiny on the synthetic token language,
# each compiled and profiled in bf16.
FIT_MODELS = {
    "resnet18": [
        "model=resnet18",
        "model.channels_last=true",
        "data.image_size=64",
        "data.train_size=1024",
        "data.val_size=128",
        "optim.lr=0.05",
    ],
    "gpt_tiny": ["model=gpt_tiny", "data=tokens", "optim=adamw", "optim.lr=3e-3"],
}
FIT_COMPILED = [
    "trainer._target_=tests.support.ProbeTrainer",
    "precision=bf16",
    "compile=on",
    "profile=on",
    "profile.memory_snapshot=true",
    "sched=constant",
    "loop.max_steps=30",
    "loop.global_batch_size=64",
    "loop.eval_at_epoch_end=false",
    "logging.log_every_n_steps=5",
]
FP16_INIT_SCALE = 1024.0
ONE_RANK_NCCL = [
    "trainer._target_=tests.cuda.test_fit_cuda.ShardedProbe",
    "dist.backend=nccl",
    "loop.max_steps=20",
    "checkpoint.every_n_steps=10",
    "checkpoint.async_save=true",
]

# ---------------------------------------------------------------------- test_fsdp_cuda.py
FSDP_COMMON = [
    *CUDA,
    "parallel=fsdp",
    "optim=sgd",
    "optim.lr=0.05",
    "optim.momentum=0.9",
    "sched=constant",
    "loop.max_steps=4",
    "loop.global_batch_size=16",
    "loop.grad_accum_steps=2",
    "loop.eval_at_end=false",
    "loop.eval_at_epoch_end=false",
    "logging.trackers=[jsonl]",
    "checkpoint.save_on_exit=false",
]
FSDP_GPT = merged(FSDP_COMMON, ["model=gpt_tiny", "data=tokens", "data.train_size=256"])
# BatchNorm: the buffers (running statistics) that stay on the GPU under offload.
FSDP_RESNET = merged(
    FSDP_COMMON,
    [
        "model=resnet18",
        "model.cifar_stem=true",
        "data.image_size=16",
        "data.train_size=256",
        "precision=fp32",
    ],
)

# ---------------------------------------------------------------------- test_float8_cuda.py
# llama3_debug: every projection's sizes are multiples of 16, and so are a micro-batch's tokens
# (4 sequences of 32), which the float8 kernels need for the weight gradients.
FLOAT8_LLAMA = merged(
    CUDA,
    [
        "model=llama3_debug",
        "data=tokens",
        "data.seq_len=32",
        "data.vocab_size=256",
        "data.train_size=512",
        "optim=adamw",
        "optim.lr=3e-3",
        "sched=constant",
        "precision=bf16",
        "loop.max_steps=30",
        "loop.global_batch_size=8",
        "loop.grad_accum_steps=2",
        "loop.eval_at_end=false",
        "loop.eval_at_epoch_end=false",
        "logging.trackers=[]",
        "checkpoint.save_on_exit=false",
    ],
)

# ---------------------------------------------------------------------- test_model_build_cuda.py
BUILD_RUNS = {
    "gpt_tiny": [
        "model=gpt_tiny",
        "data=tokens",
        "data.train_size=32",
        "data.val_size=8",
        "loop.global_batch_size=8",
    ],
    # BatchNorm buffers, a replaced stem, channels_last parameters.
    "resnet18": [
        "model=resnet18",
        "model.cifar_stem=true",
        "model.channels_last=true",
        "data.image_size=16",
        "data.train_size=32",
        "data.val_size=8",
        "loop.global_batch_size=8",
    ],
}

# ---------------------------------------------------------------------- test_verdict_cuda.py
VERDICT_LOG_EVERY = 4
VERDICT_RUN = merged(TINY_RUN, [f"logging.log_every_n_steps={VERDICT_LOG_EVERY}"])
# The sync check's run: 11 steps (the last, a log point of its own, is no multiple of the log
# period), then the product's end of a run (the last verdict, the final evaluation, the save on
# exit). No periodic evaluation or checkpoint: the window asks the metrics hook only.
VERDICT_SYNC_CHECK = ["loop.max_steps=11"]

# ---------------------------------------------------------------------- test_moe_cuda.py
# moe_debug's widths in bf16: rows of 64 (dim) and 32 (moe_hidden_dim) elements, 128 and 64
# bytes, multiples of the grouped matmul's 16. One block: its router reads only the embedding and
# attention, which both paths compute alike, so both route every token the same way and differ
# only by the experts' bf16 rounding (two blocks could flip a near-tie of the second router).
# SGD: the step's update is the learning rate times the gradient, which the test compares.
MOE_BF16 = merged(
    CUDA,
    [
        "model=moe_debug",
        "model.moe.n_layers=1",
        "data=tokens",
        "data.seq_len=32",
        "data.vocab_size=256",
        "data.train_size=64",
        "data.val_size=16",
        "optim=sgd",
        "optim.lr=0.1",
        "optim.momentum=0.0",
        "optim.weight_decay=0.0",
        "precision=bf16",
        "loop.max_steps=1",
        "loop.global_batch_size=8",
        "loop.eval_at_end=false",
        "loop.eval_at_epoch_end=false",
        "logging.trackers=[]",
        "checkpoint.save_on_exit=false",
    ],
)


LAUNCHES: dict[str, CudaLaunch] = {
    # test_two_ranks_cuda.py: each layout on two ranks (torchrun) and in one process.
    "ddp_single": CudaLaunch(merged(TWO_RANK_RUN, ["parallel=ddp"])),
    "ddp_two_ranks": CudaLaunch(merged(TWO_RANK_RUN, ["parallel=ddp"]), nproc=2),
    "fsdp_single": CudaLaunch(merged(TWO_RANK_RUN, ["parallel=fsdp"])),
    "fsdp_two_ranks": CudaLaunch(merged(TWO_RANK_RUN, ["parallel=fsdp"]), nproc=2),
    # test_context_parallel_cuda.py: the shared run, then the Llama's keys, then context parallel.
    "cp_single": CudaLaunch(merged(TWO_RANK_RUN, CP_LLAMA)),
    "cp_ring": CudaLaunch(
        merged(TWO_RANK_RUN, CP_LLAMA, ["parallel.cp=2", "parallel.cp_attention=ring"]),
        nproc=2,
        cpu_step=False,  # torch's ring attention has CUDA kernels only
    ),
    "cp_allgather": CudaLaunch(
        merged(TWO_RANK_RUN, CP_LLAMA, ["parallel.cp=2", "parallel.cp_attention=allgather"]),
        nproc=2,
    ),
    # test_fit_cuda.py
    "fit_compiled_resnet18": CudaLaunch(
        merged(CUDA, FIT_MODELS["resnet18"], FIT_COMPILED), cpu_step=False
    ),
    "fit_compiled_gpt_tiny": CudaLaunch(
        merged(CUDA, FIT_MODELS["gpt_tiny"], FIT_COMPILED), cpu_step=False
    ),
    "fp16_overflow": CudaLaunch(
        merged(
            CUDA,
            TINY_RUN,
            [
                "precision=fp16",
                f"precision.init_scale={FP16_INIT_SCALE}",
                "precision.growth_interval=1000",  # no growth within the run: the scale halves
                "loop.max_steps=6",
                "logging.log_every_n_steps=1",
                "loop.eval_at_end=false",
                "checkpoint.save_on_exit=false",
            ],
        )
    ),
    **{
        f"one_rank_nccl_{strategy}": CudaLaunch(
            merged(CUDA, TINY_RUN, ONE_RANK_NCCL, [f"parallel={strategy}"]), nproc=1
        )
        for strategy in ("ddp", "fsdp", "zero1")
    },
    # test_fsdp_cuda.py: one-rank FSDP2 in the test's process.
    "fsdp_bf16_checkpointed": CudaLaunch(
        merged(FSDP_GPT, ["precision=bf16", "checkpoint.every_n_steps=2"]), nproc=1
    ),
    "fsdp_bf16_resumed": CudaLaunch(merged(FSDP_GPT, ["precision=bf16"]), nproc=1),
    "fsdp_cpu_offload": CudaLaunch(
        merged(FSDP_RESNET, ["parallel.fsdp.cpu_offload=true"]),
        nproc=1,
        cpu_step=False,  # moves the shards from the GPU to the host: refused on the CPU
    ),
    "fsdp_on_gpu": CudaLaunch(FSDP_RESNET, nproc=1),
    # test_float8_cuda.py: bf16 as the reference, each recipe, rowwise compiled, tensorwise FSDP2.
    "float8_bf16": CudaLaunch(FLOAT8_LLAMA),
    "float8_rowwise": CudaLaunch(merged(FLOAT8_LLAMA, ["precision.float8=rowwise"])),
    "float8_tensorwise": CudaLaunch(merged(FLOAT8_LLAMA, ["precision.float8=tensorwise"])),
    "float8_rowwise_compiled": CudaLaunch(
        merged(FLOAT8_LLAMA, ["precision.float8=rowwise", "compile=on"]), cpu_step=False
    ),
    "float8_tensorwise_fsdp": CudaLaunch(
        merged(FLOAT8_LLAMA, ["parallel=fsdp", "precision.float8=tensorwise"]), nproc=1
    ),
    # test_gpu_correctness_cuda.py: the NCCL group's worker (its session only), a short run
    # under the watchdog, and a LOCAL_RANK beyond the GPUs (refused before training).
    "nccl_group": CudaLaunch(merged(CUDA, ["dist.timeout_s=300"]), nproc=1, cpu_step=False),
    "watchdog_short_run": CudaLaunch(
        merged(CUDA, TINY_RUN, ["trainer._target_=tests.support.ProbeTrainer", "loop.max_steps=4"]),
        nproc=1,
    ),
    "local_rank_beyond": CudaLaunch(merged(CUDA, TINY_RUN, ["loop.max_steps=1"])),
    # test_model_build_cuda.py
    **{
        f"build_{name}": CudaLaunch(merged(CUDA, keys, ["loop.seed=13"]))
        for name, keys in BUILD_RUNS.items()
    },
    "fits_gpt_tiny": CudaLaunch(merged(CUDA, BUILD_RUNS["gpt_tiny"])),
    # test_plan_cuda.py: the planner's view of the GPU; nothing trains.
    "plan_auto": CudaLaunch(
        merged(CUDA, ["model=gpt_tiny", "data=tokens", "parallel=auto", "precision=bf16"]),
        cpu_step=False,
    ),
    # test_verdict_cuda.py
    "verdict_sync_check": CudaLaunch(merged(VERDICT_RUN, CUDA, VERDICT_SYNC_CHECK)),
    "verdict_nonfinite": CudaLaunch(merged(VERDICT_RUN, CUDA, ["loop.max_steps=6"])),
    # test_moe_cuda.py: one step with the grouped matmul, one with the loop over experts.
    "moe_bf16_step": CudaLaunch(MOE_BF16),
}
