"""A plan written as a named sweep: its top layouts that fit as one `+plan_layout` choice each, for
`python launch.py -m +sweep=NAME`, in the user's sweeps/ folder (never the package's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import yaml

from titan_exp.config import JobConfig, user_sweeps, world_of
from titan_exp.perf.search.axes import override_key
from titan_exp.perf.search.planner import Plan


def sweep_overrides(plans: list[Plan], base_overrides: list[str]) -> list[str]:
    """The command line a sweep written from `plans` runs with: `base_overrides` less those whose
    keys a plan sets (its layout, batch split, ranks per node, searched settings), which on the
    command line would win over every candidate's own."""
    keys = {override_key(o) for pl in plans for o in (*pl.overrides, *pl.settings)} | {"cluster.nproc_per_node"}
    return [o for o in base_overrides if override_key(o) not in keys]


def write_sweep(plans: list[Plan], name: str, top: int, base_overrides: list[str], folder: Path | None = None) -> Path:
    """The top-k layouts that fit, as a sweep preset: `python launch.py -m +sweep=NAME`. Each
    layout (with the settings of the other axes searched, as the plan predicted them) is one value
    of a `+plan_layout` choice, so the sweep runs exactly those candidates. Written to
    the user's sweeps/ (config.user_sweeps), never into the package."""
    folder = folder or user_sweeps()
    chosen = [pl for pl in plans if pl.fits][:top]
    layouts = {f"{name}_{i}": pl.overrides for i, pl in enumerate(chosen)}
    preset = {
        "hydra": {"sweeper": {"params": {"+plan_layout": ",".join(layouts)}}},
    }
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{name}.yaml"
    header = (f"# Written by python -m titan_exp.perf.plan {' '.join(base_overrides)}\n"
              f"# The {len(chosen)} fastest predicted layouts that fit; run: python launch.py -m +sweep={name} "
              f"{' '.join(sweep_overrides(chosen, base_overrides))}\n")
    out.write_text(header + yaml.safe_dump(preset, sort_keys=False))
    layout_dir = folder / "plan_layout"
    layout_dir.mkdir(exist_ok=True)
    for (key, overrides), pl in zip(layouts.items(), chosen):
        node: dict = {}
        for o in overrides:
            path, value = o.split("=")
            group, attr = path.split(".")
            node.setdefault(group, {})[attr] = int(value)
        node.setdefault("cluster", {})["nproc_per_node"] = world_of(pl.degrees) // pl.nodes  # ranks per node
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
