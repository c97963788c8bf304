"""DDP gradient communication chosen by ``comm.hook``: compressed all-reduce, PowerSGD, local SGD.

All five options are torch's own DDP communication hooks and model averager; this module only
builds them from config, keeps the state they carry across steps in a form a checkpoint can hold,
and says how many bytes each option hands to the collectives, so runs can be compared on what
they actually send.

    none       DDP's built-in all-reduce of fp32 gradient buckets.
    fp16/bf16  default_hooks.fp16_compress_hook / bf16_compress_hook: each bucket is cast to
               16 bits (divided by the world size first), all-reduced, and cast back.
    powersgd   powerSGD_hook (per gradient matrix) or batched_powerSGD_hook (one square matrix per
               bucket): rank-r factors P and Q are all-reduced instead of the gradients, after
               ``start_iter`` steps of plain all-reduce.
    local_sgd  post_localSGD_hook + PeriodicModelAverager: plain all-reduce for ``start_step``
               steps, then every rank steps on its own gradients and the parameters of all
               replicas are averaged every ``period`` steps.

Local SGD runs with ``post_local_gradient_allreduce=False``: after ``start_step`` there is no
gradient communication at all. torch's default instead all-reduces gradients inside each node and
averages parameters across nodes; on one node that is plain DDP plus averaging replicas that are
already equal, not the "step locally" that ``comm.local_sgd`` promises.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook, powerSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel

from sdnet_trainer.config.schema import CommConfig
from sdnet_trainer.distributed.comm_hooks import (
    BATCHED_BROKEN,
    HOOKS,
    batched_powersgd_works,
    bf16_hook,
    check_gloo_bf16,
    compression_plan,
    fp16_hook,
)

logger = logging.getLogger(__name__)


class GradientComm:
    """The DDP communication hook and, for local SGD, the model averager; built once after DDP
    wrapping (``DistributedDataParallel`` allows one hook per model).

    Per step the Trainer calls ``after_optimizer_step`` (parameter averaging under local SGD);
    ``bytes_per_step`` feeds the ``comm/bytes_per_step`` metric; ``state_dict`` /
    ``load_state_dict`` carry the hook's memories across a resume.
    """

    def __init__(
        self,
        ddp_model: DistributedDataParallel,
        cfg: CommConfig,
        *,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        assert cfg.hook in HOOKS, f"comm.hook={cfg.hook!r}: validate_comm runs before launch"
        self.cfg = cfg
        self.hook = cfg.hook
        self.process_group = process_group
        # What DDP reduces: parameters that need gradients, minus those DDP was told to ignore.
        ignored: set[str] = getattr(ddp_model, "parameters_to_ignore", set())
        named = [
            (n, p)
            for n, p in ddp_model.module.named_parameters()
            if p.requires_grad and n not in ignored
        ]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._ddp: DistributedDataParallel | None = ddp_model  # None after release()
        self._powersgd: powerSGD_hook.PowerSGDState | None = None
        self._local: post_localSGD_hook.PostLocalSGDState | None = None
        self.averager: PeriodicModelAverager | None = None
        # PowerSGD: the parameters of each bucket as last seen (indices into self._params), and
        # per-parameter memories waiting to be placed into buckets (after a resume, or after DDP
        # rebuilt its buckets; None: nothing to place); see _powersgd_hook.
        self._layouts: dict[int, tuple[int, ...]] = {}
        self._pending_error: dict[str, torch.Tensor] | None = None
        self._pending_q: dict[str, torch.Tensor] | None = None

        if self.hook in ("fp16", "bf16"):
            if self.hook == "bf16" and dist.get_backend(process_group) == "gloo":
                check_gloo_bf16(process_group)
            ddp_model.register_comm_hook(
                process_group, fp16_hook if self.hook == "fp16" else bf16_hook
            )
        elif self.hook == "powersgd":
            ps = cfg.powersgd
            # A property of the installed torch, refused by validate_comm before launch.
            assert not ps.batched or batched_powersgd_works(), BATCHED_BROKEN
            self._powersgd = powerSGD_hook.PowerSGDState(
                process_group=process_group,
                matrix_approximation_rank=ps.rank,
                start_powerSGD_iter=ps.start_iter,
                min_compression_rate=ps.min_compression_rate,
                use_error_feedback=ps.use_error_feedback,
                warm_start=ps.warm_start,
                random_seed=0,
            )
            self._torch_hook = (
                powerSGD_hook.batched_powerSGD_hook if ps.batched else powerSGD_hook.powerSGD_hook
            )
            self._serialize_buckets = dist.get_backend(process_group) != "nccl"
            ddp_model.register_comm_hook(self._powersgd, self._powersgd_hook)
        elif self.hook == "local_sgd":
            ls = cfg.local_sgd
            self._local = post_localSGD_hook.PostLocalSGDState(
                process_group=process_group,
                subgroup=None,
                start_localSGD_iter=ls.start_step,
                post_local_gradient_allreduce=False,
            )
            ddp_model.register_comm_hook(self._local, post_localSGD_hook.post_localSGD_hook)
            self.averager = PeriodicModelAverager(
                period=ls.period, warmup_steps=ls.start_step, process_group=process_group
            )

    # ------------------------------------------------------------------ per step

    def after_optimizer_step(self, params: Iterable[nn.Parameter]) -> None:
        """Call once per optimizer step, right after ``optimizer.step()`` and *before*
        ``zero_grad(set_to_none=True)``: torch's averager averages only parameters that have a
        gradient. Local SGD: average the replicas' parameters every ``period`` steps from
        ``start_step`` on (one all-reduce of all parameters). Other hooks: nothing."""
        if self.averager is None:
            return
        params = list(params)
        if params and all(p.grad is None for p in params):
            raise RuntimeError(
                "GradientComm.after_optimizer_step: no parameter has a gradient; call it "
                "before optimizer.zero_grad(set_to_none=True)"
            )
        self.averager.average_parameters(params)

    def synchronized_after(self, step: int) -> bool:
        """Whether all replicas hold identical parameters after optimizer step ``step`` (1-based):
        always, except under local SGD between averaging steps."""
        if self.averager is None:
            return True
        ls = self.cfg.local_sgd
        done = step - 1  # the averager's counter when that step's average_parameters ran
        return step <= ls.start_step or (
            done >= ls.start_step and (done - ls.start_step) % ls.period == 0
        )

    def discard_error_feedback(self) -> None:
        """Forget PowerSGD's memories of the step's gradients, e.g. after a step whose gradients
        were non-finite (a skipped fp16 step, ``health.nonfinite=skip``): the error feedback and
        the warm-started factors P and Q would carry the inf/NaN into every later step (the
        factors start again from PowerSGD's own seeded random ones, the same on every rank).
        No-op for the other hooks."""
        if self._powersgd is not None:
            self._powersgd.error_dict.clear()
            self._powersgd.p_memory_dict.clear()
            self._powersgd.q_memory_dict.clear()
            self._pending_error = None

    def release(self) -> None:
        """Drop this wrapper's references to the DDP model, its parameters and the hooks' state
        (PowerSGD's memories, the averager), before the process group goes away: a
        DistributedDataParallel still alive when its group is destroyed can abort the process at
        exit, and a traceback or the checkpointer may keep this wrapper alive past that point.
        The wrapper is unusable afterwards; safe to call twice."""
        self._ddp = None
        self._names, self._params, self._index = [], [], {}
        self._powersgd = self._local = self.averager = None
        self._layouts.clear()
        self._pending_error = self._pending_q = None
        self.process_group = None

    # ------------------------------------------------------------------ communication volume

    def bytes_per_step(self, step: int | None = None) -> float:
        """Bytes this rank hands to collectives for gradient synchronisation (and, under local SGD,
        parameter averaging amortised over ``period``) in one optimizer step.

        This is the payload: the sizes of the tensors passed to ``all_reduce``, in the dtype they
        are sent in. It is not the traffic on the wire, which depends on the algorithm (a ring
        all-reduce sends about ``2 (W-1)/W`` times the payload per rank) and on the transport.
        Control messages (the Trainer's per-step agreement, metric gathers) are not counted;
        under ZeRO-1 neither is the optimizer's parameter broadcast.

        ``step`` is the 1-based optimizer step (``Trainer.step`` after the step): before PowerSGD's
        ``start_iter`` / local SGD's ``start_step`` it is a plain all-reduce. None: the steady
        state, once compression or local steps are on.
        """
        elems = [(p.numel(), p.element_size()) for p in self._params]
        full = float(sum(n * size for n, size in elems))
        if self.hook == "none":
            return full
        if self.hook in ("fp16", "bf16"):
            return float(sum(n * 2 for n, _ in elems))
        if self.hook == "powersgd":
            ps = self.cfg.powersgd
            if step is not None and step <= ps.start_iter:
                return full
            return float(self._batched_bytes() if ps.batched else self._per_matrix_bytes())
        # local_sgd: one all-reduce of every parameter per period, nothing for gradients.
        ls = self.cfg.local_sgd
        if step is not None and step <= ls.start_step:
            return full
        return full / ls.period

    def _per_matrix_bytes(self) -> int:
        """powerSGD_hook: per gradient viewed as (shape[0], rest), P and Q of rank r where that
        compresses by more than min_compression_rate, the raw gradient otherwise."""
        ps = self.cfg.powersgd
        total = 0
        for p in self._params:
            plan = compression_plan(p.shape, ps.rank, ps.min_compression_rate)
            total += p.element_size() * ((plan[0] + plan[1]) * plan[2] if plan else p.numel())
        return total

    def _batched_bytes(self) -> int:
        """batched_powerSGD_hook: each bucket, zero-padded to a square of side ceil(sqrt(n)),
        sends P and Q of side x rank. Bucket sizes as seen by the hook (after DDP's rebuild),
        or DDP's initial buckets before the first step."""
        rank, size = self.cfg.powersgd.rank, self._params[0].element_size() if self._params else 4
        if self._layouts:
            lengths = [
                sum(self._params[i].numel() for i in layout) for layout in self._layouts.values()
            ]
        elif self._ddp is not None:
            sizes = str(self._ddp._get_ddp_logging_data().get("bucket_sizes", ""))
            lengths = [int(b) // size for b in sizes.split(",") if b.strip()]
        else:
            lengths = []
        return sum(2 * math.ceil(math.sqrt(n)) * rank * size for n in lengths)

    # ------------------------------------------------------------------ PowerSGD bucket memories

    def _powersgd_hook(self, state: powerSGD_hook.PowerSGDState, bucket):
        """torch's PowerSGD hook, after making sure its per-bucket memories belong to this bucket.

        torch keys the error-feedback and warm-start memories by bucket index. A resumed run
        starts with DDP's initial buckets and DDP rebuilds them after its first step, so the same
        index can then hold other parameters. The memories are therefore kept per parameter in
        between (``_to_pending``) and re-assembled in the bucket's current order."""
        index = bucket.index()
        layout = tuple(self._index[id(p)] for p in bucket.parameters())
        known = self._layouts.get(index)
        if known is not None and known != layout:
            logger.info(
                "PowerSGD: DDP's gradient buckets changed; re-arranging the error and "
                "warm-start memories"
            )
            self._to_pending()
        if index not in self._layouts:
            self._layouts[index] = layout
            self._from_pending(index, layout)
        future = self._torch_hook(state, bucket)
        if self._serialize_buckets:
            # The hook issues its P and Q all-reduces from the callbacks of earlier ones. gloo
            # runs those callbacks on its own threads as collectives finish, so with several
            # buckets in flight the ranks could issue them in different orders: a collective
            # mismatch ("Received data size doesn't match expected size"). Finishing each bucket
            # before DDP hands over the next keeps the order the same on every rank, at the cost
            # of overlap with backward. (NCCL's futures run their callbacks at once, in order.)
            future.wait()
        return future

    def _to_pending(self) -> None:
        """Move every bucket's memories into per-parameter tensors (batched PowerSGD: drop them,
        its memories mix parameters within a padded square)."""
        state = self._powersgd
        assert state is not None  # called by the PowerSGD hook only
        if not self.cfg.powersgd.batched:
            self._pending_error, self._pending_q = self._memories_per_parameter()
        elif state.error_dict or state.q_memory_dict:
            logger.warning(
                "batched PowerSGD: the error-feedback and warm-start memories are reset "
                "(they cannot follow a change of DDP's buckets)"
            )
        state.error_dict.clear()
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
        self._layouts.clear()

    def _from_pending(self, index: int, layout: tuple[int, ...]) -> None:
        state, names = self._powersgd, [self._names[i] for i in layout]
        assert state is not None  # called by the PowerSGD hook only
        pending = self._pending_error
        if pending is not None and names and all(n in pending for n in names):
            state.error_dict[index] = torch.cat([pending.pop(n).reshape(-1) for n in names]).to(
                self._params[layout[0]].device
            )
        pending = self._pending_q
        order = self._compressed_order(layout)
        if pending is not None and all(self._names[i] in pending for i in order):
            like = self._params[layout[0]]
            q = (
                torch.cat([pending.pop(self._names[i]).reshape(-1) for i in order])
                if order
                else like.new_empty(0)
            )
            p_len = sum(n * r for n, _, r in (self._compressed_plan(i) for i in order))
            # torch draws a new random Q (and a number from its generator) for a bucket without P
            # memory, even one with nothing to compress; P itself is recomputed from Q every step,
            # so only its presence matters.
            state.q_memory_dict[index] = q.to(like.device)
            state.p_memory_dict[index] = like.new_empty(p_len)

    def _compressed_order(self, layout: tuple[int, ...]) -> list[int]:
        """The parameters of a bucket that powerSGD_hook compresses, in the order of its Q memory:
        grouped by matrix shape, groups in order of first appearance, bucket order within."""
        rank, rate = self.cfg.powersgd.rank, self.cfg.powersgd.min_compression_rate
        groups: dict[tuple[int, int], list[int]] = {}
        for i in layout:
            plan = compression_plan(self._params[i].shape, rank, rate)
            if plan:
                groups.setdefault(plan[:2], []).append(i)
        return [i for members in groups.values() for i in members]

    def _compressed_plan(self, i: int) -> tuple[int, int, int]:
        """``compression_plan`` of a parameter from ``_compressed_order`` (one that is
        compressed, so it has a plan)."""
        ps = self.cfg.powersgd
        plan = compression_plan(self._params[i].shape, ps.rank, ps.min_compression_rate)
        assert plan is not None
        return plan

    def _memories_per_parameter(
        self,
    ) -> tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]:
        """(error, Q) per parameter name from the live bucket memories and those still pending;
        each None when no bucket has that memory."""
        state = self._powersgd
        assert state is not None  # PowerSGD only
        error = dict(self._pending_error or {})
        q = dict(self._pending_q or {})
        for index, layout in self._layouts.items():
            error.update(self._split_error(state.error_dict.get(index), layout))
            q.update(self._split_q(state.q_memory_dict.get(index), layout))
        has_error = self._pending_error is not None or any(
            i in state.error_dict for i in self._layouts
        )
        has_q = self._pending_q is not None or any(i in state.q_memory_dict for i in self._layouts)
        return (error if has_error else None), (q if has_q else None)

    def _split_error(
        self, flat: torch.Tensor | None, layout: tuple[int, ...]
    ) -> dict[str, torch.Tensor]:
        if flat is None:
            return {}
        out, offset = {}, 0
        for i in layout:
            p = self._params[i]
            out[self._names[i]] = flat[offset : offset + p.numel()].view(p.shape).clone()
            offset += p.numel()
        return out

    def _split_q(
        self, flat: torch.Tensor | None, layout: tuple[int, ...]
    ) -> dict[str, torch.Tensor]:
        if flat is None:
            return {}
        out, offset = {}, 0
        for i in self._compressed_order(layout):
            _, m, r = self._compressed_plan(i)
            out[self._names[i]] = flat[offset : offset + m * r].view(m, r).clone()
            offset += m * r
        return out

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """The hook's memories, as tensors (no pickled objects); ``{}`` for none/fp16/bf16.

        PowerSGD: the step counter, the generator that draws the random Q matrices, and for
        ``batched=false`` the error-feedback memory and the warm-start Q matrices, one tensor per
        parameter, so that they survive DDP re-bucketing on resume (``have_error`` / ``have_q``
        say whether they existed; before compression starts they are zeros). For ``batched=true``
        these two memories are not saved: a resumed run starts them afresh, which changes a few
        steps' approximation, not correctness. The error memory differs per rank: store this dict
        under a per-rank key and skip it when the world size changed.

        Local SGD: the hook's and the averager's step counters. The replicas' parameters and
        momentum between two averaging steps are per rank and are *not* here: a checkpoint of a
        DDP model holds one replica, so a resume is exact only from a step after which replicas
        were averaged (``synchronized_after``).
        """
        if self._powersgd is not None:
            state = self._powersgd
            # legacy=True is the default; spelled out because numpy's stubs give the default call
            # the dict form. A RandomState (MT19937) returns the legacy tuple.
            rng_state = state.rng.get_state(legacy=True)
            assert isinstance(rng_state, tuple)
            keys, pos, has_gauss, gauss = rng_state[1:]
            out: dict[str, Any] = {
                "iter": torch.tensor(state.iter, dtype=torch.int64),
                "rng_keys": torch.from_numpy(keys.astype("int64")),
                "rng_pos": torch.tensor([pos, has_gauss], dtype=torch.int64),
                "rng_gauss": torch.tensor(gauss, dtype=torch.float64),
            }
            if not self.cfg.powersgd.batched:
                error, q = self._memories_per_parameter()
                ps = self.cfg.powersgd
                shapes = {
                    n: plan[1:]
                    for n, p in zip(self._names, self._params)
                    if (plan := compression_plan(p.shape, ps.rank, ps.min_compression_rate))
                }
                # Complete memories only: a partial one (never expected between steps) is dropped.
                full_error = (
                    error if error is not None and len(error) == len(self._params) else None
                )
                full_q = q if q is not None and set(q) == set(shapes) else None
                out["have_error"] = torch.tensor(int(full_error is not None))
                out["have_q"] = torch.tensor(int(full_q is not None))
                out["error"] = {
                    n: full_error[n] if full_error is not None else torch.zeros_like(p)
                    for n, p in zip(self._names, self._params)
                }
                like = self._params[0] if self._params else torch.empty(0)
                out["q"] = {
                    n: full_q[n] if full_q is not None else like.new_zeros(shape)
                    for n, shape in shapes.items()
                }
            return out
        if self._local is not None:
            assert self.averager is not None  # built together with the local SGD state
            return {
                "hook_iter": torch.tensor(self._local.iter, dtype=torch.int64),
                "averager_step": torch.tensor(self.averager.step, dtype=torch.int64),
            }
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._powersgd is not None:
            ps = self._powersgd
            ps.iter = int(state["iter"])
            pos, has_gauss = (int(v) for v in state["rng_pos"])
            ps.rng.set_state(
                (
                    "MT19937",
                    state["rng_keys"].numpy().astype("uint32"),
                    pos,
                    has_gauss,
                    float(state["rng_gauss"]),
                )
            )
            ps.error_dict.clear()
            ps.p_memory_dict.clear()
            ps.q_memory_dict.clear()
            self._layouts.clear()
            self._pending_error = self._pending_q = None
            if "error" in state and int(state["have_error"]):
                self._pending_error = {n: t.detach().clone() for n, t in state["error"].items()}
            if "q" in state and int(state["have_q"]):
                self._pending_q = {n: t.detach().clone() for n, t in state["q"].items()}
        elif self._local is not None:
            assert self.averager is not None  # built together with the local SGD state
            self._local.iter = int(state["hook_iter"])
            self.averager.step = int(state["averager_step"])


__all__ = ["GradientComm"]
