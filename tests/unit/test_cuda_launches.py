"""Every launch of the GPU lane, checked on the CPU before a GPU node is spent on it.

The launches are the CUDA tests' configs (tests/cuda/launches.py: ``LAUNCHES``) and the GPU
benchmark's, as ``scripts/bench/bench_gpu.py``'s ``planned_launches`` plans them for the GPU
check's two commands (``--quick`` and ``--second``). Each of them:

- composes through the command line's own main (``--cfg job --resolve``) with ``dist.device=cpu``
  (and ``dist.backend=nccl`` as gloo) in place of the GPU's: a key the schema lacks or a broken
  interpolation fails here;
- passes the whole-config preflight as on the GPU (``dist.device=cuda``, the CUDA queries faked:
  one GPU of compute capability 9.0) for its world size, after ``parallel=auto``'s plan as the
  command line makes it;
- where ``cpu_step``, trains one step on the CPU: its own keys, then ``loop.max_steps=1`` and no
  evaluation or save on exit (never another model or size). A run without a process group trains
  in this process with the Trainer class it names, a world of one on this process's one-rank gloo
  group, and the multi-rank ones with the layout worker's recording Trainer in one shared launch
  of tests/distributed/_layout_worker.py per world size: the suite pays one process-group start
  for all of them, not one per launch. These steps are in the full tier (seconds each, and
  processes); the rest is quick.

And the registry itself: each launch gives each key once (Hydra lets the last of two ``model=``
win silently); every ``compose(`` and ``run_cli(`` in tests/cuda/ takes its keys from
``LAUNCHES`` (by a syntax-tree lint), with no constant override of its own; every launch name a
CUDA test writes out is an entry, and every entry is used by some CUDA test.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import json
import math
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from sdnet_trainer import compose
from sdnet_trainer.config.schema import Config
from sdnet_trainer.distributed import distributed_session
from sdnet_trainer.preflight import validate
from sdnet_trainer.training.classes import resolve_trainer_class
from tests.cuda.launches import LAUNCHES, override_key
from tests.support import REPO, main_in_process, run_cli

CUDA_TESTS = REPO / "tests" / "cuda"
BENCH = REPO / "scripts" / "bench"
LAYOUT_WORKER = REPO / "tests" / "distributed" / "_layout_worker.py"
# The GPU check's two commands' benchmark arguments.
BENCH_COMMANDS = ("--quick", "--second")
# What makes one step cheap without changing what is launched: one step, no evaluation, no save
# when the run ends (a periodic save falls after step 1 in every launch).
ONE_STEP = (
    "loop.max_steps=1",
    "loop.eval_at_end=false",
    "loop.eval_at_epoch_end=false",
    "loop.eval_every_n_steps=null",
    "checkpoint.save_on_exit=false",
)
# The GPU the preflight believes it runs on.
FAKE_GPU = "NVIDIA H100 80GB HBM3"
FAKE_CAPABILITY = (9, 0)
FAKE_MEMORY = 80 * 2**30


@dataclass(frozen=True)
class Checked:
    """A launch as checked here: the CUDA tests' and the benchmark's alike."""

    name: str
    keys: tuple[str, ...]
    nproc: int | None
    cpu_step: bool


# ---------------------------------------------------------------------- the launches


@contextlib.contextmanager
def _bench_on_path() -> Iterator[None]:
    """scripts/bench on sys.path, as when bench_gpu.py runs as a script (its siblings import)."""
    sys.path.insert(0, str(BENCH))
    try:
        yield
    finally:
        sys.path.remove(str(BENCH))


def _bench_launches() -> list[Any]:
    """bench_gpu.planned_launches of each command, as parameters; one failing parameter naming
    the reason where they cannot be read (the module does not import, or its planner fails)."""
    try:
        with _bench_on_path():
            bench_gpu = importlib.import_module("bench_gpu")
            planned = {argv: bench_gpu.planned_launches([argv]) for argv in BENCH_COMMANDS}
    except Exception as err:  # whatever the module raises: reported by the tests, not collection
        return [pytest.param(f"bench_gpu's launches cannot be read: {err!r}", id="bench")]
    return [
        pytest.param(
            Checked(
                f"bench{argv}:{launch.name}",
                tuple(launch.keys),
                launch.nproc,
                launch.cpu_step,
            ),
            id=f"bench{argv}-{launch.name}",
        )
        for argv, launches in planned.items()
        for launch in launches
    ]


CUDA_LAUNCHES = [
    pytest.param(Checked(name, launch.keys, launch.nproc, launch.cpu_step), id=name)
    for name, launch in LAUNCHES.items()
]
ALL_LAUNCHES = [*CUDA_LAUNCHES, *_bench_launches()]


def _stepped(params: list[Any], *, ranks: bool) -> list[Any]:
    """The launches that train a step on the CPU: in this process (``ranks`` False) or in a
    shared multi-rank launch (True); the unreadable benchmark's parameter stays, to fail."""
    return [
        param
        for param in params
        if not isinstance(param.values[0], Checked)
        or (param.values[0].cpu_step and ((param.values[0].nproc or 1) > 1) is ranks)
    ]


def _launch(value: Checked | str | None) -> Checked:
    """The parameter's launch, or the reason there is none as this test's failure."""
    if not isinstance(value, Checked):
        pytest.fail(str(value))
    return value


def on_cpu(keys: tuple[str, ...]) -> list[str]:
    """The launch's overrides with the GPU's device and backend swapped for the CPU's."""
    assert keys.count("dist.device=cuda") == 1, f"a GPU launch names dist.device=cuda once: {keys}"
    swap = {"dist.device=cuda": "dist.device=cpu", "dist.backend=nccl": "dist.backend=gloo"}
    return [swap.get(key, key) for key in keys]


def test_the_benchmark_launches_checked_here_are_the_ones_it_starts(tmp_path):
    """The planner names every Trainer run of --quick (its decoders word for word as
    bench_gpu starts them, less hydra.run.dir) and those of --second."""
    with _bench_on_path():
        bench_gpu = importlib.import_module("bench_gpu")
        quick = {launch.name: launch for launch in bench_gpu.planned_launches(["--quick"])}
        assert bench_gpu.planned_launches(["--second"])
        args = bench_gpu.parse_args(["--quick"])
    assert {"resnet50 trainer", *(dec.section for dec in bench_gpu.DECODERS)} <= quick.keys()
    for decoder in bench_gpu.DECODERS:
        run = bench_gpu.DecoderRun.from_args(args, decoder)
        command = bench_gpu.decoder_command(run, tmp_path / decoder.section)
        assert command[:3] == [sys.executable, "-m", "sdnet_trainer"]
        started = tuple(key for key in command[3:] if not key.startswith("hydra."))
        assert quick[decoder.section].keys == started


@pytest.mark.parametrize("launch", ALL_LAUNCHES)
def test_each_key_is_given_once(launch):
    launch = _launch(launch)
    keys = [override_key(key) for key in launch.keys]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    assert not twice, f"{launch.name} sets {twice} more than once; Hydra takes the last silently"


# ---------------------------------------------------------------------- (a) through the CLI


@pytest.mark.usefixtures("main_in_this_process")
@pytest.mark.parametrize("launch", ALL_LAUNCHES)
def test_launch_composes_through_the_cli(launch, tmp_path, monkeypatch, capfd):
    """Word for word as launched, through the command line's own main, only the device swapped:
    a typo in a key or an interpolation fails here, not on the GPU node."""
    launch = _launch(launch)
    monkeypatch.chdir(tmp_path)
    argv = [*on_cpu(launch.keys), "--cfg", "job", "--resolve"]
    code, output = main_in_process(argv, monkeypatch, capfd)
    assert code == 0, f"{launch.name}: {output}"
    cfg = yaml.safe_load(output)
    assert cfg["dist"]["device"] == "cpu" and cfg["model"]["name"], output


# ---------------------------------------------------------------------- (b) preflight, as on a GPU


@pytest.fixture
def one_fake_gpu(monkeypatch) -> None:
    """What torch.cuda answers on a node with one H100, for the validations that ask."""
    properties = types.SimpleNamespace(
        name=FAKE_GPU,
        total_memory=FAKE_MEMORY,
        major=FAKE_CAPABILITY[0],
        minor=FAKE_CAPABILITY[1],
        multi_processor_count=132,
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: FAKE_CAPABILITY)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: FAKE_GPU)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: properties)
    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)


def preflight(cfg: Config, *, world_size: int) -> Config:
    """What the command line checks before any process starts (cli._validated): parallel=auto
    planned for the GPU, then the whole config."""
    if cfg.parallel.strategy == "auto":
        from sdnet_trainer.plan.auto import resolve_auto

        cfg = resolve_auto(cfg, world_size, checkpoint_dir=None, device=torch.device("cuda", 0))
    validate(cfg, world_size=world_size)
    return cfg


@pytest.mark.usefixtures("one_fake_gpu")
@pytest.mark.parametrize("launch", ALL_LAUNCHES)
def test_launch_passes_preflight_as_on_the_gpu(launch):
    launch = _launch(launch)
    cfg = compose(launch.keys)
    assert cfg.dist.device == "cuda"
    preflight(cfg, world_size=launch.nproc or 1)


# ---------------------------------------------------------------------- (c) one step on the CPU


@pytest.fixture
def cuda_markers(request) -> None:
    """The markers tests/cuda/conftest.py registers, for a launch whose Trainer class lives in a
    CUDA test module (``trainer._target_=tests.cuda.test_fit_cuda.ShardedProbe``): importing it
    applies them, which ``--strict-markers`` refuses until that conftest is loaded, and it is not
    when the unit tests run alone."""
    from tests.cuda import conftest

    registered = {line.split(":")[0] for line in request.config.getini("markers")}
    if not {conftest.RUN_LAST, conftest.GPU_SECOND} <= registered:
        conftest.pytest_configure(request.config)


@pytest.mark.full  # up to seconds each: out of the quick tier
@pytest.mark.usefixtures("cuda_markers")
@pytest.mark.parametrize("launch", _stepped(ALL_LAUNCHES, ranks=False))
def test_launch_trains_a_step_on_the_cpu(launch, tmp_path, request):
    """A launch without a process group in this process as the command line runs it (its
    session, its Trainer class); a world of one on the one-rank gloo group."""
    launch = _launch(launch)
    cfg = compose([*on_cpu(launch.keys), *ONE_STEP])
    validate(cfg, world_size=1)
    trainer_class = resolve_trainer_class(cfg.trainer._target_)
    if launch.nproc is None:
        with distributed_session(cfg.dist, output_dir=tmp_path) as env:
            trainer = trainer_class(cfg, output_dir=tmp_path, env=env)
            _fit_one_step(trainer)
    else:
        env = request.getfixturevalue("one_rank")  # tests/conftest.py: gloo, world size 1
        _fit_one_step(trainer_class(cfg, output_dir=tmp_path, env=env))


def _fit_one_step(trainer) -> None:
    try:
        trainer.fit()
        assert trainer.state.step == 1
        assert trainer.device.type == "cpu"
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def shared_worlds(tmp_path_factory):
    """Every multi-rank launch that trains on the CPU, one step each, in one launch of the layout
    worker per world size (started on first use): ``world(nproc)`` -> (its folder, its output)."""
    done: dict[int, tuple[Path, str]] = {}

    def world(nproc: int) -> tuple[Path, str]:
        if nproc not in done:
            cases = {
                launch.name: [*on_cpu(launch.keys), *ONE_STEP]
                for param in ALL_LAUNCHES
                if isinstance(launch := param.values[0], Checked)
                and launch.cpu_step
                and launch.nproc == nproc
            }
            out = tmp_path_factory.mktemp(f"world_{nproc}")
            spec = out / "cases.json"
            spec.write_text(json.dumps(cases))
            ran = run_cli([str(out), str(spec)], cwd=out, nproc=nproc, script=LAYOUT_WORKER)
            done[nproc] = (out, ran.output)
        return done[nproc]

    return world


@pytest.mark.full  # a multi-process launch: out of the quick tier
@pytest.mark.parametrize("launch", _stepped(ALL_LAUNCHES, ranks=True))
def test_multi_rank_launch_trains_a_step_on_the_cpu(launch, shared_worlds):
    launch = _launch(launch)
    out, output = shared_worlds(launch.nproc)
    record = out / f"{launch.name}.pt"
    # The worker stops at the first case that fails; its traceback is in the output.
    assert record.exists(), f"{launch.name} did not train; the shared launch:\n{output[-6000:]}"
    losses = torch.load(record, weights_only=False)["losses"]
    assert len(losses) == 1 and math.isfinite(losses[0]), losses


# ---------------------------------------------------------------------- the lint of tests/cuda


def _cuda_modules() -> dict[str, ast.Module]:
    """tests/cuda's modules, but the registry and the workers: a worker composes the overrides its
    command line brings, which the test that launches it passes to run_cli (linted there)."""
    return {
        path.stem: ast.parse(path.read_text())
        for path in sorted(CUDA_TESTS.glob("*.py"))
        if path.name != "launches.py" and not path.stem.endswith("_worker")
    }


def _is_launches(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "LAUNCHES") or (
        isinstance(node, ast.Attribute) and node.attr == "LAUNCHES"
    )


def _assignments(scope: ast.AST) -> dict[str, list[ast.AST]]:
    """The values assigned to each plain name in ``scope`` (its own body and blocks)."""
    values: dict[str, list[ast.AST]] = {}
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values.setdefault(target.id, []).append(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            values.setdefault(node.target.id, []).append(node.value)
    return values


def references_launches(node: ast.AST, assigned: dict[str, list[ast.AST]]) -> bool:
    """Whether ``node`` reads LAUNCHES, itself or through names assigned from it."""
    seen: set[str] = set()
    stack = [node]
    while stack:
        for sub in ast.walk(stack.pop()):
            if _is_launches(sub):
                return True
            if isinstance(sub, ast.Name) and sub.id in assigned and sub.id not in seen:
                seen.add(sub.id)
                stack.extend(assigned[sub.id])
    return False


def _constant_overrides(node: ast.AST) -> list[str]:
    """The plain ``key=value`` strings written in a list of overrides: registry material."""
    if not isinstance(node, (ast.List, ast.Tuple)):
        return []
    return [
        item.value
        for item in node.elts
        if isinstance(item, ast.Constant) and isinstance(item.value, str) and "=" in item.value
    ]


def _call_name(call: ast.Call) -> str | None:
    return getattr(call.func, "id", None) or getattr(call.func, "attr", None)


def _scopes(tree: ast.Module) -> Iterator[tuple[ast.AST, ast.Call]]:
    """Each call of the module with the function it is in (the module for top-level calls)."""
    functions = [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    inside = set()
    for function in functions:
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and id(node) not in inside:
                inside.add(id(node))
                yield function, node
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and id(node) not in inside:
            yield tree, node


def unregistered_launches(tree: ast.Module) -> list[str]:
    """The ``compose(`` and ``run_cli(`` calls of a module whose overrides do not come from
    LAUNCHES or that write an override out (line numbers and why)."""
    module_names = _assignments(tree)
    found = []
    for scope, call in _scopes(tree):
        if _call_name(call) not in ("compose", "run_cli"):
            continue
        if not call.args:
            found.append(f"line {call.lineno}: {_call_name(call)}() without overrides")
            continue
        assigned = {**module_names, **_assignments(scope)}
        overrides = call.args[0]
        if not references_launches(overrides, assigned):
            found.append(f"line {call.lineno}: {_call_name(call)}(...) not from LAUNCHES")
        for constant in _constant_overrides(overrides):
            found.append(f"line {call.lineno}: {constant!r} written out: put it in LAUNCHES")
    return found


def test_every_cuda_compose_and_launch_takes_its_keys_from_the_registry():
    modules = _cuda_modules()
    calls = sum(
        _call_name(call) in ("compose", "run_cli")
        for tree in modules.values()
        for _, call in _scopes(tree)
    )
    assert calls >= 15, calls  # the lint sees the calls it is about
    found = {name: unregistered_launches(tree) for name, tree in modules.items()}
    assert not {name: lines for name, lines in found.items() if lines}, found


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("compose(LAUNCHES['a'].keys)", False),
        ("run_cli([str(out), *LAUNCHES[name].keys], cwd=out)", False),
        ("launch = LAUNCHES[name]\n    run_cli([*launch.keys, f'hydra.run.dir={d}'])", False),
        ("compose([*launches.LAUNCHES[name].keys, *run_keys])", False),
        ("compose(['model=gpt_tiny'])", True),
        ("compose([*CUDA, *TINY_RUN])", True),
        ("run_cli([str(out)], cwd=out, nproc=1)", True),
        ("compose([*LAUNCHES['a'].keys, 'loop.max_steps=3'])", True),  # written out
        ("compose()", True),
    ],
)
def test_what_the_registry_lint_flags(source, flagged):
    tree = ast.parse(f"def test_x(name, out, d, run_keys):\n    {source}\n")
    assert bool(unregistered_launches(tree)) is flagged


# ---------------------------------------------------------------------- names: used, and existing


def _launch_parameters(modules: dict[str, ast.Module]) -> dict[tuple[str, str], set[str]]:
    """(module, function) -> the parameters that name a launch: read as ``LAUNCHES[p]``, or passed
    on where another function (of the module, or imported from tests.cuda) takes a launch name."""
    functions = _functions(modules)
    params: dict[tuple[str, str], set[str]] = {key: set() for key in functions}
    changed = True
    while changed:
        changed = False
        for (module, name), function in functions.items():
            assert isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
            own = {a.arg for a in [*function.args.posonlyargs, *function.args.args]}
            for node in ast.walk(function):
                passed: set[str] = set()
                if (
                    isinstance(node, ast.Subscript)
                    and _is_launches(node.value)
                    and isinstance(node.slice, ast.Name)
                ):
                    passed.add(node.slice.id)
                elif isinstance(node, ast.Call):
                    target = _resolve(modules, module, node)
                    for position, value in _arguments(functions.get(target), node):
                        if isinstance(value, ast.Name) and position in params.get(target, ()):
                            passed.add(value.id)
                new = (passed & own) - params[(module, name)]
                if new:
                    params[(module, name)] |= new
                    changed = True
    return params


def _resolve(modules: dict[str, ast.Module], module: str, call: ast.Call) -> tuple[str, str]:
    """The (module, function) a call by plain name reaches: the module's own, or imported from
    another module of tests/cuda."""
    name = getattr(call.func, "id", "")
    for node in modules[module].body:
        if not isinstance(node, ast.ImportFrom):
            continue
        source = node.module or ""
        if source.startswith("tests.cuda."):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return source.removeprefix("tests.cuda."), alias.name
    return module, name


def _arguments(function: ast.AST | None, call: ast.Call) -> Iterator[tuple[str, ast.AST]]:
    """(parameter name, argument) of a call of ``function``, positional and by keyword."""
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return
    names = [a.arg for a in [*function.args.posonlyargs, *function.args.args]]
    for name, value in zip(names, call.args):
        if not isinstance(value, ast.Starred):
            yield name, value
    for keyword in call.keywords:
        if keyword.arg is not None:
            yield keyword.arg, keyword.value


def _parametrized_names(decorator: ast.AST, wanted: set[str], tree: ast.Module) -> list[ast.AST]:
    """The values a ``pytest.mark.parametrize`` decorator gives to the parameters in ``wanted``
    (its list written there, or a module-level list of that name)."""
    if not (isinstance(decorator, ast.Call) and _call_name(decorator) == "parametrize"):
        return []
    argnames, argvalues = decorator.args[:2]
    if isinstance(argnames, ast.Constant):
        names = [n.strip() for n in str(argnames.value).split(",")]
    elif isinstance(argnames, (ast.Tuple, ast.List)):
        names = [str(n.value) for n in argnames.elts if isinstance(n, ast.Constant)]
    else:
        return []
    values_node: ast.AST = argvalues
    if isinstance(argvalues, ast.Name):
        bound = _assignments(tree).get(argvalues.id, [])
        values_node = bound[0] if bound else argvalues
    if not isinstance(values_node, (ast.List, ast.Tuple)):
        return []
    found: list[ast.AST] = []
    for item in values_node.elts:
        if isinstance(item, ast.Call) and _call_name(item) == "param":
            values = item.args
        elif len(names) > 1 and isinstance(item, (ast.Tuple, ast.List)):
            values = item.elts
        else:
            values = [item]
        found.extend(v for n, v in zip(names, values) if n in wanted)
    return found


def _functions(modules: dict[str, ast.Module]) -> dict[tuple[str, str], ast.AST]:
    """(module, name) -> each module-level function of tests/cuda."""
    return {
        (module, node.name): node
        for module, tree in modules.items()
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def named_launches(modules: dict[str, ast.Module]) -> tuple[dict[str, set[str]], list[str]]:
    """Module -> the launch names its tests write out (``LAUNCHES["x"]``, a string passed where a
    function takes a launch name, a parametrization of such a parameter); and where a launch is
    named otherwise, by an expression that is no parameter naming a launch itself."""
    params = _launch_parameters(modules)
    functions = _functions(modules)
    names: dict[str, set[str]] = {module: set() for module in modules}
    unwritten: list[str] = []
    for module, tree in modules.items():
        for scope in tree.body:
            own = params.get((module, getattr(scope, "name", "")), set())
            for node in ast.walk(scope):
                named: list[ast.AST] = []
                if isinstance(node, ast.Subscript) and _is_launches(node.value):
                    named.append(node.slice)
                elif isinstance(node, ast.Call):
                    target = _resolve(modules, module, node)
                    arguments = _arguments(functions.get(target), node)
                    named += [v for p, v in arguments if p in params.get(target, ())]
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    wanted = params.get((module, node.name), set())
                    for decorator in node.decorator_list:
                        named += _parametrized_names(decorator, wanted, tree)
                for value in named:
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        names[module].add(value.value)
                    elif not (isinstance(value, ast.Name) and value.id in own):
                        line = getattr(value, "lineno", "?")
                        unwritten.append(f"{module}.py line {line}: {ast.unparse(value)}")
    return names, unwritten


def test_every_launch_name_a_cuda_test_writes_is_an_entry_and_every_entry_is_used():
    named, unwritten = named_launches(_cuda_modules())
    assert not unwritten, f"launches named by an expression, not written out: {unwritten}"
    unknown = {
        module: sorted(n - LAUNCHES.keys()) for module, n in named.items() if n - LAUNCHES.keys()
    }
    assert not unknown, f"no such entry in tests/cuda/launches.py: {unknown}"
    used = set().union(*named.values())
    assert not LAUNCHES.keys() - used, (
        f"entries no CUDA test uses: {sorted(LAUNCHES.keys() - used)}"
    )


def test_the_name_lint_follows_wrappers_and_parametrizations():
    source = """
import pytest
def _fit(tmp_path, name, env=None):
    return compose(LAUNCHES[name].keys)
def _pair(tmp_path, first, second):
    return _fit(tmp_path, first, env="not a launch"), _fit(tmp_path, second)
CASES = [pytest.param("c", id="c")]
@pytest.mark.parametrize("name", CASES)
def test_a(tmp_path, name):
    _fit(tmp_path, name)
@pytest.mark.parametrize(("launch", "other"), [("d", "x"), ("e", "y")])
def test_b(tmp_path, launch, other):
    _pair(tmp_path, launch, second=launch)
def test_c(tmp_path):
    _pair(tmp_path, "f", second="g")
    LAUNCHES["h"]
    print("i")
def test_d(tmp_path):
    _fit(tmp_path, OTHER)
"""
    names, unwritten = named_launches({"m": ast.parse(source)})
    assert names == {"m": {"c", "d", "e", "f", "g", "h"}}
    assert unwritten == ["m.py line 19: OTHER"]
