"""lm-eval's tasks: which exist (the user's own in eval.include_path, and lm-eval's), and its
results as {task: {metric: value}}."""

from __future__ import annotations

import difflib
from typing import Any

from titan_exp.config import JobConfig, problem


def task_manager(tasks: list[str], include_path: str | None) -> Any:
    """An lm-eval TaskManager that knows `tasks`, the cheapest that does: the user's directory
    alone when it holds them all (instant), else with lm-eval's own index too (seconds: it reads
    thousands of YAMLs)."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if all(task in own.all_tasks for task in tasks):
            return own
    return TaskManager(include_path=include_path)


def task_errors(job: JobConfig) -> list[str]:
    """Each task of eval.tasks that neither eval.include_path nor lm-eval has, with close names."""
    ev = job.eval
    if not ev.enable or not ev.tasks:
        return []
    known = task_manager(list(ev.tasks), ev.include_path).all_tasks
    errors = []
    for task in ev.tasks:
        if task in known:
            continue
        close = difflib.get_close_matches(task, known, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "`lm_eval ls tasks` lists lm-eval's"
        where = f"in {ev.include_path} nor " if ev.include_path else ""
        errors.append(problem("eval.tasks", task, f"no such lm-eval task {where}among lm-eval's own; {hint}"))
    return errors


def metric_name(key: str) -> str | None:
    """lm-eval's `metric,filter` result key as one name (`acc,none` -> acc, `exact_match,flexible-extract`
    -> exact_match_flexible-extract); None for the keys that are not metrics (alias, sample_len)."""
    if "," not in key:
        return None
    metric, filtered = key.split(",", 1)
    return metric if filtered == "none" else f"{metric}_{filtered}"


def metrics_of(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """lm-eval's `results` ({task: {"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": ...}}) as
    {task: {metric: value}}, numbers only (a standard error lm-eval could not compute is "N/A")."""
    table: dict[str, dict[str, float]] = {}
    for task, values in results.items():
        row = {}
        for key, value in values.items():
            name = metric_name(key)
            if name is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
                row[name] = float(value)
        table[task] = row
    return table
