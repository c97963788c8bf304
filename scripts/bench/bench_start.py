"""How soon the GPU check's decoder launches reach their first step, on the CPU: this tree against
another commit of the project, side by side.

    python scripts/bench/bench_start.py --base REF [--rounds 2] [--launch gpt_1b --launch llama3_1b]

What it measures
    For each decoder launch of ``bench_gpu.py --quick`` (``gpt_1b``, ``llama3_1b``: their keys
    from ``bench_gpu.planned_launches``, with ``dist.device=cpu``), the wall time of the
    Trainer's ``setup()`` in a fresh process (the data, the model built, parallelized and
    initialised, the optimizer; its first step starts right after), and within it the time of
    the model's initialisation (``models/init.py``'s ``materialize``, the call a start spends
    most of its time in). One process per run, one thread per process pair alternated.

How
    ``--base REF`` is checked out into a temporary git worktree; a run imports the project
    from there or from this tree (``PYTHONPATH``; the worker, ``_start_worker.py``, uses only
    ``compose``, ``Trainer`` and ``setup``, which both keep). Rounds alternate the trees, first
    one then the other, the order swapped every round; the medians per tree are printed with the
    machine's load average before and after. Torch's intra-op threads are the machine's, as a
    user's single-process run gets them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

from _launch import load_line  # noqa: E402
from bench_gpu import planned_launches  # noqa: E402

DECODERS = ("gpt_1b", "llama3_1b")


def launch_keys(name: str) -> list[str]:
    """The keys of ``bench_gpu.py --quick``'s launch ``name``, on the CPU."""
    for launch in planned_launches(["--quick"]):
        if launch.name == name:
            return [("dist.device=cpu" if k == "dist.device=cuda" else k) for k in launch.keys]
    raise SystemExit(f"bench_gpu.py --quick has no launch {name!r}")


def run_once(tree: Path, keys: list[str], timeout: float) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run(
            [sys.executable, str(HERE / "_start_worker.py"), out, *keys],
            env=env,
            cwd=out,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    if proc.returncode != 0:
        raise SystemExit(f"a run in {tree} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    if Path(str(result.pop("package"))).resolve().parents[0] != tree.resolve():
        raise SystemExit(f"the run meant for {tree} imported another copy of the project")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the git commit to compare against")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--launch", action="append", choices=DECODERS)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    launches = args.launch or list(DECODERS)
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch) / "base"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), args.base],
            check=True,
            capture_output=True,
        )
        try:
            trees = {"this tree": REPO, f"base {args.base}": base}
            before = os.getloadavg()
            results: dict[tuple[str, str], list[dict[str, float]]] = {}
            for name in launches:
                keys = launch_keys(name)
                for round_ in range(args.rounds):
                    order = list(trees.items())
                    for label, tree in order if round_ % 2 == 0 else order[::-1]:
                        result = run_once(tree, keys, args.timeout)
                        results.setdefault((name, label), []).append(result)
                        print(f"{name} {label} round {round_ + 1}: {result}", flush=True)
            after = os.getloadavg()
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)],
                check=False,
                capture_output=True,
            )
    print()
    print("| launch | tree | setup s (median) | of which initialisation s | runs |")
    print("| --- | --- | --- | --- | --- |")
    for (name, label), runs in results.items():
        setup = statistics.median(r["setup_s"] for r in runs)
        init = statistics.median(r["init_s"] for r in runs)
        print(f"| {name} | {label} | {setup:.1f} | {init:.1f} | {len(runs)} |")
    print()
    print(load_line(before, after))


if __name__ == "__main__":
    main()
