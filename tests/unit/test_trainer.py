"""The Trainer in one process (no process group): loop math, precision, clipping, evaluation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sdnet_trainer import HookBase, Trainer, compose
from sdnet_trainer.data import build_datasets
from tests.support import TINY, read_jsonl


def _train(tmp_path, overrides, cls=Trainer):
    trainer = cls(compose(TINY + overrides), output_dir=tmp_path)
    metrics = trainer.fit()
    return trainer, metrics


def _params(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_accumulation_equals_one_big_batch(tmp_path):
    common = ["loop.max_steps=4", "loop.global_batch_size=32", "loop.eval_at_end=false"]
    big, _ = _train(tmp_path / "a", common + ["loop.grad_accum_steps=1"])
    accum, _ = _train(tmp_path / "b", common + ["loop.grad_accum_steps=2"])
    assert accum.layout.micro_batch_size == 16 and big.layout.micro_batch_size == 32
    for name, value in _params(big).items():
        torch.testing.assert_close(_params(accum)[name], value, rtol=1e-4, atol=1e-6)


class _InfAtStep(Trainer):
    """Makes one gradient infinite on step 2 (as an fp16 overflow in backward would; the loss
    stays finite) and keeps a copy of the parameters before every step."""

    def train_step(self):
        self.before = [p.detach().clone() for p in self.model.parameters()]
        self.scale_before = self.precision.scaler.get_scale()
        out = super().train_step()
        if self.state.step == 2:
            self.at_inf = {
                "before": self.before,
                "after": [p.detach().clone() for p in self.model.parameters()],
                "scale_before": self.scale_before,
                "scale_after": self.precision.scaler.get_scale(),
            }
        return out

    def compute_loss(self, batch):
        loss = super().compute_loss(batch)
        if self.state.step == 2:
            loss.register_hook(lambda grad: grad * math.inf)
        return loss


def test_fp16_grad_scaler_skips_the_step_on_inf_gradients(tmp_path):
    trainer, _ = _train(
        tmp_path,
        [
            "precision=fp16",
            "loop.max_steps=4",
            "loop.eval_at_end=false",
            "optim.momentum=0.0",
            "optim.weight_decay=0.0",
        ],
        cls=_InfAtStep,
    )
    seen = trainer.at_inf
    for before, after in zip(seen["before"], seen["after"]):
        assert torch.equal(before, after)  # the overflowing step changed nothing
    assert seen["scale_after"] == seen["scale_before"] / 2
    assert trainer.state.skipped_steps == 1
    # The steps around it did train.
    assert not all(torch.equal(a, b) for a, b in zip(trainer.before, _params_list(trainer)))


def _params_list(trainer):
    return [p.detach() for p in trainer.model.parameters()]


class _RecordDtype(Trainer):
    def compute_loss(self, batch):
        inputs, targets = batch
        logits = self.model(inputs)
        self.logits_dtype = logits.dtype
        return self.criterion(logits, targets)


def test_bf16_autocast_runs_on_cpu(tmp_path):
    trainer, metrics = _train(tmp_path, ["precision=bf16", "loop.max_steps=3"], cls=_RecordDtype)
    assert trainer.logits_dtype == torch.bfloat16
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["val/loss"])
    assert next(trainer.model.parameters()).dtype == torch.float32  # master weights stay fp32


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_clip_by_norm_bounds_the_update(tmp_path, precision):
    # Plain SGD: the update is lr * clipped gradient, so its norm is lr * max_norm exactly. Under
    # fp16 this only holds if gradients are unscaled before clipping.
    lr, max_norm = 0.5, 1e-3
    overrides = [
        f"precision={precision}",
        "loop.max_steps=1",
        "loop.eval_at_end=false",
        f"optim.lr={lr}",
        "optim.momentum=0.0",
        "optim.weight_decay=0.0",
        f"optim.clip_grad_norm={max_norm}",
    ]
    trainer = Trainer(compose(TINY + overrides), output_dir=tmp_path)
    trainer.setup()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.data.start(trainer.state)
    out = trainer.train_step()
    delta = torch.cat(
        [(p.detach() - b).flatten() for p, b in zip(trainer.model.parameters(), before)]
    )
    assert out.grad_norm > 10 * max_norm  # clipping was active
    assert delta.norm().item() == pytest.approx(lr * max_norm, rel=1e-3)


def test_clip_by_value(tmp_path):
    lr, value = 1.0, 1e-4
    overrides = [
        "loop.max_steps=1",
        "loop.eval_at_end=false",
        f"optim.lr={lr}",
        "optim.momentum=0.0",
        "optim.weight_decay=0.0",
        f"optim.clip_grad_value={value}",
    ]
    trainer = Trainer(compose(TINY + overrides), output_dir=tmp_path)
    trainer.setup()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.data.start(trainer.state)
    trainer.train_step()
    delta = torch.cat(
        [(p.detach() - b).flatten() for p, b in zip(trainer.model.parameters(), before)]
    )
    assert delta.abs().max().item() == pytest.approx(lr * value, rel=1e-3)


def test_evaluate_matches_a_direct_computation(tmp_path):
    trainer, metrics = _train(tmp_path, ["loop.max_steps=5"])
    _, val_set = build_datasets(trainer.cfg.data)
    inputs = torch.stack([val_set[i][0] for i in range(len(val_set))])
    targets = torch.tensor([val_set[i][1] for i in range(len(val_set))])
    with torch.no_grad():
        logits = trainer.model.eval()(inputs)
    assert metrics["val/loss"] == pytest.approx(F.cross_entropy(logits, targets).item(), rel=1e-5)
    top1 = (logits.argmax(1) == targets).float().mean().item() * 100
    top5 = (logits.topk(5, 1).indices == targets[:, None]).any(1).float().mean().item() * 100
    assert (metrics["val/top1"], metrics["val/top5"]) == (pytest.approx(top1), pytest.approx(top5))


def test_max_epochs_and_what_gets_logged(tmp_path):
    trainer, metrics = _train(
        tmp_path,
        [
            "loop.max_steps=null",
            "loop.max_epochs=2",
            "loop.global_batch_size=64",
            "sched=cosine",
            "sched.warmup_steps=2",
            "loop.eval_at_epoch_end=true",
        ],
    )
    assert trainer.steps_per_epoch == 256 // 64 and trainer.state.step == trainer.total_steps == 8
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [2, 4, 6, 8]  # logging.log_every_n_steps=2
    # lr logged after step s is the schedule's value for step s: warmup, then cosine to 0.
    assert [r["train/lr"] for r in train_rows] == pytest.approx(
        [
            0.05,
            0.05 * 0.5 * (1 + math.cos(math.pi * 2 / 5)),
            0.05 * 0.5 * (1 + math.cos(math.pi * 4 / 5)),
            0.0,
        ]
    )
    assert all(r["train/grad_norm"] > 0 for r in train_rows)
    assert [r["step"] for r in rows if "val/loss" in r] == [4, 8]  # end of epoch 1, and the end
    assert metrics["summary/steps"] == 8


def test_deterministic_mode_repeats_bitwise(tmp_path):
    overrides = ["loop.max_steps=3", "loop.deterministic=true", "loop.eval_at_end=false"]
    try:
        first, _ = _train(tmp_path / "a", overrides)
        second, _ = _train(tmp_path / "b", overrides)
    finally:
        torch.use_deterministic_algorithms(False)
    for name, value in _params(first).items():
        assert torch.equal(_params(second)[name], value)


def test_imagefolder_data_through_the_trainer(tmp_path):
    from PIL import Image

    for split, per_class in (("train", 8), ("val", 3)):
        for label, color in enumerate([(255, 0, 0), (0, 0, 255)]):
            folder = tmp_path / "data" / split / f"class{label}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (20, 20), color).save(folder / f"{i}.png")
    _, metrics = _train(
        tmp_path / "run",
        [
            "data=imagefolder",
            f"data.root={tmp_path / 'data'}",
            "data.num_classes=2",
            "model.num_classes=2",
            "data.image_size=16",
            "data.num_workers=0",
            "loop.global_batch_size=4",
            "loop.max_steps=3",
        ],
    )
    assert 0.0 <= metrics["val/top1"] <= 100.0 and math.isfinite(metrics["val/loss"])


def test_progress_bar_only_on_rank0_and_a_terminal(monkeypatch):
    from sdnet_trainer.observability.progress import progress_enabled

    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    assert not progress_enabled("auto", is_main=True)  # logs and CI stay clean
    assert progress_enabled("on", is_main=True)
    assert not progress_enabled("on", is_main=False)
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert progress_enabled("auto", is_main=True) and not progress_enabled("off", is_main=True)


def test_rng_capture_and_restore_continue_every_stream():
    import random

    from sdnet_trainer.runtime import rng

    rng.reseed(7, rank=1, step=3)
    random.gauss(0, 1)  # leaves a cached value in Python's generator
    saved = rng.capture(torch.device("cpu"))
    expected = (torch.rand(4), random.random(), random.gauss(0, 1))
    rng.reseed(99, rank=0, step=0)
    rng.restore(saved, torch.device("cpu"))
    assert torch.equal(torch.rand(4), expected[0])
    assert (random.random(), random.gauss(0, 1)) == expected[1:]
    assert rng.derive_seed(7, rank=0, step=1) != rng.derive_seed(7, rank=1, step=0)


class _Recorder(HookBase):
    """A user hook: sees every step's state and result after the default hooks."""

    def __init__(self, events: list):
        self.events = events

    def before_train(self, state):
        self.events.append(("before", state.step))

    def after_step(self, state, result):
        self.events.append(("step", state.step, float(result.loss), result.nonfinite))

    def after_train(self, state):
        self.events.append(("after", state.step, dict(state.metrics)))

    def close(self):
        self.events.append(("close",))


class _WithRecorder(Trainer):
    def build_hooks(self):
        self.events: list = []
        return [*super().build_hooks(), _Recorder(self.events)]


def test_a_user_hook_runs_after_the_default_hooks_in_declared_order(tmp_path):
    trainer, metrics = _train(
        tmp_path, ["loop.max_steps=3", "logging.log_every_n_steps=1"], cls=_WithRecorder
    )
    names = [type(hook).__name__ for hook in trainer.hooks]
    assert names == [
        "EvalHook", "Checkpointer", "MetricsHook", "WatchdogHook", "HeartbeatHook", "_Recorder"
    ]  # fmt: skip
    events = trainer.events
    assert events[0] == ("before", 0) and events[-1] == ("close",)
    assert [e[1] for e in events if e[0] == "step"] == [1, 2, 3]
    # The step's loss is what MetricsHook logged for that step (one rank, one step per window).
    logged = [r["train/loss"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert [e[2] for e in events if e[0] == "step"] == pytest.approx(logged, rel=1e-6)
    after = events[-2]
    # after_train runs after the final evaluation and the summary: the run's metrics are in.
    assert after[0] == "after" and after[1] == 3 and after[2] == metrics
    assert "val/loss" in metrics and "summary/steps" in metrics


def test_each_checkpoint_save_is_reported_with_its_time_and_bytes(tmp_path):
    """checkpoint/save_seconds, checkpoint/bytes and checkpoint/step reach the metrics writer (and
    so metrics.jsonl, the trackers and the Prometheus exporter) at every save."""
    trainer = Trainer(
        compose(TINY + ["loop.max_steps=4", "checkpoint.every_n_steps=2"]), output_dir=tmp_path
    )
    trainer.fit()
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "checkpoint/step" in r]
    assert [(r["step"], r["checkpoint/step"]) for r in rows] == [(2, 2.0), (4, 4.0)]
    for row in rows:
        folder = tmp_path / "checkpoints" / f"step_{row['step']:08d}"
        written = sum(p.stat().st_size for p in folder.glob("*.distcp"))
        # The tensors' bytes; the files add headers and the small pickled entries.
        assert 0.8 * written <= row["checkpoint/bytes"] <= written
        assert 0 < row["checkpoint/save_seconds"] < 60


def test_a_failed_setup_releases_the_metrics_writer_and_its_port(tmp_path):
    """Set-up that fails after the writer exists (here: resuming from a path that holds no
    checkpoint) leaves no Prometheus server behind once the Trainer is closed."""
    import socket

    from tests.support import free_port

    port = free_port()
    overrides = [f"logging.prometheus.port={port}", f"checkpoint.resume={tmp_path / 'none'}"]
    trainer = Trainer(compose(TINY + overrides), output_dir=tmp_path)
    with pytest.raises(Exception, match="none"):
        trainer.setup()
    trainer.close()
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", port))  # free again
