"""What a search ranges over besides the layout: the values of each axis `autotune.search` names
(AC mode, compile, precision, torchao's float8 shape filter), for a job. The plan
(`python -m titan_exp.perf.plan`) and autotune search the same candidates: each layout at each
combination of these values (perf.search.planner, perf.autotune)."""

from __future__ import annotations

import dataclasses
from typing import Iterable

from titan_exp.config import AUTO_FILTER, CONF, ACMode, AutotuneAxis, JobConfig, PrecisionConfig

# The precision axis: the presets a GPU trains fastest with (float8 where it has float8 matmuls), and
# a CPU's (float8 is emulated there: never faster).
GPU_PRECISIONS = ("bf16", "float8", "float8_rowwise")
CPU_PRECISIONS = ("fp32", "bf16")
# How a candidate's overrides read in its name.
LABELS = {"activation_checkpoint.mode": "AC {}", "compile.enable": "compile={}", "precision": "{}",
          "precision.filter_fqns": "small linears bf16"}


def override_key(override: str) -> str:
    """The key an override sets: `precision` of `precision=bf16`, `compile.enable` of `+compile.enable=true`."""
    return override.lstrip("+~").split("=", 1)[0]


def labels(overrides: Iterable[str]) -> list[str]:
    """How the overrides a search set read in a candidate's name: `AC full`, `compile=true`, `float8`."""
    return [LABELS[override_key(o)].format(o.split("=", 1)[1]) for o in overrides]


def with_preset(precision: PrecisionConfig, name: str) -> PrecisionConfig:
    """`precision` with the preset `name` (conf/precision/NAME.yaml) in place of its own, as
    `precision=NAME` composes it: the schema's defaults under the preset's fields, and each field
    the job set beyond its own preset's (a command line's `precision.filter_fqns=...`) kept."""
    from omegaconf import OmegaConf

    def preset(preset_name: str):
        path = CONF / "precision" / f"{preset_name}.yaml"
        return OmegaConf.load(path) if path.exists() else OmegaConf.create()

    schema = OmegaConf.structured(PrecisionConfig)
    own, base = OmegaConf.structured(precision), OmegaConf.merge(schema, preset(precision.name))
    beyond = {k: own[k] for k in own if k != "name" and own[k] != base[k]}
    return OmegaConf.to_object(OmegaConf.merge(schema, preset(name), beyond))


def axis_values(job: JobConfig, overrides: list[str], axis: AutotuneAxis,
                cuda: bool) -> list[tuple[JobConfig, list[str]]]:
    """The job at each value of one axis, with the overrides that set it (after `overrides`)."""
    r = dataclasses.replace
    if axis == AutotuneAxis.activation_checkpoint:
        return [(r(job, activation_checkpoint=r(job.activation_checkpoint, mode=mode)),
                 [*overrides, f"activation_checkpoint.mode={mode.value}"]) for mode in ACMode]
    if axis == AutotuneAxis.compile:
        return [(r(job, compile=r(job.compile, enable=on)), [*overrides, f"compile.enable={str(on).lower()}"])
                for on in (False, True)]
    if axis == AutotuneAxis.precision:
        return [(r(job, precision=with_preset(job.precision, name)), [*overrides, f"precision={name}"])
                for name in (GPU_PRECISIONS if cuda else CPU_PRECISIONS)]
    if axis == AutotuneAxis.float8_filter:  # torchao's shape filter beside a float8 candidate's own list
        p = job.precision
        if not p.shape_filterable or AUTO_FILTER in p.filter_fqns:
            return [(job, overrides)]
        names = [*p.filter_fqns, AUTO_FILTER]
        return [(job, overrides), (r(job, precision=r(p, filter_fqns=names)),
                                   [*overrides, f"precision.filter_fqns=[{','.join(names)}]"])]
    return [(job, overrides)]


def variants(job: JobConfig, axes: Iterable[AutotuneAxis], *, cuda: bool) -> list[tuple[JobConfig, list[str]]]:
    """The job at each combination of the values of the axes searched besides the layout, with the
    overrides that set them; the job alone, with none, where no such axis is searched."""
    out: list[tuple[JobConfig, list[str]]] = [(job, [])]
    for axis in sorted(axes, key=lambda a: a == AutotuneAxis.float8_filter):  # the filter after precision
        if axis != AutotuneAxis.layout:
            out = [v for j, o in out for v in axis_values(j, o, axis, cuda)]
    return out
