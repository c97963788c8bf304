"""The torch releases this project runs on, and the one place that knows how they differ.

pyproject.toml declares ``torch>=2.11`` (the oldest torch GPU images of today ship). Every torch
API the project calls exists in 2.11 under the same name (checked against 2.11's sources); what
differs between 2.11 and later releases is behaviour, asked for here by name rather than by
scattered version tests:

- ``reusable_stager()``: whether one DCP ``DefaultStager`` can stage many saves;
- ``local_stage_handoff()``: whether two pipeline stages of one rank pass tensors locally, which
  the V schedules (ZBVZeroBubble, DualPipeV) need;
- ``pipeline_keeps_buffers()``: whether the pipeline's shape inference leaves buffers (BatchNorm's
  running statistics) as they were.

torch 2.11's ``FileSystemWriter.finish`` also leaves the metadata ``dcp.save`` returns without its
storage map; the checkpoint manager's writer fills it in whatever the release, so no version is
asked there (tests/unit/test_torch_compat.py simulates each of these behaviours).
"""

from __future__ import annotations

import re

import torch

# (major, minor) of the oldest torch the project supports; pyproject.toml says the same.
TORCH_MIN = (2, 11)
# DefaultStager.stage stops closing its StateDictStager after every copy (torch 2.13).
REUSABLE_STAGER_SINCE = (2, 13)
# PipelineStage passes tensors between stages of the same rank without a send (torch 2.12).
LOCAL_STAGE_HANDOFF_SINCE = (2, 12)
# PipelineStage restores the buffers its shape-inference forward changed (torch 2.14).
PIPELINE_KEEPS_BUFFERS_SINCE = (2, 14)


def torch_release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the torch imported), whatever local suffix or
    pre-release tag follows (``2.11.0+cu130``, ``2.13.0a0+git1234``)."""
    text = torch.__version__ if version is None else version
    match = re.match(r"(\d+)\.(\d+)", str(text))
    if match is None:
        raise ValueError(f"cannot read a torch release from {text!r}")
    return int(match[1]), int(match[2])


def check_torch(version: str | None = None) -> None:
    """Raise a one-line RuntimeError naming the torch this project needs when ``version``
    (default: the torch imported) is older than ``TORCH_MIN``."""
    release = torch_release(version)
    if release < TORCH_MIN:
        need = ".".join(map(str, TORCH_MIN))
        have = torch.__version__ if version is None else version
        raise RuntimeError(f"sdnet_trainer needs torch>={need}; this Python has torch {have}")


def reusable_stager() -> bool:
    """Whether one DCP ``DefaultStager`` serves every async save of a run, keeping its host
    copy of each tensor from one save to the next (torch >= 2.13). In torch 2.11 and 2.12,
    ``DefaultStager.stage`` closes its ``StateDictStager`` after each copy, which drops the cached
    host buffers and empties its table of copiers, so a second ``stage`` fails with
    ``KeyError: <class 'type'>``: there each save takes a stager of its own."""
    return torch_release() >= REUSABLE_STAGER_SINCE


def local_stage_handoff() -> bool:
    """Whether torch's pipeline stages hand activations and gradients to a neighbouring stage held
    by the same rank directly (torch >= 2.12). torch 2.11 sends them through the process group to
    the rank itself, which gloo refuses ("Pair is not connected") at the first step of a V
    schedule, where each rank holds two adjacent stages (ZBVZeroBubble, DualPipeV)."""
    return torch_release() >= LOCAL_STAGE_HANDOFF_SINCE


def pipeline_keeps_buffers() -> bool:
    """Whether torch's pipeline stages restore the buffers that their shape inference changed
    (torch >= 2.14). Before that, the real forward each stage runs to learn its shapes, in training
    mode before the first micro-batch, updates BatchNorm's running statistics once more than a
    single process does (seen on torch 2.11: the weights train the same, the evaluation differs)."""
    return torch_release() >= PIPELINE_KEEPS_BUFFERS_SINCE
