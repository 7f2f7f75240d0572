"""The autotune group's rules (the search itself is titan_exp.perf.autotune's, which sits above
validation: it plans and measures the candidates)."""

from __future__ import annotations

from titan_exp.config.schema import AutotuneAxis, JobConfig, problem


def check(job: JobConfig, cuda: bool) -> list[str]:
    a, e = job.autotune, []
    if a.top_k is not None and a.top_k < 1:
        e.append(problem("autotune.top_k", a.top_k, "must be >= 1, or null for every candidate that may be the fastest"))
    if not a.budget_minutes > 0:
        e.append(problem("autotune.budget_minutes", a.budget_minutes, "must be > 0"))
    if not 0 <= a.drop_slower_than < 1:
        e.append(problem("autotune.drop_slower_than", a.drop_slower_than, "a share of the fastest: 0 <= it < 1 (0: never)"))
    if not 0 <= a.tolerance < 1:
        e.append(problem("autotune.tolerance", a.tolerance, "a share of the fastest: 0 <= it < 1"))
    if a.device_memory_gib is not None and not a.device_memory_gib > 0:
        e.append(problem("autotune.device_memory_gib", a.device_memory_gib, "must be > 0, or null for this GPU's / RAM per rank"))
    if not a.search:
        e.append(problem("autotune.search", [], "name at least one axis, e.g. [layout]"))
    splits = [s.value for s in a.search if s in (AutotuneAxis.local_batch_size, AutotuneAxis.microbatch_size)]
    if splits:
        e.append(problem("autotune.search", [s.value for s in a.search],
                         f"{', '.join(splits)}: every split of the global batch (local batch, PP microbatch) is a "
                         "candidate already; drop it"))
    if len(set(a.search)) != len(a.search):
        e.append(problem("autotune.search", [s.value for s in a.search], "lists an axis twice"))
    return e
