"""Fault tolerance's costs: per-step overhead against plain DDP, and how fast a failure heals.

What it measures
    1. Overhead: the median step time (``perf/step_s``, steps from the 5th on) of 2 replica
       groups of 1 process each under ``fault_tolerance.mode=sync`` (quorum, gradients averaged
       through torchft's gloo process group, commit vote) against plain DDP on 2 processes
       (torchrun) over the same global batch and model, in alternating rounds (DDP, FT, DDP, FT,
       ...), so a change in the machine's load hits both; the ratio of each round and their
       median.
    2. Failure: a lighthouse and 3 groups of ``--group-ranks`` processes (1, or 2 under
       torchrun with FSDP2 inside: HSDP across the groups) training the quickstart model
       (``simple_cnn``), with ``fault_tolerance.timeouts.step_s`` at ``--step-s`` (120 s).
       Group 2's whole launch (torchrun and its workers at once) is SIGKILLed at an arbitrary
       moment, once every group has committed ``--kill-after`` more steps, then relaunched;
       ``--kills`` times. Per kill: death to next commit, from the kill to the first step the
       survivors commit in a quorum formed after it (what bounds it: the lighthouse's heartbeat
       timeout, 2 s, plus one step; a survivor stuck in a collective with the dead group would
       add up to ``step_s``), and restart to rejoin, from the relaunch to its first committed
       step after receiving the state from a peer. Printed as distributions: median, 95th
       percentile, max.

    3. The replica reduction alone (``--reduction-rounds``): ``reduce_in_buckets``
       (sdnet_trainer/ft/room.py) over 2 processes on gloo, ResNet-18's gradient shapes (11.2M
       float32 values, 45 MB), flat (one bucket holding every gradient: the reduction before
       buckets) against buckets of ``--bucket-mb``, in alternating rounds of 5 steps; the median
       per-step time of each and the extra memory each allocates.

How
    Real launches of the command line on gloo and the CPU (``OMP_NUM_THREADS=1``), the lighthouse
    as ``python -m sdnet_trainer.ft.lighthouse`` on a free port. Times of events are read from
    the launches' logs (timestamps to the millisecond, the same clock as this driver's).

    Default workload of the overhead: ResNet-18 with the CIFAR stem (``model=resnet18_cifar``,
    11.2M parameters) on 32x32 synthetic images, 16 per group (per DDP rank), SGD with momentum.

Run (from the repository root)
    python scripts/bench/bench_ft.py
    python scripts/bench/bench_ft.py --rounds 0 --kills 20 --kill-after 5
    python scripts/bench/bench_ft.py --rounds 0 --kills 20 --kill-after 5 --group-ranks 2
    python scripts/bench/bench_ft.py --rounds 0 --kills 0 --reduction-rounds 6

Exit status 0 with the figures printed; 1 if a launch fails or times out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from _launch import REPO, LaunchError, load_line, run_launch, torchrun

COMMON = [
    "dist.device=cpu",
    "data.val_size=16",
    "sched=constant",
    "optim.momentum=0.9",
    "optim.lr=0.05",
    "loop.eval_at_epoch_end=false",
    "logging.log_every_n_steps=1",
    "logging.trackers=[jsonl]",
    "logging.flops=false",
    "checkpoint.save_on_exit=false",
]
OVERHEAD = ["model=resnet18_cifar", "data.image_size=32", "data.train_size=2048"]
FAILURE = [
    "model=simple_cnn",
    "data.image_size=16",
    "data.train_size=4096",
    "loop.global_batch_size=24",  # divisible among 1, 2 or 3 groups
    "loop.max_steps=100000",
]
LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")
STARTUP_TIMEOUT_S = 240.0


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        return subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _wait(condition, *, timeout: float, what: str, running: list | None = None) -> None:
    """Until ``condition()``; a LaunchError after ``timeout`` or when a ``running`` one exits."""
    deadline = time.monotonic() + timeout
    while not condition():
        for proc in running or []:
            if proc.poll() is not None:
                raise LaunchError(f"a launch exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise LaunchError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def _lighthouse(out: Path, *, min_groups: int) -> tuple[subprocess.Popen, str]:
    """The lighthouse; ``min_groups`` keeps the first quorum from forming before every group
    is up (a group alone would train the whole global batch)."""
    log = out / "lighthouse.log"
    cmd = [sys.executable, "-m", "sdnet_trainer.ft.lighthouse", "--bind", "[::]:0"]
    proc = _start([*cmd, "--min-groups", str(min_groups)], log)
    _wait(lambda: "lighthouse at" in log.read_text(), timeout=120, what="the lighthouse")
    found = re.search(r"lighthouse at (\S+)", log.read_text())
    assert found is not None
    return proc, found[1]


def _ft_keys(address: str, *, groups: int, group: int) -> list[str]:
    return [
        "fault_tolerance.enabled=true",
        f"fault_tolerance.lighthouse={address}",
        f"fault_tolerance.groups={groups}",
        f"fault_tolerance.replica_group={group}",
    ]


def _median_step(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [row["perf/step_s"] for row in rows if "perf/step_s" in row and row["step"] >= 5]
    return statistics.median(times)


def _cmd(args: list[str], run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "sdnet_trainer", *args, f"hydra.run.dir={run_dir}"]


def overhead(out: Path, *, rounds: int, steps: int, batch: int, timeout: float) -> list[float]:
    """Alternating rounds of DDP (2 processes) and FT (2 groups of 1 process)."""
    work = [*COMMON, *OVERHEAD, f"loop.max_steps={steps}", f"loop.global_batch_size={2 * batch}"]
    ratios = []
    for r in range(rounds):
        ddp_dir = out / f"ddp{r}"
        run_launch(
            torchrun(2, "-m", "sdnet_trainer", *work, f"hydra.run.dir={ddp_dir}"),
            out / f"ddp{r}.log",
            timeout,
        )
        lighthouse, address = _lighthouse(out, min_groups=2)
        dirs = [out / f"ft{r}_g{g}" for g in range(2)]
        procs = [
            _start(_cmd([*work, *_ft_keys(address, groups=2, group=g)], d), out / f"{d.name}.log")
            for g, d in enumerate(dirs)
        ]
        try:
            for proc, d in zip(procs, dirs, strict=True):
                if proc.wait(timeout=timeout) != 0:
                    raise LaunchError(f"{d.name} failed (see {out / d.name}.log)")
        finally:
            for proc in [*procs, lighthouse]:
                _stop(proc)
        ddp = _median_step(ddp_dir)
        ft = max(_median_step(d) for d in dirs)
        ratios.append(ft / ddp)
        print(
            f"round {r + 1}: DDP {ddp * 1e3:.1f} ms/step, FT {ft * 1e3:.1f} ms/step, "
            f"ratio {ft / ddp:.3f}"
        )
    return ratios


def _log_times(log: Path, pattern: str) -> list[float]:
    """Unix times of the log lines that match ``pattern``."""
    times = []
    for line in log.read_text(errors="replace").splitlines():
        stamp = LOG_TIME.match(line)
        if stamp and re.search(pattern, line):
            moment = datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S,%f")
            times.append(moment.timestamp())
    return times


def _committed(log: Path) -> int:
    return len(_log_times(log, r"should_commit=True"))


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun starts its workers in sessions of their own, so a
    signal to the launch's process group does not reach them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the whole launch at once, as when its node is lost."""
    for pid in _tree(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _next_commit(log: Path, after: float) -> float | None:
    """The first step ``log``'s group committed in a quorum formed after ``after``."""
    reconfigured = [t for t in _log_times(log, r"reconfiguring for quorum_id") if t > after]
    if not reconfigured:
        return None
    commits = [t for t in _log_times(log, r"should_commit=True") if t > reconfigured[0]]
    return commits[0] if commits else None


def _percentile(values: list[float], q: float) -> float:
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, max(0, round(q * (len(ranked) - 1))))]


def failure(
    out: Path, *, kill_after: int, kills: int, ranks: int, step_s: float
) -> tuple[list[float], list[float]]:
    """Kill group 2's launch ``kills`` times, each once every live group has committed
    ``kill_after`` more steps, and relaunch it; (death to the survivors' next commit, restart to
    rejoin) seconds, one per kill. Groups of ``ranks`` processes (2: torchrun with FSDP2 inside,
    HSDP across the groups)."""
    lighthouse, address = _lighthouse(out, min_groups=2)
    inside = ["parallel=fsdp"] if ranks > 1 else []
    # A quorum waits out a slow step (the config check): quorum_s >= step_s.
    t = "fault_tolerance.timeouts"
    timeouts = [f"{t}.step_s={step_s}", f"{t}.quorum_s={max(60.0, step_s + 30)}"]

    def launch(group: int, name: str) -> subprocess.Popen:
        args = [*COMMON, *FAILURE, *inside, *timeouts, *_ft_keys(address, groups=3, group=group)]
        cmd = _cmd(args, out / name)
        if ranks > 1:
            cmd = torchrun(ranks, *cmd[1:])
        return _start(cmd, out / f"{name}.log")

    logs = [out / f"group{g}.log" for g in range(3)]
    procs = [launch(g, f"group{g}") for g in range(3)]
    deaths, rejoins = [], []
    try:
        for k in range(kills):
            marks = [_committed(log) for log in logs]
            _wait(
                lambda marks=marks: all(
                    _committed(log) >= m + kill_after for log, m in zip(logs, marks, strict=True)
                ),
                timeout=STARTUP_TIMEOUT_S,
                what=f"{kill_after} more committed steps in every group",
                running=procs,
            )
            _kill_tree(procs[2])
            killed = time.time()

            _wait(
                lambda killed=killed: all(_next_commit(log, killed) for log in logs[:2]),
                timeout=step_s + 60,
                what="the survivors' next commit",
                running=procs[:2],
            )
            deaths.append(max(_next_commit(log, killed) or 0.0 for log in logs[:2]) - killed)
            logs[2] = out / f"group2_rejoin{k}.log"
            restarted = time.time()
            procs[2] = launch(2, f"group2_rejoin{k}")
            _wait(
                lambda: _committed(logs[2]) >= 1,
                timeout=STARTUP_TIMEOUT_S,
                what="the rejoin",
                running=procs,
            )
            rejoins.append(_log_times(logs[2], r"should_commit=True")[0] - restarted)
            print(
                f"kill {k + 1}/{kills}: death to next commit {deaths[-1]:.2f} s, restart to "
                f"rejoin {rejoins[-1]:.2f} s",
                flush=True,
            )
        return deaths, rejoins
    finally:
        for proc in [*procs, lighthouse]:
            if proc.poll() is None:
                _kill_tree(proc)


def _resnet18_gradients() -> list[int]:
    """ResNet-18's (CIFAR stem, 10 classes) parameter sizes, in order: each conv and its norm's
    weight and bias."""
    sizes = [64 * 3 * 9, 64, 64]
    for cin, cout in ((64, 64), (64, 128), (128, 256), (256, 512)):
        sizes += [cout * cin * 9, cout, cout, cout * cout * 9, cout, cout]
        if cin != cout:  # the downsampling shortcut
            sizes += [cout * cin, cout, cout]
        sizes += [cout * cout * 9, cout, cout] * 2
    return [*sizes, 512 * 10, 10]


def _reduction_worker(rank: int, port: int, rounds: int, bucket_mb: float, results) -> None:
    import torch
    import torch.distributed as dist

    from sdnet_trainer.ft.room import reduce_in_buckets

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    grads = [torch.randn(n) for n in _resnet18_gradients()]
    modes = {"flat": 2**62, "buckets": int(bucket_mb * 2**20)}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(rounds):
        for mode, bucket_bytes in modes.items():  # alternated: a change of load hits both
            for _ in range(5):
                dist.barrier()
                started = time.perf_counter()
                reduce_in_buckets(grads, lambda t: dist.all_reduce(t, async_op=True),
                                  bucket_bytes=bucket_bytes)  # fmt: skip
                times[mode].append(time.perf_counter() - started)
    if rank == 0:
        results.put(times)
    dist.destroy_process_group()


def reduction(*, rounds: int, bucket_mb: float) -> dict[str, list[float]]:
    """Per-step times of the flat and the bucketed replica reduction (2 gloo processes)."""
    import socket

    import torch.multiprocessing as mp

    if rounds <= 0:
        return {}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_reduction_worker, args=(port, rounds, bucket_mb, results), nprocs=2,
                       start_method="spawn")  # fmt: skip
    return results.get()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternating DDP/FT rounds (0: skip the overhead)"
    )
    parser.add_argument("--steps", type=int, default=12, help="steps per overhead run")
    parser.add_argument("--batch-size", type=int, default=16, help="per group (per DDP rank)")
    parser.add_argument(
        "--kill-after", type=int, default=30, help="committed steps before the kill"
    )
    parser.add_argument("--kills", type=int, default=5, help="kills of group 2, each relaunched")
    parser.add_argument(
        "--group-ranks", type=int, default=1, help="processes per group (2: FSDP2 inside)"
    )
    parser.add_argument(
        "--step-s", type=float, default=120.0, help="fault_tolerance.timeouts.step_s"
    )
    parser.add_argument(
        "--reduction-rounds", type=int, default=0, help="flat/bucketed rounds (0: skip them)"
    )
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="the bucketed reduction's")
    parser.add_argument("--timeout", type=float, default=600.0, help="per launch, seconds")
    parser.add_argument(
        "--out", type=Path, default=None, help="run folders and logs (default: a temporary folder)"
    )
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_ft_"))
    out.mkdir(parents=True, exist_ok=True)
    # SIGTERM (a timeout's) unwinds like an error, so the launches are killed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    before = os.getloadavg()
    try:
        reductions = reduction(rounds=args.reduction_rounds, bucket_mb=args.bucket_mb)
        ratios = overhead(
            out, rounds=args.rounds, steps=args.steps, batch=args.batch_size, timeout=args.timeout
        )
        deaths, rejoins = (
            ([], [])
            if args.kills <= 0
            else failure(
                out,
                kill_after=args.kill_after,
                kills=args.kills,
                ranks=args.group_ranks,
                step_s=args.step_s,
            )
        )
    except LaunchError as err:
        print(f"bench_ft: {err}", file=sys.stderr)
        return 1
    if ratios:
        print(
            f"per-step overhead, FT sync (2 groups x 1) / DDP (2 ranks), ResNet-18: median "
            f"ratio {statistics.median(ratios):.3f} over {len(ratios)} rounds"
        )
    if reductions:
        total = sum(_resnet18_gradients()) * 4
        extra = {"flat": total, "buckets": min(total, int(args.bucket_mb * 2**20))}
        for mode, values in reductions.items():
            print(
                f"replica reduction, {mode} ({extra[mode] / 2**20:.1f} MB extra), 2 gloo "
                f"processes, ResNet-18's gradients ({total / 2**20:.1f} MB): median "
                f"{statistics.median(values) * 1e3:.1f} ms per step over {len(values)} steps"
            )
    for what, values in (("death to the survivors' next commit", deaths),
                         ("restart to rejoin", rejoins)):  # fmt: skip
        if not values:
            continue
        print(
            f"{what} ({len(values)} kills, groups of {args.group_ranks}, step_s {args.step_s:g} "
            f"s): median {statistics.median(values):.2f} s, p95 {_percentile(values, 0.95):.2f} "
            f"s, max {max(values):.2f} s"
        )
    print(load_line(before, os.getloadavg()))
    print(f"logs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
