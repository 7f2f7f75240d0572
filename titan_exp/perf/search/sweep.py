"""How a plan is launched: each ranked layout as the overrides that run it on the planned machine
(`launch_overrides`), and the top layouts that fit as a named sweep (`write_sweep`): one
`+plan_layout` choice each, for `titan-exp -m +sweep=NAME`, in the user's sweeps/ folder (never
the package's)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any, Iterable

import yaml

from titan_exp.config import JobConfig, user_sweeps, world_of
from titan_exp.perf.search.axes import override_key
from titan_exp.perf.search.planner import Plan

# What a member of a written sweep sets besides its layout: its global batch and its world's shape.
MEMBER_KEYS = ("training.global_batch_size", "cluster.nnodes", "cluster.nproc_per_node", "cluster.gpus_per_node")


def entry_point() -> str:
    """The command the user has for launch.py: the installed console script, else a checkout's
    launch.py in this folder, else the package's `python -m titan_exp`."""
    if shutil.which("titan-exp"):
        return "titan-exp"
    beside = Path(sys.executable).parent / "titan-exp"  # a virtual environment that is not activated
    if beside.exists():
        return str(beside)
    return "python launch.py" if Path("launch.py").exists() else "python -m titan_exp"


def shape_overrides(pl: Plan) -> list[str]:
    """The candidate's global batch and its world's shape: nodes, ranks per node, and on GPUs the
    GPUs to ask for per node (one rank each)."""
    job, per_node = pl.job, world_of(pl.degrees) // pl.nodes
    gpus = [f"cluster.gpus_per_node={per_node}"] if job is not None and job.cluster.gpus_per_node else []
    batch = [f"training.global_batch_size={job.training.global_batch_size}"] if job is not None else []
    return [*batch, f"cluster.nnodes={pl.nodes}", f"cluster.nproc_per_node={per_node}", *gpus]


def launch_overrides(pl: Plan, base_overrides: list[str]) -> list[str]:
    """The overrides that launch `pl` as planned: the plan's own (its model, data, ...) less what
    the candidate sets, then its settings, layout, batch split, global batch and world shape."""
    return [*sweep_overrides([pl], base_overrides), *pl.settings, *pl.overrides, *shape_overrides(pl)]


def sweep_overrides(plans: list[Plan], base_overrides: list[str]) -> list[str]:
    """The command line a sweep written from `plans` runs with: `base_overrides` less those whose
    keys a plan sets (its layout, batch split, global batch, world shape, searched settings), which
    on the command line would win over every candidate's own."""
    keys = {override_key(o) for pl in plans for o in (*pl.overrides, *pl.settings)} | set(MEMBER_KEYS)
    return [o for o in base_overrides if override_key(o) not in keys]


def write_sweep(plans: list[Plan], name: str, top: int, base_overrides: list[str], folder: Path | None = None,
                *, command: str | None = None) -> Path:
    """The top-k layouts that fit, as a sweep preset: `titan-exp -m +sweep=NAME`. Each layout (with
    the settings of the other axes searched, as the plan predicted them, its global batch and its
    world's shape) is one value of a `+plan_layout` choice, so the sweep runs exactly those
    candidates. Written to the user's sweeps/ (config.user_sweeps), never into the package;
    `command` is the line that runs it, for the file's header."""
    folder = folder or user_sweeps()
    chosen = [pl for pl in plans if pl.fits][:top]
    layouts = {f"{name}_{i}": pl for i, pl in enumerate(chosen)}
    preset = {"hydra": {"sweeper": {"params": {"+plan_layout": ",".join(layouts)}}}}
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{name}.yaml"
    command = command or f"{entry_point()} -m +sweep={name} {' '.join(sweep_overrides(chosen, base_overrides))}"
    header = (f"# Written by python -m titan_exp.perf.plan {' '.join(base_overrides)}\n"
              f"# The {len(chosen)} fastest predicted layouts that fit; run: {command.rstrip()}\n")
    out.write_text(header + yaml.safe_dump(preset, sort_keys=False))
    layout_dir = folder / "plan_layout"
    layout_dir.mkdir(exist_ok=True)
    for key, pl in layouts.items():
        node: dict = {}
        for o in (*pl.overrides, *shape_overrides(pl)):
            path, value = o.split("=")
            group, attr = path.split(".")
            node.setdefault(group, {})[attr] = int(value)
        for section, values in settings_config(pl.job, pl.settings).items():
            node.setdefault(section, {}).update(values)
        (layout_dir / f"{key}.yaml").write_text(yaml.safe_dump(node, sort_keys=False))
    return out


def settings_config(job: JobConfig, settings: Iterable[str]) -> dict[str, Any]:
    """What a candidate's settings set, as config to merge into a job's: each `section.field=value`
    as that value, and a precision preset (`precision=NAME`) as the whole precision config the
    candidate was predicted with (perf.search.axes.with_preset), so no field of another preset stays."""
    from omegaconf import OmegaConf

    out: dict[str, Any] = {}
    for setting in settings:
        key, value = override_key(setting), setting.split("=", 1)[1]
        if key == "precision":
            out["precision"] = OmegaConf.to_container(OmegaConf.structured(job.precision), enum_to_str=True)
        else:
            section, name = key.split(".")
            out.setdefault(section, {})[name] = yaml.safe_load(value)
    return out
