"""Every parallel layout against a single-process reference, through the real Trainer (gloo, CPU).

Three model families: the GPT and the Llama (no BatchNorm, so any split of the batch trains the
same) and a ResNet-18 split into pipeline stages at layer boundaries. The 4-process launch also
loads a Hugging Face Llama checkpoint under FSDP x TP: each rank reads only its slices.
BatchNorm normalises over each forward's micro-batch, so a ResNet layout is compared with the
single process that runs the same micro-batches (``loop.grad_accum_steps`` = data-parallel ranks
x pipeline micro-batches); BatchNorm's running statistics are per rank and are left out of the
parameter comparison.

Each launch runs many layouts in one process group (tests/distributed/_layout_worker.py); the
layouts' results are then checked one test at a time. SGD keeps float rounding from being
amplified the way Adam's normalisation does near zero gradients.
"""

from __future__ import annotations

import json

import pytest
import torch

from sdnet_trainer.config import compose
from sdnet_trainer.export.cli import main as export_main
from sdnet_trainer.plan import dry_run as plan_main
from tests.distributed._layout_worker import DIVISOR_TWICE
from tests.float8_cpu import float8_cpu_refusal
from tests.support import CHAT_VOCAB, REPO, chat_data, run_cli, tiny_llama_config

WORKER = REPO / "tests" / "distributed" / "_layout_worker.py"
COMMON = [
    "data.train_size=256",
    # One validation batch per rank of the 4-process layouts (the evaluation of the weights and
    # of their average is compared, not the figures of a larger set): each forward of a sharded
    # model is a round of collectives, under FSDP a gather of all its weights.
    "data.val_size=16",
    "loop.max_steps=5",
    "loop.global_batch_size=16",
    "loop.eval_at_epoch_end=false",
    "logging.trackers=[jsonl]",
    "logging.log_every_n_steps=5",
    "checkpoint.save_on_exit=false",
    "logging.flops=false",  # no MFU figures checked here: the count is a forward per rank and case
    # The weights' moving average in every layout (decay 0.5: 5 steps move it visibly away from
    # the weights), compared with the single process's, and evaluated as val_ema/*.
    "model.ema.enabled=true",
    "model.ema.decay=0.5",
    "model.ema.warmup_steps=1",
]
# Clipping at 0.5 is active on every GPT step (norms 1-3): clipping by the global norm is checked
# too.
GPT = COMMON + [
    "model=gpt_tiny",
    "model.gpt.n_layers=4",
    "data=tokens",
    "optim=sgd",
    "optim.lr=0.2",
    "optim.momentum=0.9",
    "optim.clip_grad_norm=0.5",
]
# The Llama on the same data and optimizer: GQA (4 query heads over 2 key/value heads), SwiGLU,
# RMSNorm, rotary positions with Llama 3 scaling.
LLAMA = COMMON + [
    "model=llama3_debug",
    "data=tokens",
    "data.seq_len=32",
    "data.vocab_size=256",
    "optim=sgd",
    "optim.lr=0.2",
    "optim.momentum=0.9",
    "optim.clip_grad_norm=0.5",
]
# Llama 3.2 1B's layout: the output layer shares the token embedding's weight.
LLAMA_TIED = LLAMA + ["model.llama.tie_embeddings=true"]
# A mixture of experts (2 blocks of 8 SwiGLU experts, top-2) on the same data and optimizer, its
# experts split over the ranks (parallel.ep takes them from dp_shard): with the per-sequence
# auxiliary loss (moe_*), and with the loss-free bias, moved every step (moebias_*).
MOE = [("model=moe_debug" if o == "model=llama3_debug" else o) for o in LLAMA]
MOE_BIAS = MOE + ["model.moe.load_balance=bias", "model.moe.bias_update_rate=0.01"]
# 16 experts: each router (64 -> 16) has float8's sizes, which the MoE keeps in high precision.
# Tensorwise under FSDP2 gathers the other weights in float8, which the weight average would
# turn off: no average. Left out where this CPU cannot compute float8 (tests/float8_cpu.py).
MOE_FLOAT8_REFUSAL = float8_cpu_refusal("tensorwise")
MOE16_FLOAT8 = [
    *(o for o in MOE if not o.startswith("model.ema.")),
    "model.moe.num_experts=16",
    "precision.float8=tensorwise",
]
MOE_FLOAT8 = {} if MOE_FLOAT8_REFUSAL else {"moe_fsdp_float8": MOE16_FLOAT8 + ["parallel=fsdp"]}
MOE_FLOAT8_REF = {} if MOE_FLOAT8_REFUSAL else {"moe_ref_float8": MOE16_FLOAT8}
EP = ["parallel=fsdp", "parallel.ep=2"]
RESNET = COMMON + [
    "model=resnet18",
    "model.cifar_stem=true",
    "data.image_size=16",
    "optim=sgd",
    "optim.lr=0.002",
    "optim.momentum=0.9",
]
SAVE = ["checkpoint.save_on_exit=true"]

SCHEDULES = {
    "GPipe": 1,
    "1F1B": 1,
    "Interleaved1F1B": 2,
    "LoopedBFS": 2,
    "InterleavedZeroBubble": 2,
    "ZBVZeroBubble": 2,
    "DualPipeV": 2,
}


def _pipeline(schedule: str, microbatches: int) -> list[str]:
    return [
        "parallel.pp=2",
        f"parallel.pipeline.schedule={schedule}",
        f"parallel.pipeline.stages_per_rank={SCHEDULES[schedule]}",
        f"parallel.pipeline.microbatches={microbatches}",
    ]


RESNET_SPLITS = {
    1: ["parallel.pipeline.split_points=[layer3]"],
    2: ["parallel.pipeline.split_points=[layer2,layer3,layer4]"],
}
# FSDP x TP 2, the loss computed on the vocabulary shards and the activations between blocks split
# along the sequence.
FSDP_TP_LOSS_SEQ = [
    "parallel=fsdp",
    "parallel.tp=2",
    "parallel.tensor_parallel.loss_parallel=true",
    "parallel.tensor_parallel.sequence_parallel=true",
]

# A validation set whose shares need different batch counts: 17 samples over 4 data-parallel
# ranks in batches of 4 (the micro-batch) are 2 batches on rank 0 and 1 on the others; over 2 in
# batches of 8, 2 and 1. Each FSDP forward gathers the weights, so every rank must run as many
# (padding batches, not counted); the metrics equal one process's over the same 17 samples. The
# plain FSDP and the FSDP x TP (loss and sequence parallel) layouts evaluate it (their training
# is the GPT reference's).
VAL_REMAINDER = {
    "gpt_fsdp": GPT + ["parallel=fsdp", "data.val_size=17"],
    "gpt_fsdp_tp_loss_seq": GPT + FSDP_TP_LOSS_SEQ + ["data.val_size=17"],
}
VAL_REMAINDER_REF = "gpt_ref_val_remainder"
# The same 17 samples over FSDP x 2 pipeline stages (2 data-parallel ranks: 2 batches of 8 on
# rank 0, 1 on the other) under loop.eval_max_batches=1: every rank and stage stops after its
# first batch (one running on alone would hang), and the two ranks' first batches are the split's
# first 16 samples, the GPT reference's whole validation set: its val/* and val_ema/* exactly.
VAL_CAP = "gpt_fsdp_pp_val_cap"
FLOAT8_REF = "llama_ref_float8"

# 1.9 MiB per rank (0.85 of 2.23): the GPT's SGD state and weight average sharded 4 ways with
# its gathered blocks and unsharded gradients fits (1.6 MiB with checkpointing), one replica of it
# per rank (DDP: 4.0 MiB, ZeRO-1: 3.4 MiB) or HSDP (2.2 MiB) does not. Off pipeline stages
# (on cores shared by the ranks no bubble is idle time, and 4 stages of one block would win),
# and the cores named shared, as on the 2-core machines, so that every machine plans alike.
AUTO_FSDP = [
    "parallel=auto",
    "parallel.memory_per_rank_gib=0.00218",
    "parallel.auto.ranks_per_node=4",
    "parallel.auto.max_pp=1",
    "parallel.auto.shared_cores=true",
]

# name -> (world size, overrides, reference). Every GPT layout is compared with one process on
# the whole batch; ResNet layouts with one process over the same 4 micro-batches of 4.
WORLD4 = {
    **VAL_REMAINDER,
    VAL_CAP: GPT
    + ["parallel=fsdp", "data.val_size=17", "loop.eval_max_batches=1"]
    + _pipeline("1F1B", 2),
    "gpt_fsdp_zero2": GPT + ["parallel=fsdp", "parallel.fsdp.reshard_after_forward=false"],
    # Replicas of 2 shards, each rank's batch in 2 micro-batches.
    "gpt_hsdp_accum": GPT
    + [
        "parallel=fsdp",
        "parallel.dp_replicate=2",
        "parallel.dp_shard=2",
        "loop.grad_accum_steps=2",
    ],
    "gpt_zero1": GPT + ["parallel=zero1"] + SAVE,  # its optimizer state is saved by parameter name
    # parallel=auto with memory for FSDP over the 4 ranks but not for a replica of the model on
    # each (DDP, ZeRO-1): the planner chooses and the run trains as one process does.
    "gpt_auto": GPT + AUTO_FSDP,
    "gpt_tp": GPT + ["parallel.tp=4"],
    "gpt_ddp_pp": GPT + _pipeline("1F1B", 2),
    "gpt_fsdp_pp": GPT + ["parallel=fsdp"] + _pipeline("1F1B", 2),
    # The Llama in the GPT's layouts (one implementation of blocks, TP plan and pipeline units).
    # FSDP x TP with loss and sequence parallel trains it in chat_fsdp_tp_loss_seq (below).
    "llama_fsdp_ac": LLAMA + ["parallel=fsdp", "parallel.activation_checkpointing=full"],
    # 2 stages of TP 2, with selective activation checkpointing (its policy over DTensor ops);
    # saved, as the tied FSDP x TP run below, for the Hugging Face export.
    "llama_tp_pp": LLAMA
    + ["parallel.tp=2", "parallel.activation_checkpointing=selective"]
    + _pipeline("1F1B", 2)
    + SAVE,
    # One parameter under two names, split by vocabulary rows under TP and sharded by FSDP.
    "llama_tied_fsdp_tp": LLAMA_TIED + ["parallel=fsdp", "parallel.tp=2"] + SAVE,
    # The ResNet in the layouts where a CNN differs from a decoder: how it is sharded (whole
    # blocks, BatchNorm's buffers per rank) and staged (at layer boundaries). FSDP's other
    # settings and meshes (reshard_after_forward, HSDP) shard it as they shard the GPT above, at
    # several times a GPT case's cost (11M parameters gathered per forward); ZeRO-1 and DDP
    # over stages treat every model's parameters alike (gpt_zero1, gpt_ddp_pp). FSDP2 refuses
    # channels_last parameters: the layout rides on the inputs alone there.
    "resnet_fsdp": RESNET + ["parallel=fsdp", "model.channels_last=true"],
    "resnet_fsdp_pp": RESNET + ["parallel=fsdp"] + _pipeline("1F1B", 2) + RESNET_SPLITS[1],
    # Context parallel beside FSDP (sharded over dp_shard x cp) and beside TP (FSDP over cp).
    "llama_fsdp_cp": LLAMA + ["parallel=fsdp", "parallel.dp_shard=2", "parallel.cp=2"],
    "llama_fsdp_tp_cp": LLAMA
    + [
        "parallel=fsdp",
        "parallel.tp=2",
        "parallel.cp=2",
        "parallel.activation_checkpointing=selective",
    ],
    # Expert parallel: FSDP over the 4 ranks, each pair of them holding the same 4 experts (saved
    # for the Hugging Face export); with activation checkpointing (the recomputed forward sends
    # its tokens again, and counts them once); over two pipeline stages with the bias.
    "moe_fsdp_ep": MOE + EP + SAVE,
    "moe_fsdp_ep_ac": MOE + EP + ["parallel.activation_checkpointing=full"],
    "moebias_ep_pp": MOE_BIAS + EP + _pipeline("1F1B", 2),
}
WORLD2 = {
    # Tensor parallel alone (its 2 key/value heads bound the Llama's TP degree).
    "llama_tp": LLAMA + ["parallel.tp=2"],
    # Float8 matmuls (torchao, rowwise scaling) under FSDP2. Its reference runs the ranks' two
    # micro-batches of 8 in one process: a weight gradient's float8 scales span a micro-batch.
    "llama_fsdp_float8": LLAMA + ["parallel=fsdp", "precision.float8=rowwise"],
    # compile (aot_eager: no code generation) and activation checkpointing per block, under FSDP2
    # (each rank compiles: the costliest GPT case, on 2 ranks rather than 4).
    "gpt_fsdp_compiled_ac": GPT
    + [
        "parallel=fsdp",
        "compile=on",
        "compile.backend=aot_eager",
        "parallel.activation_checkpointing=full",
    ],
    **{f"gpt_pp_{s}": GPT + _pipeline(s, 4) for s in SCHEDULES},
    # Every schedule runs the GPT above; the ResNet runs one that treats its stages differently:
    # two per rank (a V: the first and the last on one rank), and the backward split into input
    # and weight gradients (through convolutions and BatchNorm). One stage per rank:
    # resnet_fsdp_pp, resnet_pp_saved.
    "resnet_pp_ZBVZeroBubble": RESNET
    + _pipeline("ZBVZeroBubble", 4)
    + RESNET_SPLITS[SCHEDULES["ZBVZeroBubble"]],
    # Context parallel alone: each sequence in two load-balanced halves, gradients averaged over
    # the two (DDP); saved at step 3 for a one-process resume without it. The GPT (learned
    # positions) with selective activation checkpointing, which keeps the gathered keys.
    "llama_cp": LLAMA + ["parallel.cp=2", "checkpoint.every_n_steps=3"] + SAVE,
    "gpt_cp_selective_ac": GPT + ["parallel.cp=2", "parallel.activation_checkpointing=selective"],
    # Each rank holds half the experts; tokens go to them and back by all-to-all.
    "moe_ep": MOE + EP,
    "moebias_ep": MOE_BIAS + EP,
    # Written here, read back by one process without the layout (cross-layout checkpoints).
    "gpt_fsdp2_saved": GPT + ["parallel=fsdp"] + SAVE,
    "gpt_pp_saved": GPT + _pipeline("1F1B", 2) + SAVE,
    "resnet_pp_saved": RESNET + _pipeline("1F1B", 4) + RESNET_SPLITS[1] + SAVE,
}

# model.lora (peft's adapters, the base frozen) under FSDP2, DDP, FSDP2 over context-parallel
# ranks and two pipeline stages, and DoRA under FSDP2 (each rank's magnitudes from its own rows of
# the base), each against one process (LORA_REFS). No weight average: a LoRA run refuses
# model.ema (it would copy the frozen base).
LLAMA_LORA = LLAMA + ["model.ema.enabled=false", "model.lora.enabled=true", "model.lora.r=4"]
LLAMA_DORA = LLAMA_LORA + ["model.lora.use_dora=true", "model.lora.target_modules=[q_proj,v_proj]"]
LORA2 = {
    "llama_lora_fsdp": LLAMA_LORA + ["parallel=fsdp"] + SAVE,  # read back: llama_lora_from_fsdp
    "llama_lora_ddp": LLAMA_LORA,
    "llama_lora_fsdp_cp": LLAMA_LORA + ["parallel=fsdp", "parallel.cp=2"],
    "llama_lora_pp": LLAMA_LORA + _pipeline("1F1B", 2),
    "llama_dora_fsdp": LLAMA_DORA + ["parallel=fsdp"],
}
LORA_REFS = {"llama_lora_ref": LLAMA_LORA, "llama_dora_ref": LLAMA_DORA}


# The step's loss over masked targets: chat windows counting 0 to 32 assistant targets each (the
# prompts' targets are -100), so the micro-batches of a layout count very different numbers of
# targets. 25 conversations pack into 40 training windows of 32 tokens (and 4 validation windows,
# one per rank of the 4-process layouts): the global batch is the whole training split, so the one
# step covers the same windows whatever the sampler's order.
CHAT_CONVERSATIONS, CHAT_BATCH, CHAT_LR = 25, 40, 1.0
CHAT_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
CHAT_LAYOUTS = {
    1: {"chat_1micro": [], "chat_4micro": ["loop.grad_accum_steps=4"]},
    2: {
        "chat_ddp": [],
        "chat_fsdp": ["parallel=fsdp"],
        "chat_pp": _pipeline("1F1B", 2),
        # The pipeline's other schedule families: several stages per rank, the backward split
        # into input and weight gradients, stages in a V.
        **{f"chat_pp_{s}": _pipeline(s, 4) for s in CHAT_SCHEDULES},
        "chat_tp_loss_parallel": ["parallel.tp=2", "parallel.tensor_parallel.loss_parallel=true"],
        # Each window's halves count different numbers of targets on the two ranks.
        "chat_cp": ["parallel.cp=2"],
    },
    4: {
        "chat_hsdp": ["parallel=fsdp", "parallel.dp_replicate=2", "parallel.dp_shard=2"],
        "chat_ddp_accum": ["loop.grad_accum_steps=2"],
        "chat_fsdp_tp_loss_seq": FSDP_TP_LOSS_SEQ,
    },
}


# The mixture of experts on the same chat data, its experts split over two ranks, against one
# process (transformers has no model of its exact architecture to compare with).
CHAT_MOE = ["model=moe_debug", "model.moe.num_experts=4", f"model.moe.vocab_size={CHAT_VOCAB}"]
CHAT_MOE_LAYOUTS = {1: {"chat_moe_ref": []}, 2: {"chat_moe_ep": ["parallel=fsdp", "parallel.ep=2"]}}
# Every reducer against the contract's divisor (tests/distributed/_layout_worker.py's
# DIVISOR_TWICE): those that read it train as before, those whose divisor torch fixes refuse.
DIVISOR_READ = ("chat_fsdp", "chat_hsdp", "chat_moe_ep")
DIVISOR_CHECKED = {
    "chat_ddp": "DDP",
    "chat_cp": "DDP",
    "chat_pp": "without a gradient reducer",
    "chat_tp_loss_parallel": "without a gradient reducer",
}


def _chat_run(out) -> list[str]:
    """A tiny Hugging Face Llama, a BPE tokenizer and the conversations (written once), and the
    overrides of one plain SGD step from them."""
    transformers = pytest.importorskip("transformers", reason="the llm extra is not installed")
    folder = out / "chat_hf"
    if not folder.exists():
        torch.manual_seed(0)
        # 4 layers: 2 stages on each of 2 ranks.
        config = tiny_llama_config(
            vocab_size=CHAT_VOCAB, intermediate_size=48, eos_token_id=0, num_hidden_layers=4
        )
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return [
        "model=llama3_debug",
        f"model.weights=hf:{folder}",
        *chat_data(out, conversations=CHAT_CONVERSATIONS),
        "precision=fp32",
        "optim=sgd",
        f"optim.lr={CHAT_LR}",
        "optim.momentum=0",
        "optim.weight_decay=0",
        "sched=constant",
        "loop.max_steps=1",
        f"loop.global_batch_size={CHAT_BATCH}",
        "loop.eval_at_end=false",
        "loop.eval_at_epoch_end=false",
        "logging.trackers=[]",
        "logging.flops=false",
        "checkpoint.save_on_exit=false",
    ]


def _chat_cases(out, nproc: int) -> dict[str, list[str]]:
    cases = {name: _chat_run(out) + extra for name, extra in CHAT_LAYOUTS[nproc].items()}
    for name, extra in CHAT_MOE_LAYOUTS.get(nproc, {}).items():
        run = [o for o in _chat_run(out) if not o.startswith(("model=", "model.weights="))]
        cases[name] = run + CHAT_MOE + extra
    doubled = [*DIVISOR_READ, *DIVISOR_CHECKED]
    return {**cases, **{f"{n}{DIVISOR_TWICE}": cases[n] for n in doubled if n in cases}}


def _single(out) -> dict[str, list[str]]:
    def reload(name: str, base: list[str]) -> list[str]:
        return base + [f"checkpoint.resume={out / name / 'checkpoints' / 'step_00000005'}"]

    return {
        "gpt_ref": GPT,
        "llama_ref": LLAMA,
        "llama_tied_ref": LLAMA_TIED,
        "moe_ref": MOE,
        "moebias_ref": MOE_BIAS,
        FLOAT8_REF: LLAMA + ["precision.float8=rowwise", "loop.grad_accum_steps=2"],
        **{name: o + ["loop.grad_accum_steps=2"] for name, o in MOE_FLOAT8_REF.items()},
        VAL_REMAINDER_REF: GPT + ["data.val_size=17"],
        "resnet_ref": RESNET + ["loop.grad_accum_steps=4"],
        "gpt_from_fsdp2": reload("gpt_fsdp2_saved", GPT),
        "gpt_from_pp": reload("gpt_pp_saved", GPT),
        "gpt_from_zero1": reload("gpt_zero1", GPT),
        # From the context-parallel run's step 3, continued to its step 5 on one process; and
        # its step 5, read back.
        "llama_from_cp_step3": LLAMA
        + [f"checkpoint.resume={out / 'llama_cp' / 'checkpoints' / 'step_00000003'}"],
        "llama_from_cp": reload("llama_cp", LLAMA),
        "resnet_from_pp": reload("resnet_pp_saved", RESNET + ["loop.grad_accum_steps=4"]),
        **LORA_REFS,
        "llama_lora_from_fsdp": reload("llama_lora_fsdp", LLAMA_LORA),
    }


def _launch(out, cases: dict[str, list[str]], nproc: int | None, timeout: float = 420) -> None:
    spec = out / f"cases_{nproc}.json"
    spec.write_text(json.dumps(cases))
    launch = run_cli([str(out), str(spec)], cwd=out, nproc=nproc, script=WORKER, timeout=timeout)
    assert launch.returncode == 0, launch.output[-6000:]


@pytest.fixture(scope="module")
def layout_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts")


# A Hugging Face Llama large enough that its bytes stand out from a process's other memory
# (~71 MB in fp32, mostly the 32000-token embedding and output layer), in 20 MB shards.
HF_LOAD_CONFIG = {
    "vocab_size": 32000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
HF_LOAD = "hf_load_fsdp_tp"


def _hf_load_case(out) -> dict[str, list[str]]:
    """model.weights=hf:PATH under FSDP x TP (2 x 2), set up only (the worker checks the load)."""
    transformers = pytest.importorskip("transformers", reason="the llm extra is not installed")
    folder = out / "hf_llama"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_LOAD_CONFIG))
    model.save_pretrained(folder, max_shard_size="20MB")
    overrides = [
        *LLAMA,
        f"model.weights=hf:{folder}",
        "model.ema.enabled=false",  # a copy of the weights would count in the set-up's memory
        "data.vocab_size=32000",
        "data.train_size=64",
        *FSDP_TP_LOSS_SEQ,
    ]
    return {HF_LOAD: overrides}


@pytest.fixture(scope="module")
def runs(layout_dir) -> dict[str, dict]:
    out = layout_dir
    # The Hugging Face load last: the earlier cases have imported everything it uses.
    # The longest launch (about 6 minutes of 2 loaded cores): a timeout of its own.
    _launch(out, {**WORLD4, **_chat_cases(out, 4), **_hf_load_case(out)}, nproc=4, timeout=600)
    _launch(out, {**WORLD2, **MOE_FLOAT8, **LORA2, **_chat_cases(out, 2)}, nproc=2)
    _launch(out, {**_single(out), **_chat_cases(out, 1)}, nproc=None)
    return {path.stem: torch.load(path, weights_only=False) for path in out.glob("*.pt")}


def _reference(name: str) -> str:
    if name in VAL_REMAINDER:
        return VAL_REMAINDER_REF
    if name.startswith("llama_tied"):
        return "llama_tied_ref"
    if "float8" in name:
        return FLOAT8_REF
    return f"{name.split('_')[0]}_ref"


def _trained_params(record: dict) -> dict[str, torch.Tensor]:
    return {
        k: v for k, v in record["params"].items() if "running_" not in k and "num_batches" not in k
    }


# BatchNorm over micro-batches of 4 is ill-conditioned: the rounding differences of another
# reduction order (1e-7 after one step) grow to ~1e-4 in 5 steps. A wiring error (a missing
# reduction, wrong samples, a stage left out) shows at 1e-1.
TOLERANCE = {
    "gpt": {"rel": 1e-5, "norm": 1e-4, "params": 1e-5},
    "llama": {"rel": 1e-5, "norm": 1e-4, "params": 1e-5},
    "moe": {"rel": 1e-5, "norm": 1e-4, "params": 1e-5},
    "moebias": {"rel": 1e-5, "norm": 1e-4, "params": 1e-5},
    "resnet": {"rel": 2e-3, "norm": 5e-3, "params": 5e-4},
    # float8 (e4m3: 3 mantissa bits) rounds each matmul input: where another reduction order
    # moves a value across a rounding boundary, that element moves by up to 1/16 of itself, so
    # layouts agree to ~1e-4 after 5 steps (losses, norms; weights to 1.3e-4), not to fp32's
    # 1e-6. A wiring error shows at 1e-1.
    "float8": {"rel": 1e-4, "norm": 1e-3, "params": 5e-4},
}


def _assert_same_training(run: dict, ref: dict, family: str) -> None:
    tol = TOLERANCE[family]
    assert run["losses"] == pytest.approx(ref["losses"], rel=tol["rel"], abs=1e-5)
    # The global gradient norm (all shards, all stages) equals the single process's, every step.
    assert run["grad_norms"] == pytest.approx(ref["grad_norms"], rel=tol["norm"], abs=1e-5)
    params, expected = _trained_params(run), _trained_params(ref)
    assert params.keys() == expected.keys()  # original names, every stage and shard gathered
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value, rtol=1e-4, atol=tol["params"], msg=name)
    # The average, gathered from shards and stages like the weights, follows them in every layout.
    ema, expected_ema = (
        _trained_params({"params": run["ema"]}),
        _trained_params({"params": ref["ema"]}),
    )
    assert ema.keys() == expected_ema.keys() and ema.keys() <= params.keys()
    for name, value in expected_ema.items():
        torch.testing.assert_close(ema[name], value, rtol=1e-4, atol=tol["params"], msg=name)
        assert not torch.equal(value, expected[name]), name  # an average, not the weights


@pytest.mark.parametrize(
    "name", sorted(WORLD4) + sorted(n for n in WORLD2 if not n.endswith("_saved"))
)
def test_layout_matches_single_process(runs, name):
    run, ref = runs[name], runs[_reference(name)]
    assert len(run["losses"]) == 5 and run["losses"][-1] < run["losses"][0]  # it trained
    language_model = name.startswith(("gpt", "llama", "moe"))
    if language_model:
        assert (
            min(ref["grad_norms"]) > 0.5
        )  # optim.clip_grad_norm=0.5 scaled every step's gradients
    _assert_same_training(run, ref, "float8" if "float8" in name else name.split("_")[0])
    if "tied" in name:  # still one weight after training
        assert torch.equal(run["params"]["head.weight"], run["params"]["embed.tok.weight"])
    if language_model or name in WORLD2:
        # Evaluation over sharded / pipelined models equals the single process's. Not for ResNets
        # with several data-parallel ranks: each keeps its own BatchNorm running statistics.
        assert run["metrics"]["val/loss"] == pytest.approx(ref["metrics"]["val/loss"], rel=1e-4)
        # ... and so does the average's, evaluated in the model's place.
        assert run["metrics"]["val_ema/loss"] == pytest.approx(
            ref["metrics"]["val_ema/loss"], rel=1e-4
        )
        assert run["metrics"]["val_ema/loss"] != run["metrics"]["val/loss"]


@pytest.mark.parametrize("name", sorted(LORA2))
def test_lora_layout_matches_single_process(runs, name):
    """model.lora on 2 processes: every step's loss and gradient norm (the adapters' alone), the
    trained adapters and the untouched base equal one process's; the optimizer state is the
    adapters' alone (the base is frozen: no gradient), under FSDP2 half of it on each rank."""
    from sdnet_trainer.models.lora import base_name

    run, ref = runs[name], runs["llama_dora_ref" if "dora" in name else "llama_lora_ref"]
    assert len(run["losses"]) == 5  # (5 steps barely move a random base's loss: B shows below)
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-5)
    assert run["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-4, abs=1e-5)
    assert run["params"].keys() == ref["params"].keys()
    adapters = {n: v for n, v in ref["params"].items() if base_name(n) is None}
    for param, value in ref["params"].items():
        if param in adapters:
            torch.testing.assert_close(run["params"][param], value, rtol=1e-4, atol=1e-5)
        else:  # frozen: the seeded init on every layout
            assert torch.equal(run["params"][param], value), param
    assert all(v.abs().sum() > 0 for n, v in adapters.items() if ".lora_B." in n)  # B trained
    adapter_bytes = sum(v.numel() * v.element_size() for v in adapters.values())
    assert ref["state_bytes"][0]["optim"] == ref["state_bytes"][0]["grads"] == adapter_bytes
    shares = [r["optim"] for r in run["state_bytes"]]  # SGD's momentum: the adapters' alone
    assert shares == [r["grads"] for r in run["state_bytes"]]
    if "fsdp" in name:  # sharded: half on each rank (FSDP pads a shard by less than a row)
        rows = sum(v.numel() // v.shape[0] * v.element_size() for v in adapters.values())
        assert all(abs(share - adapter_bytes / 2) <= rows for share in shares), shares
    elif "pp" in name:  # each stage its own blocks' adapters
        assert sum(shares) == adapter_bytes
    else:  # replicated
        assert shares == [adapter_bytes] * 2
    assert run["metrics"]["val/loss"] == pytest.approx(ref["metrics"]["val/loss"], rel=1e-4)


def test_a_lora_checkpoint_holds_the_adapters_alone_and_loads_on_one_process(runs, layout_dir):
    """Written by FSDP2 on 2 ranks: the model entry is the adapters (no copy of the frozen base);
    read by one process, which rebuilds the base from the seed: the same weights, bitwise."""
    from torch.distributed.checkpoint import FileSystemReader

    from sdnet_trainer.models.lora import base_name

    writer, reader = runs["llama_lora_fsdp"], runs["llama_lora_from_fsdp"]
    assert reader["losses"] == []  # resumed at the last step
    for name, value in writer["params"].items():
        assert torch.equal(reader["params"][name], value), name
    checkpoint = layout_dir / "llama_lora_fsdp" / "checkpoints" / "step_00000005"
    keys = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    saved = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    assert saved == {n for n in writer["params"] if base_name(n) is None}


@pytest.mark.skipif(MOE_FLOAT8_REFUSAL is not None, reason=MOE_FLOAT8_REFUSAL or "")
def test_float8_under_fsdp_leaves_the_moe_routers_plain(runs):
    """Tensorwise float8 on 2 FSDP2 ranks trains as one process on the ranks' micro-batches: the
    attention computes in float8 and is gathered in float8, the routers, which the MoE keeps in
    high precision, stay plain Linear layers with plain weights."""
    run, ref = runs["moe_fsdp_float8"], runs["moe_ref_float8"]
    assert len(run["losses"]) == 5 and run["losses"][-1] < run["losses"][0]  # it trained
    _assert_same_training(run, ref, "float8")
    assert run["metrics"]["val/loss"] == pytest.approx(ref["metrics"]["val/loss"], rel=1e-4)
    types = run["linear_types"]
    for i in range(2):
        assert types[f"blocks.{i}.mlp.router"] == ("Linear", "Tensor")
        for proj in ("wq", "wk", "wv", "wo"):
            assert types[f"blocks.{i}.attn.{proj}"] == (
                "Float8Linear",
                "WeightWithDynamicFloat8CastTensor",
            )
    assert types["head"] == ("Linear", "Tensor")


def test_parallel_auto_chose_fsdp_where_a_replica_per_rank_does_not_fit(runs):
    """The layout the planner chose on each rank before the group started (the run itself is
    compared with one process above, as gpt_auto): FSDP over the 4 ranks. Planning runs the dry
    run in the training process; DTensor's caches keep nothing of its fake meshes (before they
    were emptied, every rank wrote rank 0's slice of each initial weight)."""
    assert runs["gpt_auto"]["layout"] == {
        "strategy": "fsdp",
        "dp_replicate": 1,
        "dp_shard": 4,
        "tp": 1,
        "pp": 1,
    }


@pytest.mark.parametrize("name", sorted(VAL_REMAINDER))
def test_uneven_validation_shards_evaluate_like_one_process(runs, name):
    """The run finished (an extra forward on one rank alone hung it until the collective
    timeout), and every val/* and val_ema/* metric equals one process's on the same weights:
    the padding counted for nothing, every sample once."""
    run, ref = runs[name], runs[VAL_REMAINDER_REF]
    keys = {k for k in ref["metrics"] if k.startswith(("val/", "val_ema/"))}
    assert {"val/loss", "val/top1", "val/top5", "val_ema/loss"} <= keys
    assert keys == {k for k in run["metrics"] if k.startswith(("val/", "val_ema/"))}
    for key in sorted(keys):
        assert run["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=1e-6), key
    # 17 samples, not 16: the remainder sample changes the mean.
    assert ref["metrics"]["val/loss"] != runs["gpt_ref"]["metrics"]["val/loss"]


def test_a_capped_evaluation_of_uneven_shards_is_over_the_first_batches_alone(runs):
    """loop.eval_max_batches=1 over uneven shares and pipeline stages: the run finished, and
    every val/* and val_ema/* metric is one process's over the split's first 16 samples, not
    over all 17."""
    run, ref = runs[VAL_CAP], runs["gpt_ref"]
    keys = {k for k in ref["metrics"] if k.startswith(("val/", "val_ema/"))}
    assert {"val/loss", "val/top1", "val_ema/loss"} <= keys
    assert keys == {k for k in run["metrics"] if k.startswith(("val/", "val_ema/"))}
    for key in sorted(keys):
        assert run["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=1e-6), key
    assert run["metrics"]["val/loss"] != runs[VAL_REMAINDER_REF]["metrics"]["val/loss"]


@pytest.mark.parametrize(
    "saved, loaded",
    [
        ("gpt_fsdp2_saved", "gpt_from_fsdp2"),
        ("gpt_pp_saved", "gpt_from_pp"),
        ("resnet_pp_saved", "resnet_from_pp"),
        ("gpt_zero1", "gpt_from_zero1"),
        ("llama_cp", "llama_from_cp"),
    ],
)
def test_checkpoint_loads_across_layouts(runs, saved, loaded):
    """Written by FSDP on 2 ranks, a 2-stage pipeline, context parallel on 2 ranks or ZeRO-1 on 4
    ranks (optimizer state sharded by parameter), read by one process without any of them (model
    and optimizer state loaded): the same weights and the same eval loss."""
    writer, reader = runs[saved], runs[loaded]
    assert reader["losses"] == []  # resumed at the last step: nothing left to train
    for name, value in writer["params"].items():
        torch.testing.assert_close(reader["params"][name], value, rtol=0, atol=0, msg=name)
    for name, value in writer["ema"].items():  # the average is resharded like the weights
        torch.testing.assert_close(reader["ema"][name], value, rtol=0, atol=0, msg=name)
    assert reader["metrics"]["val/loss"] == pytest.approx(writer["metrics"]["val/loss"], rel=1e-5)
    assert reader["metrics"]["val_ema/loss"] == pytest.approx(
        writer["metrics"]["val_ema/loss"], rel=1e-5
    )


def test_a_context_parallel_checkpoint_continues_on_one_process(runs):
    """Written at step 3 by two ranks under parallel.cp=2 and continued to step 5 by one process
    without it: steps 4 and 5 are those of the uninterrupted context-parallel run (weights,
    momentum and data position restored), within the layouts' tolerance (test above: the
    weights it reads are bitwise those written)."""
    writer, reader = runs["llama_cp"], runs["llama_from_cp_step3"]
    assert reader["losses"] == pytest.approx(writer["losses"][3:], rel=1e-5, abs=1e-6)
    assert reader["grad_norms"] == pytest.approx(writer["grad_norms"][3:], rel=1e-4, abs=1e-6)
    for name, value in writer["params"].items():
        torch.testing.assert_close(reader["params"][name], value, rtol=1e-4, atol=1e-5, msg=name)


def _param_row_bytes(params: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(all parameter bytes, one dim-0 row of each parameter): FSDP pads each shard by < 1 row."""
    total = sum(v.numel() * v.element_size() for v in params.values())
    rows = sum(v.numel() // v.shape[0] * v.element_size() for v in params.values())
    return total, rows


@pytest.mark.parametrize("name", ["gpt_fsdp", "resnet_fsdp"])
def test_fsdp_holds_a_quarter_of_the_training_state(runs, name):
    ref = runs[_reference(name)]
    full = ref["state_bytes"][0]
    total, rows = _param_row_bytes(_trained_params(ref))
    assert full["params"] == total
    for rank_bytes in runs[name]["state_bytes"]:
        for kind in ("params", "grads", "optim"):  # optim: SGD's momentum buffers
            assert rank_bytes[kind] <= full[kind] / 4 + rows, (kind, rank_bytes, full)
        assert rank_bytes["params"] < full["params"] / 3


def test_zero1_shards_only_the_optimizer_state(runs):
    full = runs["gpt_ref"]["state_bytes"][0]
    ranks = runs["gpt_zero1"]["state_bytes"]
    largest = max(v.numel() * v.element_size() for v in _trained_params(runs["gpt_ref"]).values())
    assert (
        sum(r["optim"] for r in ranks) == full["optim"]
    )  # every parameter's state on one rank only
    for rank_bytes in ranks:
        assert rank_bytes["params"] == full["params"] and rank_bytes["grads"] == full["grads"]
        # Whole parameters are assigned to ranks, so a rank can exceed 1/N by one parameter.
        assert rank_bytes["optim"] <= full["optim"] / 4 + largest


@pytest.mark.parametrize("ema", [False, True])
@pytest.mark.parametrize("saved", ["gpt_fsdp2_saved", "gpt_pp_saved"])
def test_export_consolidates_sharded_and_pipelined_checkpoints(
    runs, layout_dir, tmp_path, saved, ema
):
    """python -m sdnet_trainer.export on a checkpoint written by FSDP shards or pipeline stages:
    one full state dict, loadable with weights_only=True, equal to the trained weights (with
    ema=true, to their moving average)."""
    checkpoint = layout_dir / saved / "checkpoints" / "step_00000005"
    # The worker's recording Trainer subclass runs as a script; its model is the stock one.
    assert (
        export_main(
            [
                f"checkpoint={checkpoint}",
                "format=pt",
                f"out={tmp_path}",
                "trainer=sdnet_trainer.Trainer",
                f"ema={str(ema).lower()}",
            ]
        )
        == 0
    )
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    writer = runs[saved]["ema" if ema else "params"]
    # The average has each tied tensor once; the export has every name of the bare model.
    assert weights.keys() >= writer.keys()
    if not ema:
        assert weights.keys() == writer.keys()
    for name, value in writer.items():
        torch.testing.assert_close(weights[name].float(), value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("saved", ["llama_tp_pp", "llama_tied_fsdp_tp"])
def test_export_hf_of_a_multi_process_llama_checkpoint_loads_in_transformers(
    runs, layout_dir, tmp_path, saved
):
    """format=hf on a checkpoint written by 4 processes (TP x pipeline stages, or FSDP x TP with
    tied embeddings): transformers reloads the folder as is, its weights are the trained ones and
    its logits equal the trained model's."""
    transformers = pytest.importorskip("transformers", reason="the llm extra is not installed")
    from sdnet_trainer.models.hf_folder import read_hf_config
    from sdnet_trainer.models.llama import Llama
    from sdnet_trainer.models.llama.hf import from_hf_name, llama_sizes_from_hf

    checkpoint = layout_dir / saved / "checkpoints" / "step_00000005"
    args = [f"checkpoint={checkpoint}", "format=hf", f"out={tmp_path}"]
    assert export_main([*args, "trainer=sdnet_trainer.Trainer"]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    trained = runs[saved]["params"]
    for name, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, trained[from_hf_name(name)], rtol=0, atol=0, msg=name)
    mine = Llama(**llama_sizes_from_hf(read_hf_config(tmp_path, key="out"), source="out"))
    mine.load_state_dict(trained)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, mine.eval()(tokens), rtol=0, atol=1e-5)


def test_export_hf_of_an_expert_parallel_checkpoint_loads_in_transformers(
    runs, layout_dir, tmp_path
):
    """format=hf on the mixture of experts written by 4 processes with its experts split over 2
    (FSDP x EP): transformers reloads a Qwen3-MoE folder holding every expert, the trained
    weights, and its logits equal the trained model's."""
    transformers = pytest.importorskip("transformers", reason="the llm extra is not installed")
    from sdnet_trainer.models.moe import MoEDecoder, moe_sizes

    saved = "moe_fsdp_ep"
    checkpoint = layout_dir / saved / "checkpoints" / "step_00000005"
    args = [f"checkpoint={checkpoint}", "format=hf", f"out={tmp_path}"]
    assert export_main([*args, "trainer=sdnet_trainer.Trainer"]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.model_type == "qwen3_moe"
    mine = MoEDecoder(**moe_sizes(compose(MOE).model))
    mine.load_state_dict(runs[saved]["params"])
    experts = reloaded.config.num_experts
    assert experts == 8 and mine.blocks[0].mlp.experts.w1.shape[0] == experts
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, mine.eval()(tokens), rtol=0, atol=1e-5)


def test_hugging_face_weights_load_each_ranks_slices_under_fsdp_tp(runs):
    """model.weights=hf:PATH on 4 processes (FSDP 2 x TP 2): every rank's shard of every tensor
    equals its slice of the file and the gathered tensors the file's, and no rank's peak resident
    memory grew by the model's size while setting up: each read only its own slices."""
    ranks = runs[HF_LOAD]["hf_load"]
    assert len(ranks) == 4
    model_bytes = ranks[0]["model_bytes"]
    assert model_bytes > 60e6  # the sizes above: the embedding and head dominate
    for rank in ranks:
        assert rank["shards_equal"] and rank["full_equal"], rank
        assert rank["local_bytes"] <= model_bytes / 4 + 4 * 32000 * 4  # a quarter (and padding)
        assert rank["peak_bytes"] < model_bytes, rank


# Layouts whose per-rank bytes the dry run predicts: sharded (FSDP, FSDP x TP, FSDP x PP, ResNet
# FSDP with uneven shards, a weight shared by two modules), tensor parallel alone, and ZeRO-1
# (replicated, optimizer sharded).
PLANNED = [
    "gpt_fsdp",
    "gpt_fsdp_tp_loss_seq",
    "gpt_fsdp_pp",
    "gpt_tp",
    "gpt_zero1",
    "resnet_fsdp",
    "llama_tied_fsdp_tp",
    "llama_fsdp_cp",
    "llama_fsdp_tp_cp",
]


@pytest.mark.parametrize("name", PLANNED)
def test_dry_run_predicts_every_ranks_training_state(runs, tmp_path, name):
    """``--dry-run`` (fake process group, meta tensors) gives each rank the parameter, gradient
    and optimizer-state bytes the real 4-process run measured on that rank."""
    plan = tmp_path / "plan.json"
    # In this process (what --dry-run runs, without starting an interpreter per layout).
    assert plan_main(["world_size=4", "ranks=all", f"json={plan}", *WORLD4[name]]) == 0
    planned = json.loads(plan.read_text())
    measured = runs[name]["state_bytes"]
    assert [p["rank"] for p in planned] == [0, 1, 2, 3]
    for rank_plan, rank_bytes in zip(planned, measured, strict=True):
        assert {k: rank_plan[k] for k in ("params", "grads", "optim")} == rank_bytes


@pytest.fixture(scope="module")
def chat_reference(layout_dir) -> tuple[float, dict[str, torch.Tensor]]:
    """transformers' own step on the whole global batch at once: ``LlamaForCausalLM``'s loss with
    ``labels=`` (the mean over every counted target of the batch), one plain SGD step; (the loss,
    the weights after the step)."""
    transformers = pytest.importorskip("transformers", reason="the llm extra is not installed")
    from sdnet_trainer.config import compose
    from sdnet_trainer.data import build_datasets

    cfg = compose(_chat_run(layout_dir))
    train, _ = build_datasets(cfg.data)
    assert len(train) == CHAT_BATCH
    inputs, targets = (torch.stack(t) for t in zip(*(train[i] for i in range(len(train)))))
    counts = (targets != -100).sum(dim=1)
    assert counts.min() == 0 and counts.max() >= 30  # windows of very different weight
    # labels[:, t + 1] is the target of position t (transformers shifts them); the appended
    # position's own target is dropped by the shift, and causal attention keeps it from the others.
    input_ids = torch.cat([inputs, torch.zeros_like(inputs[:, :1])], dim=1)
    labels = torch.cat([torch.full_like(targets[:, :1], -100), targets], dim=1)
    model = transformers.LlamaForCausalLM.from_pretrained(layout_dir / "chat_hf")
    model.train()
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=CHAT_LR).step()
    return loss.item(), {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", [n for layouts in CHAT_LAYOUTS.values() for n in layouts])
def test_the_step_loss_over_masked_targets_is_transformers_loss(runs, chat_reference, name):
    """The loss of a step is the sum of the token losses over the global batch divided by its
    count of counted targets, whatever the split into ranks, micro-batches, stages or vocabulary
    shards: after one SGD step every layout's weights equal those of transformers' step on the
    whole batch, and its logged loss is transformers' loss."""
    from sdnet_trainer.models.llama.hf import to_hf_name

    reference_loss, reference = chat_reference
    run = runs[name]
    assert run["losses"] == [pytest.approx(reference_loss, rel=1e-6)]
    params = {to_hf_name(k): v for k, v in run["params"].items()}
    assert params.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(params[key], value, rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", list(CHAT_MOE_LAYOUTS[2]))
def test_expert_parallel_step_over_masked_targets_matches_one_process(runs, name):
    """Expert parallel's reducer (FSDP over the ranks holding the same experts, divided by the
    contract's divisor) and the auxiliary loss's weight (the contract's per-sequence weight): one
    SGD step on the chat data equals one process's."""
    run, reference = runs[name], runs["chat_moe_ref"]
    assert run["losses"] == [pytest.approx(reference["losses"][0], rel=1e-6)]
    assert run["params"].keys() == reference["params"].keys()
    for key, value in reference["params"].items():
        torch.testing.assert_close(run["params"][key], value, rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", [*DIVISOR_READ, *DIVISOR_CHECKED])
def test_every_reducer_divides_by_the_contracts_divisor(runs, chat_reference, name):
    """The step's reduction contract (distributed/reduction.py) doubled: the loss weights carry
    twice the divisor. A reducer that reads it (FSDP2, HSDP, FSDP x TP, expert parallel) divides
    by twice as much and the step's weights are unchanged; a reducer whose divisor torch fixes
    (DDP, also over context-parallel peers) or a layout without one (pipeline, tensor parallel)
    is refused, naming it, before a step could train with the wrong factor."""
    run = runs[f"{name}{DIVISOR_TWICE}"]
    if name in DIVISOR_CHECKED:
        assert DIVISOR_CHECKED[name] in run["refused"] and "divides by" in run["refused"]
        return
    assert "refused" not in run, run.get("refused")
    reference = runs[name]["params"]  # the same layout with the contract as it is
    for key, value in reference.items():
        torch.testing.assert_close(run["params"][key], value, rtol=0, atol=1e-6, msg=key)
