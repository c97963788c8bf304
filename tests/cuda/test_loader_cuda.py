"""The input pipeline on a GPU: pinned uint8 batches copied on a side stream and normalized on
the device (equal to the CPU float path), loader workers by default, and data.decode=cuda
(nvjpeg). The CPU halves of these are proven in tests/unit/test_input_pipeline.py."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import default_collate

from sdnet_trainer.config.schema import AugmentConfig
from sdnet_trainer.data import BadSampleError, build_datasets
from sdnet_trainer.data.jpeg import collate_encoded
from sdnet_trainer.data.loader import RunData
from tests.support import assert_on_cuda
from tests.unit.test_input_pipeline import _cfg, _tree

pytestmark = pytest.mark.cuda

DEVICE = torch.device("cuda", 0)


class _Position:
    epoch = 0
    epoch_sample = 0


def _run_data(cfg, *, device: torch.device, channels_last: bool = False, **kwargs) -> RunData:
    train, val = build_datasets(cfg)
    return RunData(
        train,
        val,
        cfg=cfg,
        device=device,
        micro_batch_size=4,
        grad_accum_steps=1,
        eval_batch_size=4,
        dp_size=1,
        dp_rank=0,
        seed=5,
        channels_last=channels_last,
        **kwargs,
    )


def _epoch(data: RunData) -> list:
    data.start(_Position())
    try:
        batches = [data.next_batch() for _ in range(data.steps_per_epoch)]
        assert data.val_loader is not None
        return batches + [data.to_device(batch) for batch in data.val_loader]
    finally:
        data.close()


@pytest.mark.parametrize("channels_last", [False, True])
def test_uint8_batches_on_the_gpu_equal_the_cpu_float_path(tmp_path, channels_last):
    # num_workers null: on CUDA the loader gets worker processes by default.
    cfg = _cfg(_tree(tmp_path), num_workers=None)
    gpu = _run_data(cfg, device=DEVICE, channels_last=channels_last)
    assert gpu.train_loader.num_workers >= 1 and gpu.train_loader.pin_memory
    assert gpu.normalize is not None
    images, _ = next(iter(gpu.train_loader))
    assert images.dtype == torch.uint8 and images.is_pinned()
    cpu = _run_data(cfg, device=torch.device("cpu"), uint8_inputs=False)
    for (got_x, got_y), (want_x, want_y) in zip(_epoch(gpu), _epoch(cpu), strict=True):
        assert got_x.device.type == "cuda" and got_x.dtype == torch.float32
        torch.testing.assert_close(got_x.cpu(), want_x, rtol=0, atol=1e-6)
        assert torch.equal(got_y.cpu(), want_y)
        if channels_last:
            assert got_x.is_contiguous(memory_format=torch.channels_last)


def test_the_copy_runs_beside_queued_work_without_host_syncs(tmp_path):
    cfg = _cfg(_tree(tmp_path, per_class=16), num_workers=2, persistent_workers=True)
    data = _run_data(cfg, device=DEVICE)
    data.start(_Position())
    try:
        data.next_batch()  # workers started; the normalization's statistics on the device
        time.sleep(1.0)  # the workers prefetch the next batches
        compute = torch.cuda.current_stream(DEVICE)
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU work queued on the compute stream
        torch.cuda.set_sync_debug_mode("error")  # a synchronising copy would raise
        try:
            images, labels = data.next_batch()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        time.sleep(0.1)
        # The copy did not wait behind the compute stream's work: it ran on its own stream.
        assert data._copy_stream is not None and data._copy_stream.query()
        assert not compute.query()
        torch.cuda.synchronize()
        assert images.shape == (4, 3, 16, 16) and images.dtype == torch.float32
        assert_on_cuda(images, labels)
        assert torch.isfinite(images).all()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        data.close()


def test_decode_cuda_batches_match_the_cpu_decoder(tmp_path):
    root = _tree(tmp_path)
    cfg = _cfg(root, image_size=24, decode="cuda", num_workers=1, persistent_workers=False)
    data = _run_data(cfg, device=DEVICE, channels_last=True)
    assert data.decoder is not None
    batches = _epoch(data)
    for images, labels in batches:
        assert images.device.type == "cuda" and images.shape == (4, 3, 24, 24)
        assert images.is_contiguous(memory_format=torch.channels_last)
        assert labels.device.type == "cuda"
    # nvjpeg against torchvision's CPU decoder on the same validation files and crops.
    _, val = build_datasets(cfg)
    batch, _ = collate_encoded([val[i] for i in range(len(val))])
    on_gpu = data.decoder(batch, DEVICE).cpu()
    on_cpu = data.decoder(batch, torch.device("cpu"))
    assert (on_gpu - on_cpu).abs().mean() < 0.05
    # And against the PIL float path: the same center crops, resampled differently.
    _, pil_val = build_datasets(_cfg(root, image_size=24, augment=AugmentConfig(preset="imagenet")))
    expected = default_collate([pil_val[i] for i in range(len(pil_val))])[0]
    assert (on_gpu - expected).abs().mean() < 0.1


def test_decode_cuda_names_a_file_nvjpeg_cannot_decode(tmp_path):
    train, _ = build_datasets(_cfg(_tree(tmp_path), decode="cuda"))
    samples = [train[i][0] for i in range(3)]
    # The intact files decode on the GPU; then one of them is cut short.
    intact, _ = collate_encoded([(s, 0) for s in samples])
    assert_on_cuda(train.device_decoder(intact, DEVICE))
    broken = samples[1]
    broken.data = torch.cat([broken.data[:200], torch.zeros(50, dtype=torch.uint8)])
    batch, _ = collate_encoded([(s, 0) for s in samples])
    with pytest.raises(BadSampleError) as err:
        train.device_decoder(batch, DEVICE)
    assert broken.path in str(err.value) and "data.decode=cpu" in str(err.value)
