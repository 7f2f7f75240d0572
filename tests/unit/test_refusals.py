"""A refusal of bad config input, as a user meets it at `python launch.py ...`: exit code 2 and
one line on stderr that names the field, the value and the fix, before any rank starts. The
rule every float of the schema keeps (finite, unless its field takes +inf) is checked field by
field. (Field ranges and layouts: test_config.py; typos and _target_s: test_guard.py.)"""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest
from conftest import job_config, launch_cli

from titan_exp.config import JobConfig
from titan_exp.validation import validate

REFUSED = "titan_exp: refused, nothing was started: "


def refused(args: list[str], tmp_path) -> str:
    """The one line `python launch.py ARGS` refuses them with (exit 2, nothing else on stderr)."""
    out = launch_cli([*args, f"hydra.run.dir={tmp_path / 'run'}"])
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(REFUSED), out.stderr
    return lines[0].removeprefix(REFUSED)


# (overrides, the line, exactly, after the prefix): refused before Hydra composes (--cfg job runs nothing).
BEFORE_HYDRA = [
    (["training.steps=ten"], "training.steps = 'ten': must be an integer (int), e.g. training.steps=40"),
    (["cluster.nproc_per_node=two"], "cluster.nproc_per_node = 'two': must be an integer (int) or null"),
    (["compile.enable=maybe"], "compile.enable = 'maybe': must be true or false (bool), e.g. compile.enable=false"),
    (["precision.filter_fqns=output"],
     "precision.filter_fqns = 'output': must be a list ([a,b]), e.g. precision.filter_fqns=[output]"),
    (["trainig.steps=5"], "trainig.steps: unknown key; did you mean training.steps?"),
    (["optimiser.weight_decay=0"], "optimiser.weight_decay: unknown key; did you mean optimizer.weight_decay?"),
    (["training.max_norm=nan"], "training.max_norm = nan: not a number; give a finite number or inf (no limit, as 0), "
                                "e.g. training.max_norm=1.0 (the default)"),
    (["optimizer.weight_decay=nan"],
     "optimizer.weight_decay = nan: not a number; give a finite number, e.g. optimizer.weight_decay=0.1 (the default)"),
    (["model.rope_theta=-inf"],
     "model.rope_theta = -inf: must be finite; give a finite number, e.g. model.rope_theta=500000.0 (the default)"),
    (["+optimizer.kwargs.momentum=inf"],
     "optimizer.kwargs.momentum = inf: must be finite; give a finite number (a _target_ gets its kwargs as they are)"),
    (["-m", "optimizer.lr=1e-3,nan"],
     "optimizer.lr = nan: not a number; give a finite number, e.g. optimizer.lr=0.0008 (the default)"),
]


@pytest.mark.parametrize("args,line", BEFORE_HYDRA, ids=[" ".join(a) for a, _ in BEFORE_HYDRA])
@pytest.mark.quick
def test_refused_in_one_line_before_hydra_composes(args, line, tmp_path):
    assert refused([*args, "--cfg", "job"], tmp_path) == line
    assert not (tmp_path / "run").exists()


@pytest.mark.quick
def test_inf_where_the_field_takes_it():
    """+inf in a field that says what it means (`doc(..., inf=...)`, shown by --help) composes."""
    out = launch_cli(["training.max_norm=inf", "autotune.budget_minutes=inf", "--cfg", "job"])
    assert out.returncode == 0, out.stderr
    assert "max_norm: .inf" in out.stdout and "budget_minutes: .inf" in out.stdout
    assert "no limit, as 0" in launch_cli(["--help"]).stdout


def test_refused_by_the_launcher_in_one_line(tmp_path):
    """What only validation and the preflight see, through the same CLI: NaN from a config file
    (no override to check before Hydra), a layout that does not fit a fresh run (the degrees
    alone: no elastic hint without a checkpoint to re-plan from), a checkpoint path that is not
    there (called missing, with no advice to delete a step dir)."""
    mine = tmp_path / "mine" / "experiment"
    mine.mkdir(parents=True)
    (mine / "no_norm.yaml").write_text("# @package _global_\ntraining:\n  max_norm: .nan\n")
    line = refused(["--config-dir", str(tmp_path / "mine"), "+experiment=no_norm"], tmp_path)
    assert line.startswith("training.max_norm = nan: not a number; give a finite number"), line

    line = refused(["checkpoint=default", "parallelism.tensor_parallel_degree=2",
                    "parallelism.data_parallel_shard_degree=1", "cluster.nproc_per_node=1"], tmp_path)
    assert line == ("parallelism.tensor_parallel_degree = 2: the product of the degrees is 2 but the world size is 1 "
                    "(cluster.nnodes=1 x cluster.nproc_per_node=1); make them equal or set "
                    "data_parallel_shard_degree=-1")

    missing = tmp_path / "nowhere" / "step-5"
    line = refused(["checkpoint=default", f"checkpoint.initial_load_path={missing}"], tmp_path)
    assert line == (f"checkpoint.initial_load_path = '{missing}': does not exist; "
                    "give a step-N dir a run saved (<run dir>/checkpoints/step-N)")


def test_a_resumed_run_that_does_not_fit_its_world_hears_of_cluster_elastic(tmp_path):
    """A run with a checkpoint of its own, relaunched on degrees its world size cannot lay out:
    the hint that cluster.elastic=true re-plans it appears there, naming the step it continues."""
    run = ["checkpoint=default", "training.seq_len=32", "training.local_batch_size=2", "lr_scheduler.warmup_steps=0",
           f"hydra.run.dir={tmp_path / 'run'}"]
    first = launch_cli([*run, "cluster=debug", "training.steps=1"])
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    line = refused([*run, "training.steps=2", "parallelism.tensor_parallel_degree=2",
                    "parallelism.data_parallel_shard_degree=1", "cluster.nproc_per_node=1"], tmp_path)
    assert line.startswith("parallelism.tensor_parallel_degree = 2: the product of the degrees is 2 but the world")
    assert line.endswith("; or continue this run's checkpoint step-1 on this world size with cluster.elastic=true, "
                         "which re-plans the layout"), line


def test_an_incomplete_step_dir_keeps_the_advice_to_delete_it(tmp_path):
    """initial_load_path at a step dir whose save never finished: that one is not missing, and
    deleting it is the fix; a directory of checkpoints names the step to give instead."""
    from titan_exp.checkpoint.manager import preflight

    cfg = job_config(["checkpoint=default"]).checkpoint
    half = tmp_path / "other" / "checkpoints" / "step-3"
    half.mkdir(parents=True)
    (half / ".metadata").write_bytes(b"")
    errors = preflight(dataclasses.replace(cfg, initial_load_path=str(half)), tmp_path / "run", {}, None)
    assert errors == [f"checkpoint.initial_load_path: {half} is not a complete checkpoint (no complete.json: the save "
                      "never finished); delete that step dir or choose another checkpoint"]
    errors = preflight(dataclasses.replace(cfg, initial_load_path=str(tmp_path / "nope")), tmp_path / "run", {}, None)
    assert errors and "does not exist" in errors[0] and "delete" not in errors[0]


# --- every float of the schema: finite, unless its field says what +inf means ------------------------

def float_fields(schema: type, where: str) -> typing.Iterator[tuple[str, dataclasses.Field]]:
    """(key, field) of every float field of `schema` and the nodes under it (a list of nodes
    through its first item), from the type hints: Optional[float] with a null default too."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        item = args[0] if typing.get_origin(hint) is list and args else None
        if hint is float or (typing.get_origin(hint) is typing.Union and args == [float]):
            yield f"{where}{f.name}", f
        elif dataclasses.is_dataclass(hint):
            yield from float_fields(hint, f"{where}{f.name}.")
        elif dataclasses.is_dataclass(item):
            yield from float_fields(item, f"{where}{f.name}[0].")


def with_value(node, key: str, value):
    """`node` (a JobConfig or a node of one) with `key` set to `value`, a list's item by [0]."""
    name, _, rest = key.partition(".")
    if name.endswith("[0]"):
        name = name[:-3]
        items = getattr(node, name)
        item = items[0] if items else typing.get_args(typing.get_type_hints(type(node))[name])[0]()
        return dataclasses.replace(node, **{name: [with_value(item, rest, value)]})
    return dataclasses.replace(node, **{name: with_value(getattr(node, name), rest, value) if rest else value})


FLOATS = list(float_fields(JobConfig, ""))


@pytest.mark.quick
def test_the_walk_finds_every_kind_of_float_field():
    keys = [k for k, _ in FLOATS]
    for key in ("training.max_norm", "optimizer.weight_decay", "lr_scheduler.decay_ratio", "metrics.peak_tflops",
                "model.rope_theta", "data.mixture[0].weight", "autotune.budget_minutes"):
        assert key in keys, keys
    assert len(keys) >= 20


@pytest.mark.parametrize("key,field", FLOATS, ids=[k for k, _ in FLOATS])
@pytest.mark.quick
def test_every_float_field_refuses_nan_and_inf_unless_it_takes_inf(key, field):
    job = job_config([])
    for value in (math.nan, math.inf, -math.inf):
        errors = validate(with_value(job, key, value), cuda=False)
        takes = value == math.inf and field.metadata.get("inf")
        if takes:
            assert not any(e.startswith(key) for e in errors), errors
            assert f"inf = {field.metadata['inf']}" in field.metadata["doc"]  # --help says what it means
            continue
        assert len(errors) == 1, errors  # this one, not the rules it would slip past
        shown = "nan" if math.isnan(value) else str(value)
        assert errors[0].startswith(f"{key} = {shown}: ") and "give a finite number" in errors[0], errors
        assert "\n" not in errors[0]


@pytest.mark.quick
def test_free_form_kwargs_are_held_to_the_rule_too():
    job = job_config([])
    job = dataclasses.replace(job, optimizer=dataclasses.replace(job.optimizer, kwargs={"betas": [0.9, math.nan]}))
    assert validate(job, cuda=False) == [
        "optimizer.kwargs.betas[1] = nan: not a number; give a finite number (a _target_ gets its kwargs as they are)"]
