"""Rank and world size for processes that a scheduler started itself, without torchrun.

torchrun hands every worker RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT, and ``distributed_session`` reads exactly those. Hydra's submitit launcher instead
starts one process per task (``srun`` on SLURM, subprocesses for its local executor), and the same
facts arrive under SLURM_* or SUBMITIT_LOCAL_* names. ``export_scheduler_env`` copies them to
torchrun's names, so both launches share one code path.

It acts only where every task is known to run this code:

- RANK is unset, so never under torchrun (``srun torchrun`` included: torchrun sets RANK);
- more than one task, so never for a single ``python -m sdnet_trainer`` in an allocation;
- a submitit job (submitit exports SUBMITIT_EXECUTOR) or the explicit opt-in
  ``SDNET_SLURM_TASKS=1`` for ``srun python -m sdnet_trainer``. A batch script that runs the
  trainer once inside a multi-task allocation has the same SLURM_* variables, and would otherwise
  wait for peers that never come.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

from sdnet_trainer.errors import ConfigError

OPT_IN = "SDNET_SLURM_TASKS"

# Ports derived from the job id stay below Linux's ephemeral range (32768+), where the kernel
# hands out client ports, and above the well-known and common service ports.
_PORT_BASE = 15000
_PORT_SPAN = 10000

_SLURM_REQUIRED = (
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID",
)
_LOCAL_REQUIRED = (
    "SUBMITIT_LOCAL_GLOBALID",
    "SUBMITIT_LOCAL_NTASKS",
    "SUBMITIT_LOCAL_LOCALID",
    "SUBMITIT_LOCAL_JOB_ID",
)


def export_scheduler_env(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Fill torchrun's variables from the scheduler's; returns the scheduler's name, or None when
    this is not a multi-task launch without torchrun (then nothing changes).

    Variables the user already set (MASTER_ADDR, MASTER_PORT, SDNET_RUN_ID) are kept.
    """
    environ = os.environ if environ is None else environ
    if "RANK" in environ:
        return None
    executor = environ.get("SUBMITIT_EXECUTOR")
    if executor == "local" and all(k in environ for k in _LOCAL_REQUIRED):
        source, ntasks_key, derive = "submitit-local", "SUBMITIT_LOCAL_NTASKS", _from_submitit_local
    elif (executor == "slurm" or environ.get(OPT_IN) == "1") and all(
        k in environ for k in _SLURM_REQUIRED
    ):
        source, ntasks_key, derive = "slurm", "SLURM_NTASKS", _from_slurm
    else:
        return None
    if _int(environ, ntasks_key) < 2:
        return None
    values = derive(environ)
    environ.update(values)
    return source


def _from_slurm(environ: MutableMapping[str, str]) -> dict[str, str]:
    # A job step may span fewer nodes than the job; the step's own lists describe the tasks.
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"]
    values = {
        "RANK": str(_int(environ, "SLURM_PROCID")),
        "WORLD_SIZE": str(_int(environ, "SLURM_NTASKS")),
        "LOCAL_RANK": str(_int(environ, "SLURM_LOCALID")),
        # Task 0 runs on the first node of the step, so that node hosts the rendezvous.
        "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(nodelist),
        "MASTER_PORT": environ.get("MASTER_PORT") or str(port_for_job(environ["SLURM_JOB_ID"])),
        # Every task composes the config itself: the job id gives them one run directory.
        "SDNET_RUN_ID": environ.get("SDNET_RUN_ID") or environ["SLURM_JOB_ID"],
    }
    local = _local_world_size(environ)
    if local is not None:
        values["LOCAL_WORLD_SIZE"] = str(local)
    return values


def _from_submitit_local(environ: MutableMapping[str, str]) -> dict[str, str]:
    # submitit's local executor runs all tasks of a job on this machine; its job id is the
    # controller's pid, unique while the job runs.
    ntasks = _int(environ, "SUBMITIT_LOCAL_NTASKS")
    return {
        "RANK": str(_int(environ, "SUBMITIT_LOCAL_GLOBALID")),
        "WORLD_SIZE": str(ntasks),
        "LOCAL_RANK": str(_int(environ, "SUBMITIT_LOCAL_LOCALID")),
        "LOCAL_WORLD_SIZE": str(ntasks),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or "127.0.0.1",
        "MASTER_PORT": environ.get("MASTER_PORT")
        or str(port_for_job(environ["SUBMITIT_LOCAL_JOB_ID"])),
        "SDNET_RUN_ID": environ.get("SDNET_RUN_ID") or environ["SUBMITIT_LOCAL_JOB_ID"],
    }


def port_for_job(job_id: str) -> int:
    """A rendezvous port every task of one job derives alike, and that differs between jobs
    sharing a node (unless their ids differ by a multiple of 10000)."""
    digits = re.sub(r"\D", "", job_id)  # array tasks may read "1234_5"
    if not digits:
        raise ConfigError(
            f"job id {job_id!r} has no digits to derive a rendezvous port from; set MASTER_PORT"
        )
    return _PORT_BASE + int(digits) % _PORT_SPAN


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[003-004,010],cpu1`` -> ``gpu003``.

    The same host ``scontrol show hostnames`` prints first, without needing scontrol. Each
    bracket group contributes its first value, zero padding kept (``r[1-2]n[08-09]`` -> ``r1n08``).
    """
    first = _split_top_level(nodelist.strip())[0]
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], first)
    if not host or "[" in host or "]" in host:
        raise ConfigError(
            f"SLURM node list {nodelist!r} cannot be parsed; set MASTER_ADDR to the first node"
        )
    return host


def tasks_per_node(spec: str) -> list[int]:
    """SLURM's compressed task counts per node: ``4(x2),3`` -> ``[4, 4, 3]``."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(spec)
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _local_world_size(environ: MutableMapping[str, str]) -> int | None:
    """Tasks on this node, where SLURM says; None where it does not (nothing here needs it)."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    node = environ.get("SLURM_NODEID")
    if spec and node is not None:
        try:
            return tasks_per_node(spec)[int(node)]
        except (ValueError, IndexError):
            pass
    per_node = environ.get("SLURM_NTASKS_PER_NODE")
    return int(per_node) if per_node and per_node.isdigit() else None


def _split_top_level(nodelist: str) -> list[str]:
    """Split at the commas that separate hosts, not at those inside ``[...]``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    parts.append(nodelist[start:])
    return parts


def _int(environ: MutableMapping[str, str], key: str) -> int:
    try:
        return int(environ[key])
    except ValueError:
        raise ConfigError(f"{key}={environ[key]!r} is not an integer") from None
