"""Objects built the Hydra way: the trainer, model, optimizer, lr schedule and data loader are
each made by `hydra.utils.instantiate` from the `_target_` of their config node, so a user's
class plugs in from the command line (`optimizer._target_=torch.optim.SGD`) or their own config,
without editing the package.

What each `_target_` is called with (the typed schema stays the one source of every value):

    training._target_      (job, run_dir, device)                 -> a Trainer (titan_exp.train.trainer)
    model._target_         (model_config)                         -> an nn.Module shaped like models.llama.Transformer
    optimizer._target_     (params, lr=, betas=, eps=, weight_decay=, foreach=)   -> a torch Optimizer
    lr_scheduler._target_  (optimizer, lr_lambda=, total_steps=)  -> a torch LRScheduler
    data._target_          (dataset, tokenizer, text_field=, seq_len=, global_batch_size=,
                            local_batch_size=, dp_rank=, dp_degree=, prefetch=)
                                                                  -> a loader like data.loader.PackedLoader

A keyword argument is offered, not forced: the target gets those its signature names (all of
them when it takes **kwargs), so torch.optim.SGD simply goes without `betas`. The node's `kwargs`
dict adds or overrides keyword arguments (`+optimizer.kwargs.momentum=0.9`).

A `_target_` must lie under an allowed prefix: titan_exp, torch.optim, torch.nn, or one the user
adds with `allowed_targets=[mylab]` (a prefix names whole modules: `mylab` allows `mylab.Lion`,
not `mylabs.x`). Modules that run code or touch files (os, subprocess, builtins, ...) cannot be
added. The guard checks the command line and config files before Hydra reads them; `check`
checks the composed job before anything is spawned, and every rank checks it again.
"""

from __future__ import annotations

import inspect
import pydoc
from typing import Any

from titan_exp.config import JobConfig, problem

BUILTIN_PREFIXES = ("titan_exp", "torch.optim", "torch.nn")
# Modules no `allowed_targets` entry may open: calling into them runs code, spawns processes
# or touches files, whatever the arguments look like.
REFUSED_PREFIXES = ("builtins", "os", "posix", "sys", "subprocess", "shutil", "importlib", "runpy", "pickle",
                    "marshal", "code", "codeop", "pty", "ctypes", "socket", "multiprocessing", "pathlib",
                    "tempfile", "io", "hydra.utils", "hydra._internal", "operator", "functools", "eval", "exec")
NODES = ("training", "model", "optimizer", "lr_scheduler", "data")


def _under(name: str, prefix: str) -> bool:
    """Whether dotted `name` is the module path `prefix` or inside it (whole components only)."""
    prefix = prefix.rstrip(".")
    return bool(prefix) and (name == prefix or name.startswith(prefix + "."))


def allowed(target: str, extra: list[str] | tuple[str, ...] = ()) -> bool:
    return any(_under(str(target), p) for p in (*BUILTIN_PREFIXES, *extra))


def prefix_problem(prefix: str) -> str | None:
    """Why `prefix` may not be added to allowed_targets, or None."""
    p = str(prefix).rstrip(".")
    if not p:
        return "an empty prefix would allow everything; name your module, e.g. allowed_targets=[mylab]"
    bad = [r for r in REFUSED_PREFIXES if _under(r, p) or _under(p, r)]
    if bad:
        return (f"would allow {bad[0]}.*, which runs code or touches files whatever the config says; "
                "name only your own module")
    return None


def check(job: JobConfig, cuda: bool) -> list[str]:
    """Every allowed_targets entry and every node's `_target_`: allowed, importable, callable."""
    errors = [problem("allowed_targets", p, why) for p in job.allowed_targets if (why := prefix_problem(p))]
    extra = [p for p in job.allowed_targets if not prefix_problem(p)]
    for name in NODES:
        target = getattr(job, name)._target_
        field = f"{name}._target_"
        if not allowed(target, extra):
            errors.append(problem(field, target,
                                  f"is not under an allowed prefix ({', '.join(BUILTIN_PREFIXES + tuple(extra))}); "
                                  f"if it is your own code, add its module: allowed_targets=[{target.split('.')[0]}]"))
            continue
        try:
            obj, takes = _located(target)
        except pydoc.ErrorDuringImport as exc:
            errors.append(problem(field, target, f"its module fails to import ({exc.exc.__name__}: {exc.value})"))
            continue
        if obj is None:
            errors.append(problem(field, target, "no such class or function; check the spelling, and that its module "
                                                 "is on PYTHONPATH for the launcher and the ranks"))
            continue
        if not callable(obj):
            errors.append(problem(field, target, "is not a class or function"))
            continue
        for key, value in getattr(job, name).kwargs.items():
            if takes is not None and key not in takes:
                errors.append(problem(f"{name}.kwargs.{key}", value, f"{target} takes no argument {key!r}; it takes "
                                                                     f"{', '.join(takes)}"))
    return errors


def takes(target: str, key: str) -> bool:
    """Whether `target` takes the keyword argument `key` (True where it takes any, or where it
    cannot be imported: `check` reports that)."""
    obj, names = _located(target)
    return obj is None or names is None or key in names


_LOCATED: dict[str, tuple[Any, list[str] | None]] = {}


def _located(target: str) -> tuple[Any, list[str] | None]:
    """What Hydra will import for `target` (pydoc.locate, without Hydra's error log) and the keyword
    arguments it names; a callable found is kept for the process (the planner validates thousands
    of layouts of one config), a miss is looked up again."""
    if target not in _LOCATED:
        obj = pydoc.locate(target)
        if obj is None or not callable(obj):
            return obj, None
        _LOCATED[target] = obj, _parameters(obj)
    return _LOCATED[target]


def _parameters(target: Any) -> list[str] | None:
    """The keyword arguments `target` names, or None when it takes any (**kwargs) or has no signature."""
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]


def _accepted(target: Any, offered: dict[str, Any]) -> dict[str, Any]:
    """The offered keyword arguments `target`'s signature takes (all, when it takes **kwargs)."""
    takes = _parameters(target)
    return dict(offered) if takes is None else {k: v for k, v in offered.items() if k in takes}


def build(job: JobConfig, name: str, *args: Any, **offered: Any) -> Any:
    """`job.<name>._target_` instantiated by Hydra with `args`, the offered keyword arguments it
    takes, and the node's `kwargs`. The allow-list is checked again here: nothing gets built
    that `check` would refuse."""
    from hydra.utils import get_object, instantiate

    node = getattr(job, name)
    extra = [p for p in job.allowed_targets if not prefix_problem(p)]
    if not allowed(node._target_, extra):
        raise ValueError(problem(f"{name}._target_", node._target_, "is not allowed (see allowed_targets)"))
    kwargs = dict(node.kwargs)
    offered = {k: v for k, v in _accepted(get_object(node._target_), offered).items() if k not in kwargs}
    # _partial_: Hydra builds a partial from the config (target and plain kwargs); the Python
    # objects (parameters, the model config, a device) are then passed directly, never through
    # OmegaConf.
    factory = instantiate({"_target_": node._target_, "_partial_": True, **kwargs}, _convert_="all")
    return factory(*args, **offered)
