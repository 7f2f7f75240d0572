"""What `launch.py` refuses before Hydra composes anything.

  - A key that no schema has (a typo) gets "did you mean ...?" with the whole key to type
    instead of Hydra's "Key 'x' is not in struct"; so does a preset that is not there
    (`parallelism=fsdpp`). Presets and groups come from every folder Hydra searches: ours,
    `--config-dir`, `hydra.searchpath`, so a user's `model=mine` or `+experiment=NAME` goes through.
  - `_target_` may only name an allow-listed callable. Hydra instantiates whatever a `_target_`
    names (its callbacks, for one), so a config or an override must not be able to say
    `_target_: os.system`. Checked in the overrides and in every config file Hydra would read
    (conf/, --config-dir, hydra.searchpath), before Hydra instantiates anything; the user adds
    their own modules with `allowed_targets` (titan_exp.targets says which may not be added).
  - A value of the wrong type (`training.steps=ten`) or a float that is NaN or +/-inf where its
    field takes no such value (titan_exp.config.values) gets one line naming the field, the value
    and what it must be, instead of Hydra's multi-line error.
  - hydra.run.dir / hydra.sweep.dir must be writable (Hydra would fail with a traceback).
  - hydra/launcher=submitit_*: it would start a member as one process; cluster=slurm is the way.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from pathlib import Path
from typing import Any, Iterator

import yaml

from titan_exp import targets
from titan_exp.config import CONF, JobConfig, sweep_groups
from titan_exp.config.compose import choice_enum
from titan_exp.config.values import override_errors
from titan_exp.files import unwritable

# Ours, and Hydra's own callbacks (not hydra.utils, whose call/instantiate would run anything);
# the user adds modules with allowed_targets=[...] on the command line or in their config.
ALLOWED_TARGETS = (*targets.BUILTIN_PREFIXES, "hydra.experimental.callbacks")
# Keys that were renamed: what to type now.
RENAMED = {"optimizer.name": "optimizer._target_ names the class now, e.g. optimizer._target_=torch.optim.Adam"}


def _close(word: str, choices: list[str]) -> list[str]:
    return difflib.get_close_matches(word, choices, n=3, cutoff=0.6) or [c for c in choices if c in word or word in c]


def _did_you_mean(word: str, choices: list[str], prefix: str = "", rest: list[str] = ()) -> str:
    """The close choices, each as the whole key to type: `prefix`, the choice and, for a mistyped
    node of a dotted key, the `rest` of the key (its field corrected too)."""
    close = _close(word, choices)
    if close:
        return f"did you mean {' or '.join(prefix + _completed(c, list(rest)) for c in close)}?"
    return f"choose from {', '.join(prefix + c for c in sorted(choices))}"


def _completed(node: str, rest: list[str]) -> str:
    """`node` followed by the rest of a key typed under a misspelt node: its field as typed when
    the schema's node has it, else the closest field it has, else the node alone."""
    schema = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}.get(node)
    if not rest or not dataclasses.is_dataclass(schema):
        return ".".join([node, *rest])
    fields = [f.name for f in dataclasses.fields(schema)]
    if rest[0] in fields:
        return ".".join([node, *rest])
    close = difflib.get_close_matches(rest[0], fields, n=1, cutoff=0.6)
    return f"{node}.{close[0]}" if close else node


def _presets(group: str, folders: list[Path]) -> list[str]:
    """A group's presets in every config folder Hydra will search (ours, --config-dir,
    hydra.searchpath), and the named sweeps."""
    places = sweep_groups().get(group, [])
    return sorted({p.stem for folder in [*places, *(f / group for f in folders)] for p in folder.glob("*.yaml")})


@functools.lru_cache(maxsize=None)
def _groups(folders: tuple[Path, ...]) -> set[str]:
    return set(sweep_groups()) | {d.name for f in folders if f.is_dir() for d in f.iterdir()
                                  if d.is_dir() and not d.name.startswith(".") and any(d.glob("*.yaml"))}


def key_errors(key: str, value: Any, *, is_add: bool, folders: list[Path] = (CONF,), typed: bool = True) -> list[str]:
    """A problem with an override's key, with the preset it selects or (`typed`: a value to check)
    with its value's type. A group any config folder has (`+experiment=NAME`, a user's `model=mine`
    from --config-dir) is Hydra's to compose."""
    parts = key.split(".")
    top = {f.name: f for f in dataclasses.fields(JobConfig)}
    if parts[0].split("/")[0] == "hydra":
        return []
    groups = _groups(tuple(folders))
    if len(parts) == 1 and parts[0] in groups:  # a group: the value names a preset
        presets = _presets(parts[0], list(folders))
        if presets and isinstance(value, str) and value not in presets:
            where = "" if is_add else f" in {parts[0]}/ of " + ", ".join(
                "conf" if f == CONF else str(f) for f in folders)
            return [f"{'+' if is_add else ''}{key}={value}: no such preset{where}; {_did_you_mean(value, presets)}"]
        return []
    if key in RENAMED:
        return [f"{key}: renamed; {RENAMED[key]}"]
    if parts[0] not in top:
        return [f"{key}: unknown key; {_did_you_mean(parts[0], sorted(set(top) | groups), rest=parts[1:])}"]
    schema, where = top[parts[0]].default_factory, parts[0]
    for name in parts[1:]:  # down the schema's nodes (optimizer.muon.lr)
        if not dataclasses.is_dataclass(schema):
            break
        fields = {f.name: f for f in dataclasses.fields(schema)}
        if name not in fields:
            return [f"{key}: unknown key; {_did_you_mean(name, list(fields), prefix=where + '.')}"]
        enum_type = choice_enum(schema, name)
        choices = [m.value for m in enum_type] if enum_type is not None else []
        values = value if isinstance(value, list) else [value]
        wrong = [v for v in values if isinstance(v, str) and choices and v not in choices]
        if wrong:
            return [f"{key}={wrong[0]}: not a choice; {_did_you_mean(wrong[0], choices)}"]
        schema, where = fields[name].default_factory, f"{where}.{name}"
    return override_errors(key, value) if typed else []


def _targets(node: Any, where: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "_target_":
                yield where, v
            yield from _targets(v, f"{where}.{k}" if where else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _targets(v, f"{where}[{i}]")


def target_errors(node: Any, where: str, extra: list[str] = ()) -> list[str]:
    """Each `_target_` in `node` (found at `where`) outside the allow-list and the user's `extra`."""
    allowed = (*ALLOWED_TARGETS, *extra)
    return [f"{place}: _target_ {value!r} is not allowed; a config may only instantiate "
            f"{', '.join(p + '.*' for p in allowed)}; "
            f"add your own module with allowed_targets=[{str(value).split('.')[0]}]"
            for place, value in _targets(node, where) if not any(targets.allowed(str(value), [p]) for p in allowed)]


def _config_files(folders: list[Path]) -> Iterator[tuple[Path, Any]]:
    """Every config file Hydra could read from these folders, parsed (check_argv reads them once)."""
    for folder in folders:
        for path in sorted(folder.rglob("*.yaml")):
            if ".hydra" in path.relative_to(folder).parts:
                continue  # a run's record of what Hydra composed (its own launcher's _target_), not a config
            try:
                yield path, yaml.safe_load(path.read_text())
            except (OSError, yaml.YAMLError):
                continue  # Hydra reports an unreadable file itself


def allowed_prefixes(files: list[tuple[Path, Any]], overrides: list[Any]) -> tuple[list[str], list[str]]:
    """The modules the user added with `allowed_targets` (command line and their config files),
    and an error for each that may not be added."""
    added = [str(p) for o in overrides if o.key_or_group == "allowed_targets" and not o.is_delete()
             for p in (o.value() if isinstance(o.value(), list) else [o.value()])]
    added += [str(p) for _, node in files if isinstance(node, dict)
              for p in (node.get("allowed_targets") or [])]
    errors = [f"allowed_targets: {p!r} {why}" for p in added if (why := targets.prefix_problem(p))]
    return [p for p in added if not targets.prefix_problem(p)], errors


def config_file_errors(folders: list[Path], extra: list[str] = (),
                       files: list[tuple[Path, Any]] | None = None) -> list[str]:
    files = list(_config_files(folders)) if files is None else files
    return [f"{path}: {e}" for path, node in files for e in target_errors(node, "", extra)]


def check_argv(argv: list[str]) -> list[str]:
    """Every problem guard finds in a `launch.py` command line (empty: hand it to Hydra)."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    args, _ = get_args_parser().parse_known_args(argv)
    try:
        overrides = OverridesParser.create().parse_overrides(args.overrides)
    except HydraException:
        return []  # Hydra's own message about its syntax is better than ours
    folders = [CONF] + ([Path(args.config_dir)] if args.config_dir else [])
    for o in overrides:  # hydra.searchpath adds folders, wherever it stands on the line
        if o.key_or_group == "hydra.searchpath":
            folders += [Path(str(p).removeprefix("file://")) for p in (o.value() or []) if str(p).startswith("file://")]
    files = list(_config_files(folders))
    extra, errors = allowed_prefixes(files, overrides)
    for o in overrides:
        key = o.key_or_group + (f"@{o.package}" if o.package else "")
        if o.is_sweep_override() and not (o.is_discrete_sweep() or o.is_range_sweep()):
            values = []  # interval(a,b) for optimising sweepers: numbers, nothing to look up; the key still is
            errors += key_errors(o.key_or_group, None, is_add=o.is_add() or o.is_force_add(), folders=folders,
                                 typed=False)
        else:
            values = list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
        for value in values:
            parent, _, leaf = o.key_or_group.rpartition(".")
            if leaf == "_target_":
                errors += target_errors({"_target_": value}, parent, extra)
            else:
                errors += target_errors(value, key, extra)
            if not o.is_delete():
                errors += key_errors(o.key_or_group, value, is_add=o.is_add() or o.is_force_add(), folders=folders)
        if o.key_or_group in ("hydra.run.dir", "hydra.sweep.dir") and isinstance(o.value(), str):
            if (problem := unwritable(Path(o.value()))) is not None:
                errors.append(f"{o.key_or_group} = {o.value()!r}: cannot write there ({problem}); "
                              "choose a writable directory")
        if o.key_or_group == "hydra/launcher" and str(o.value()).startswith("submitit"):
            errors.append(f"hydra/launcher={o.value()}: Hydra's submitit launcher would start each member as one "
                          "process, not as this toolkit's ranks; use cluster=slurm (a multirun's members go out as "
                          "job arrays) or cluster=local")
    return list(dict.fromkeys(errors + config_file_errors(folders, extra, files)))
