"""Hydra glue: the schema as Hydra's base config, the named sweep groups, the --help page, and
conversion between a composed DictConfig and the typed JobConfig."""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from titan_exp.config.schema import JobConfig

CONF = Path(__file__).resolve().parents[2] / "conf"
SWEEPS = Path(__file__).resolve().parents[2] / "sweeps"


def sweep_groups() -> dict[str, Path]:
    """Groups selected with `+group=name`: named sweeps, the ladder's rungs, the planner's layouts."""
    return {"sweep": SWEEPS, "rung": SWEEPS / "rung", "plan_layout": SWEEPS / "plan_layout"}


def to_job_config(cfg: DictConfig | dict) -> JobConfig:
    """Typed JobConfig from a composed DictConfig (or a plain dict), ignoring Hydra's own node."""
    cfg = OmegaConf.create(cfg) if not isinstance(cfg, DictConfig) else cfg
    # Node by node, so Hydra's own node (whose sweep paths need a job number) is never resolved.
    plain = {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
             for k in cfg if k != "hydra"}
    merged = OmegaConf.merge(OmegaConf.structured(JobConfig), plain)
    return OmegaConf.to_object(merged)


def compose_job(overrides: list[str]) -> JobConfig:
    """The JobConfig `python launch.py OVERRIDES` would run: for the tools beside the launcher
    (plan, calibrate)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_job_config(compose(config_name="config", overrides=overrides))


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
        lines.append(f"{top.name}:")
        for f in dataclasses.fields(top.default_factory):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = default.value if isinstance(default, enum.Enum) else default
            if isinstance(default, list):
                shown = [x.value if isinstance(x, enum.Enum) else x for x in default]
            text = f.metadata.get("doc", "")
            enum_type = choice_enum(top.default_factory, f.name)
            if enum_type is not None:
                text = f"{' | '.join(m.value for m in enum_type)}: {text}"
            lines.append(f"  {f.name} = {shown!r}\n      {text}")
    return "\n".join(lines)


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
    # layouts (titan_exp.plan --write-sweep), from sweeps/.
    for group, folder in sweep_groups().items():
        for preset in sorted(folder.glob("*.yaml")):
            cs.store(group=group, name=preset.stem, node=OmegaConf.load(preset), package="_global_")
    template = (
        "== titan_exp ==\n"
        "Train Llama-family models with N-D parallelism.\n"
        "  python launch.py [group=option ...] [key=value ...]   e.g. parallelism=fsdp cluster.nproc_per_node=2\n"
        "  python launch.py --cfg job                            print the composed config\n"
        "  python launch.py -m key=a,b                           sweep (Hydra multirun)\n\n"
        "== Config groups ==\n$APP_CONFIG_GROUPS\n\n"
        "== Fields (default, doc) ==\n" + help_text().replace("$", "$$") + "\n\n"
        "Hydra's own options: python launch.py --hydra-help\n"
    )
    cs.store(group="hydra/help", name="titan_exp", node={"app_name": "titan_exp", "header": "", "footer": "", "template": template})
