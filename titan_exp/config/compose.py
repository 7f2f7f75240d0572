"""Hydra glue: the schema as Hydra's base config, the named sweep groups, the --help page, and
conversion between a composed DictConfig and the typed JobConfig."""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import typing
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from titan_exp.config.hf import with_hf_config
from titan_exp.config.schema import JobConfig


def _shipped(name: str) -> Path:
    """The repository's top-level `conf/` or `sweeps/`. A wheel carries them inside the package
    (pyproject's package-dir maps them to titan_exp/conf and titan_exp/sweeps); a checkout, with
    or without an editable install, has them beside the package."""
    package = Path(__file__).resolve().parents[1]
    inside = package / name
    return inside if any(inside.glob("*.yaml")) else package.parent / name


CONF = _shipped("conf")
SWEEPS = _shipped("sweeps")


def user_sweeps() -> Path:
    """The user's own named sweeps (what `titan_exp.perf.plan --write-sweep` writes): `sweeps/` in
    the working directory, beside Hydra's `outputs/` (in a checkout's root, the shipped ones' folder),
    or $TITAN_EXP_SWEEPS."""
    return Path(os.environ.get("TITAN_EXP_SWEEPS", "sweeps")).resolve()


def sweep_groups() -> dict[str, list[Path]]:
    """Groups selected with `+group=name`: named sweeps, the ladder's rungs, the planner's
    layouts; each from the package's sweeps/ and then the user's (a user's preset of the same
    name wins)."""
    subfolders = {"sweep": "", "rung": "rung", "plan_layout": "plan_layout"}
    folders = [SWEEPS] if user_sweeps() == SWEEPS else [SWEEPS, user_sweeps()]
    return {group: [folder / sub for folder in folders] for group, sub in subfolders.items()}


def to_job_config(cfg: DictConfig | dict) -> JobConfig:
    """Typed JobConfig from a composed DictConfig (or a plain dict), ignoring Hydra's own node."""
    cfg = OmegaConf.create(cfg) if not isinstance(cfg, DictConfig) else cfg
    # Node by node, so Hydra's own node (whose sweep paths need a job number) is never resolved.
    plain = {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
             for k in cfg if k != "hydra"}
    merged = OmegaConf.merge(OmegaConf.structured(JobConfig), plain)
    job = OmegaConf.to_object(merged)
    # model.hf_config: its config.json sets the shapes
    return dataclasses.replace(job, model=with_hf_config(job.model))


def compose(overrides: list[str], *, with_hydra: bool = False) -> DictConfig:
    """The config `python launch.py OVERRIDES` composes (with Hydra's own node if asked), for the
    tools beside the launcher and scripts that call titan_exp.launch.launch."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides, return_hydra_config=with_hydra)


def compose_job(overrides: list[str]) -> JobConfig:
    """The JobConfig `python launch.py OVERRIDES` would run: for the tools beside the launcher
    (plan, calibrate)."""
    return to_job_config(compose(overrides))


def to_plain(job: JobConfig) -> dict:
    """The job as plain data (choices as their strings): for YAML, JSON, hashing and trackers."""
    return OmegaConf.to_container(OmegaConf.structured(job), enum_to_str=True)


def to_yaml(job: JobConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(job))


def load_job_config(path: str | Path) -> JobConfig:
    return to_job_config(OmegaConf.load(path))


def help_text() -> str:
    """Every field with its default, its choices and its doc, grouped by node: the body of
    `launch.py --help`."""
    lines = []
    for top in dataclasses.fields(JobConfig):
        if not dataclasses.is_dataclass(top.default_factory):  # a plain top-level field (allowed_targets)
            lines.append(f"{top.name} = {top.default_factory()!r}\n    {top.metadata.get('doc', '')}")
            continue
        lines.append(f"{top.name}:")
        lines += _field_lines(top.default_factory)
    return "\n".join(lines)


def _field_lines(schema: type, prefix: str = "") -> list[str]:
    """`name = default` and its doc for every field of `schema`, a nested node's as `node.name`."""
    lines = []
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(f.default_factory):
            lines += _field_lines(f.default_factory, f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = default.value if isinstance(default, enum.Enum) else default
        if isinstance(default, list):
            shown = [x.value if isinstance(x, enum.Enum) else x for x in default]
        text = f.metadata.get("doc", "")
        enum_type = choice_enum(schema, f.name)
        if enum_type is not None:
            text = f"{' | '.join(m.value for m in enum_type)}: {text}"
        lines.append(f"  {prefix}{f.name} = {shown!r}\n      {text}")
    return lines


@functools.cache
def _hints(schema: type) -> dict[str, typing.Any]:
    return typing.get_type_hints(schema)


def choice_enum(schema: type, field_name: str) -> type[enum.Enum] | None:
    """The Choice enum a schema field takes (directly, Optional or as a List's items), or None."""
    hint = _hints(schema)[field_name]
    for t in (hint, *typing.get_args(hint)):
        if isinstance(t, type) and issubclass(t, enum.Enum):
            return t
    return None


def register_configs() -> None:
    """Register the schema as Hydra's base config and a help page generated from the field docs."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="job_schema", node=JobConfig)
    # Named sweeps (`python launch.py -m +sweep=NAME`), the ladder's rungs and the planner's
    # layouts (titan_exp.perf.plan --write-sweep), from the package's sweeps/ and the user's.
    for group, folders in sweep_groups().items():
        for preset in sorted(p for folder in folders for p in folder.glob("*.yaml")):
            cs.store(group=group, name=preset.stem, node=OmegaConf.load(preset), package="_global_")
    template = (
        "== titan_exp ==\n"
        "Train Llama-family models with N-D parallelism.\n"
        "  titan-exp [group=option ...] [key=value ...]   e.g. parallelism=fsdp cluster.nproc_per_node=2\n"
        "  titan-exp --cfg job                            print the composed config\n"
        "  titan-exp -m key=a,b                           sweep (Hydra multirun)\n"
        "  (python -m titan_exp, or python launch.py in a checkout, are the same)\n\n"
        "== Config groups ==\n$APP_CONFIG_GROUPS\n\n"
        "== Fields (default, doc) ==\n" + help_text().replace("$", "$$") + "\n\n"
        "Hydra's own options: python launch.py --hydra-help\n"
    )
    cs.store(group="hydra/help", name="titan_exp",
             node={"app_name": "titan_exp", "header": "", "footer": "", "template": template})
