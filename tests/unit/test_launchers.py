"""Launch paths that need no cluster to check: scheduler variables mapped to torchrun's, the SLURM
batch script's torchrun command (with stub srun/scontrol), the Kubernetes manifest, and the sweep
summary helpers."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from sdnet_trainer.distributed.launchers import (
    export_scheduler_env,
    first_host,
    port_for_job,
    tasks_per_node,
)
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.sweep import (
    Trial,
    final_metrics,
    override_value,
    summary_table,
    torchrun_command,
    write_summary,
    write_trial,
)
from sdnet_trainer.sweep import main as sweep_main
from tests.support import REPO

SBATCH = REPO / "deploy" / "slurm" / "train.sbatch"
PYTORCHJOB = REPO / "deploy" / "k8s" / "pytorchjob.yaml"

# What one task of a 2-node x 4-task submitit job sees (the third task: node 1, local rank 0).
SUBMITIT_SLURM = {
    "SUBMITIT_EXECUTOR": "slurm",
    "SLURM_JOB_ID": "73512",
    "SLURM_PROCID": "4",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[017-018]",
    "SLURM_TASKS_PER_NODE": "4(x2)",
}


# --- scheduler variables -> torchrun's -------------------------------------------------------


def test_submitit_slurm_task_gets_torchrun_variables():
    env = dict(SUBMITIT_SLURM)
    assert export_scheduler_env(env) == "slurm"
    assert {
        k: env[k]
        for k in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "SDNET_RUN_ID",
        )
    } == {
        "RANK": "4",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu017",
        "MASTER_PORT": str(15000 + 73512 % 10000),
        "SDNET_RUN_ID": "73512",
    }


def test_every_task_of_a_job_agrees_on_the_rendezvous():
    seen = set()
    for rank in range(8):
        env = {
            **SUBMITIT_SLURM,
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % 4),
            "SLURM_NODEID": str(rank // 4),
        }
        export_scheduler_env(env)
        seen.add((env["MASTER_ADDR"], env["MASTER_PORT"], env["WORLD_SIZE"], env["SDNET_RUN_ID"]))
    assert len(seen) == 1


@pytest.mark.parametrize(
    "change",
    [
        {"RANK": "0"},  # under torchrun (also `srun torchrun`): torchrun's values stand
        {"SLURM_NTASKS": "1"},  # one task: a single process, no process group
        {"SUBMITIT_EXECUTOR": None},  # a plain SLURM allocation: maybe a batch script running once
        {"SLURM_JOB_NODELIST": None},
    ],
)
def test_left_alone_where_not_every_task_runs_the_trainer(change):
    env = {k: v for k, v in {**SUBMITIT_SLURM, **change}.items() if v is not None}
    before = dict(env)
    assert export_scheduler_env(env) is None
    assert env == before


def test_plain_srun_needs_the_opt_in():
    env = {k: v for k, v in SUBMITIT_SLURM.items() if k != "SUBMITIT_EXECUTOR"}
    assert export_scheduler_env(dict(env)) is None
    env["SDNET_SLURM_TASKS"] = "1"
    assert export_scheduler_env(env) == "slurm" and env["RANK"] == "4"


def test_values_the_user_set_are_kept():
    env = {
        **SUBMITIT_SLURM,
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "29511",
        "SDNET_RUN_ID": "mine",
        "SLURM_JOB_NODELIST": "not[a-list",
    }  # unparseable, but MASTER_ADDR makes it unneeded
    export_scheduler_env(env)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["SDNET_RUN_ID"]) == (
        "10.0.0.7",
        "29511",
        "mine",
    )


def test_submitit_local_executor_tasks():
    env = {
        "SUBMITIT_EXECUTOR": "local",
        "SUBMITIT_LOCAL_JOB_ID": "4321",
        "SUBMITIT_LOCAL_NTASKS": "2",
        "SUBMITIT_LOCAL_GLOBALID": "1",
        "SUBMITIT_LOCAL_LOCALID": "1",
    }
    assert export_scheduler_env(env) == "submitit-local"
    assert (
        env["RANK"],
        env["WORLD_SIZE"],
        env["LOCAL_RANK"],
        env["MASTER_ADDR"],
        env["MASTER_PORT"],
    ) == ("1", "2", "1", "127.0.0.1", str(15000 + 4321))


def test_bad_scheduler_values_name_the_variable():
    with pytest.raises(ConfigError, match="SLURM_PROCID='x'"):
        export_scheduler_env({**SUBMITIT_SLURM, "SLURM_PROCID": "x"})
    with pytest.raises(ConfigError, match="node list 'gpu\\[01'"):
        export_scheduler_env({**SUBMITIT_SLURM, "SLURM_JOB_NODELIST": "gpu[01"})


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node7", "node7"),
        ("gpu[003-004,010],cpu1", "gpu003"),
        ("cpu1,gpu[003-004]", "cpu1"),
        ("r[1-2]n[08-09]", "r1n08"),
        ("a-b[5,7]", "a-b5"),
    ],
)
def test_first_host_matches_scontrol_show_hostnames(nodelist, host):
    assert first_host(nodelist) == host


def test_tasks_per_node_and_port():
    assert tasks_per_node("4(x2),3") == [4, 4, 3]
    assert tasks_per_node("8") == [8]
    assert port_for_job("1234_5") == 15000 + 12345 % 10000  # an array task's id
    assert 15000 <= port_for_job("987654321") < 25000


# --- deploy/slurm/train.sbatch ------------------------------------------------------------------


def test_sbatch_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True).returncode == 0


def _sbatch(tmp_path, env: dict[str, str], args: list[str]) -> subprocess.CompletedProcess:
    """Run the batch script with stub srun/scontrol first on PATH; srun records its arguments."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    (stubs / "scontrol").write_text(
        "#!/usr/bin/env bash\n"
        '[ "$1 $2 $3" = "show hostnames gpu[017-018]" ] || exit 3\n'
        'printf "gpu017\\ngpu018\\n"\n'
    )
    (stubs / "srun").write_text(
        '#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$STUB_DIR/srun.args"\n'
        'echo "$SDNET_RUN_ID" > "$STUB_DIR/run_id"\n'
    )
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    base = {
        "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "STUB_DIR": str(tmp_path),
        "HOME": str(tmp_path),
    }
    return subprocess.run(
        ["bash", str(SBATCH), *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


SLURM_BATCH = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[017-018]",
    "SLURM_JOB_NUM_NODES": "2",
}


def test_sbatch_runs_one_torchrun_per_node_with_the_c10d_rendezvous(tmp_path):
    done = _sbatch(
        tmp_path,
        {**SLURM_BATCH, "SLURM_GPUS_ON_NODE": "8"},
        ["+recipe=resnet152", "optim.lr=0.4", "run.name=two words"],
    )
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "srun.args").read_text().splitlines()
    python = args.index("python")
    assert "--ntasks-per-node=1" in args[:python] and "--nodes=2" in args[:python]
    assert args[python:] == [
        "python",
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=8",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=gpu017:{15000 + 4242}",
        "--rdzv-id=4242",
        "-m",
        "sdnet_trainer",
        "+recipe=resnet152",
        "optim.lr=0.4",
        "run.name=two words",
    ]
    assert (tmp_path / "run_id").read_text().strip() == "4242"  # one run directory on every node


def test_sbatch_defaults_and_overrides(tmp_path):
    done = _sbatch(
        tmp_path,
        {**SLURM_BATCH, "SDNET_PYTHON": "/opt/py/bin/python", "SDNET_RDZV_PORT": "29400"},
        [],
    )
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "srun.args").read_text().splitlines()
    assert "--nproc_per_node=1" in args  # no GPUs announced: one process per node
    assert "--rdzv-endpoint=gpu017:29400" in args and "/opt/py/bin/python" in args
    assert args[-2:] == ["-m", "sdnet_trainer"]


def test_sbatch_outside_slurm_says_so(tmp_path):
    done = _sbatch(tmp_path, {}, [])
    assert done.returncode != 0 and "submit this script with sbatch" in done.stderr


# --- deploy/k8s/pytorchjob.yaml ------------------------------------------------------------------


def test_pytorchjob_manifest():
    job = yaml.safe_load(PYTORCHJOB.read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    spec = job["spec"]
    assert isinstance(spec["nprocPerNode"], str)  # the API field is a string ("8", "auto", "gpu")
    replicas = spec["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    run_ids = set()
    for replica in replicas.values():
        (container,) = replica["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"  # the container the operator configures
        command = container["command"] + container["args"]
        assert command[:3] == ["torchrun", "-m", "sdnet_trainer"]
        run_ids |= {a for a in command if a.startswith("run.id=")}
    assert len(run_ids) == 1  # every pod names the same run directory


# --- sweep summaries ------------------------------------------------------------------------------


def test_final_metrics_are_what_fit_returns():
    rows = [
        {"step": 2, "train/loss": 2.3, "perf/step_s": 0.1},
        {"step": 4, "val/loss": 2.2, "val/top1": 10.0},
        {"step": 6, "train/loss": 2.1},
        {"step": 6, "val/loss": 2.0, "val/top1": 20.0},
        {"step": 6, "summary/steps": 6.0},
    ]
    assert final_metrics(rows) == {
        "train/loss": 2.1,
        "val/loss": 2.0,
        "val/top1": 20.0,
        "summary/steps": 6.0,
    }


def test_summary_shows_the_overrides_that_vary_and_failures(tmp_path):
    for num, lr, code in [(0, "0.1", 0), (1, "0.3", 2)]:
        run_dir = tmp_path / str(num)
        write_trial(
            run_dir,
            num=num,
            overrides=["+recipe=quickstart", f"optim.lr={lr}"],
            command=["x"],
            returncode=code,
        )
        if code == 0:
            row = {"step": 4, "train/loss": 1.5, "val/top1": 50.0}
            (run_dir / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    table = write_summary(tmp_path)
    assert table.splitlines()[0] == "| trial | optim.lr | status | train/loss | val/top1 |"
    assert "| 1 | 0.3 | failed (exit 2) |  |  |" in table
    assert (tmp_path / "summary.csv").read_text().splitlines() == [
        "trial,optim.lr,status,train/loss,val/top1",
        "0,0.1,ok,1.5,50.0",
        "1,0.3,failed (exit 2),,",
    ]


def test_summary_table_with_chosen_metrics():
    trial = Trial(0, REPO, ["optim.lr=0.1"], 0, {"val/loss": 1.0, "train/loss": 2.0})
    header, rows = summary_table([trial], ["val/loss", "val/top5"])
    assert header == ["trial", "optim.lr", "status", "val/loss", "val/top5"]
    assert rows == [[0, "0.1", "ok", 1.0, ""]]


def test_trial_command_pins_the_run_directory():
    cmd = torchrun_command(
        ["-m", "sdnet_trainer"],
        ["optim.lr=0.1"],
        run_dir="/runs/sweep one/0",
        nproc_per_node=2,
        torchrun_args=["--max-restarts=1"],
        python="py",
    )
    assert cmd == [
        "py",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=1",
        "-m",
        "sdnet_trainer",
        "optim.lr=0.1",
        "hydra.run.dir='/runs/sweep one/0'",
    ]
    assert override_value("/tmp/a-b_c/0") == "/tmp/a-b_c/0"
    assert override_value("it's") == "'it\\'s'"


def test_sweep_cli_usage(capsys):
    assert sweep_main([]) == 2
    assert "usage: python -m sdnet_trainer.sweep SWEEP_DIR" in capsys.readouterr().err


# --- launcher and sweeper configs -----------------------------------------------------------------


def _hydra_config(overrides: list[str]):
    from hydra import compose, initialize_config_module

    from sdnet_trainer.config import CONFIG_MODULE

    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True).hydra


def test_torchrun_launcher_config_is_registered():
    launcher = _hydra_config(
        [
            "hydra/launcher=torchrun",
            "hydra.launcher.nproc_per_node=2",
            "hydra.launcher.objective=val/loss",
        ]
    ).launcher
    assert (
        launcher._target_
        == "hydra_plugins.sdnet_trainer_plugins.torchrun_launcher.TorchrunLauncher"
    )
    assert (launcher.nproc_per_node, launcher.objective, list(launcher.torchrun_args)) == (
        2,
        "val/loss",
        [],
    )


def test_slurm_launcher_config_runs_one_task_per_gpu():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")  # the `slurm` extra
    launcher = _hydra_config(
        ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=4", "hydra.launcher.nodes=2"]
    ).launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 4, 4)


def test_optuna_sweeper_config():
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")  # the `sweep` extra
    sweeper = _hydra_config(["hydra/sweeper=sdnet_optuna"]).sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.direction == "minimize"


def test_torchrun_launcher_job_returns():
    from hydra.core.utils import JobStatus
    from omegaconf import OmegaConf

    from hydra_plugins.sdnet_trainer_plugins.torchrun_launcher import TorchrunLauncher, TrialFailed

    def job_return(launcher, returncode, metrics):
        cfg = OmegaConf.create({"hydra": {"job": {"num": 3}}, "optim": {"lr": 0.1}})
        return launcher._job_return(cfg, ["optim.lr=0.1"], REPO / "run", 3, returncode, metrics)

    metrics = {"train/loss": 1.5, "val/loss": 1.25}
    done = job_return(TorchrunLauncher(nproc_per_node=2), 0, metrics)
    assert (
        done.status == JobStatus.COMPLETED
        and done.return_value == metrics
        and "hydra" not in done.cfg
    )
    assert (
        job_return(TorchrunLauncher(objective="val/loss"), 0, metrics).return_value == 1.25
    )  # for Optuna
    missing = job_return(TorchrunLauncher(objective="val/top1"), 0, metrics)
    assert missing.status == JobStatus.FAILED
    with pytest.raises(
        TrialFailed, match="objective='val/top1': trial #3 has no such final metric"
    ):
        _ = missing.return_value
    failed = job_return(TorchrunLauncher(), 1, {})
    with pytest.raises(TrialFailed, match="trial #3 exited with code 1"):
        _ = failed.return_value


@pytest.mark.parametrize("value", ["two", 0, True])
def test_torchrun_launcher_rejects_bad_nproc(value):
    from hydra_plugins.sdnet_trainer_plugins.torchrun_launcher import TorchrunLauncher

    with pytest.raises(ConfigError, match="hydra.launcher.nproc_per_node="):
        TorchrunLauncher(nproc_per_node=value)
