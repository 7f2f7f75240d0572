"""The autotune group's rules (the search itself is titan_exp.perf.autotune's, which sits above
validation: it plans and measures the candidates)."""

from __future__ import annotations

from titan_exp.config.fields import AutotuneAxis, Converter, problem
from titan_exp.config.schema import JobConfig


def check(job: JobConfig, cuda: bool) -> list[str]:
    a, e = job.autotune, []
    if a.top_k is not None and a.top_k < 1:
        e.append(problem("autotune.top_k", a.top_k,
                         "must be >= 1, or null for every candidate that may be the fastest"))
    if not a.budget_minutes > 0:
        e.append(problem("autotune.budget_minutes", a.budget_minutes, "must be > 0"))
    if not 0 <= a.drop_slower_than < 1:
        e.append(problem("autotune.drop_slower_than", a.drop_slower_than,
                         "a share of the fastest: 0 <= it < 1 (0: never)"))
    if not 0 <= a.tolerance < 1:
        e.append(problem("autotune.tolerance", a.tolerance, "a share of the fastest: 0 <= it < 1"))
    if a.device_memory_gib is not None and not a.device_memory_gib > 0:
        e.append(problem("autotune.device_memory_gib", a.device_memory_gib,
                         "must be > 0, or null for this GPU's / RAM per rank"))
    if not a.search:
        e.append(problem("autotune.search", [], "name at least one axis, e.g. [layout]"))
    splits = [s.value for s in a.search if s in (AutotuneAxis.local_batch_size, AutotuneAxis.microbatch_size)]
    if splits:
        e.append(problem("autotune.search", [s.value for s in a.search],
                         f"{', '.join(splits)}: every split of the global batch (local batch, PP microbatch) is a "
                         "candidate already; drop it"))
    if len(set(a.search)) != len(a.search):
        e.append(problem("autotune.search", [s.value for s in a.search], "lists an axis twice"))
    if AutotuneAxis.float8_filter in a.search:
        e += _float8_filter(job, cuda)
    return e


def _float8_filter(job: JobConfig, cuda: bool) -> list[str]:
    """float8_filter adds a candidate beside each float8 tensorwise or rowwise one without the
    filter: refused where there is none. (A member the search launches, its filter named in
    precision.filter_fqns, keeps the axis in its config: that is no refusal.)"""
    a, p = job.autotune, job.precision
    searched = [s.value for s in a.search]
    if AutotuneAxis.precision in a.search:  # its presets: float8's on a GPU, fp32 and bf16 on a CPU
        if cuda:
            return []
        why, fix = "the precision axis searches fp32 and bf16 on CPUs", "drop float8_filter, or search on GPUs"
    elif p.shape_filterable:
        return []
    else:
        why = f"precision.converter is {p.converter.value}" + (
            f", recipe {p.float8_recipe.value}" if p.converter == Converter.float8 else "")
        fix = "search precision too on GPUs, or set precision=float8 or float8_rowwise"
    return [problem("autotune.search", searched, f"float8_filter: no candidate trains in float8 tensorwise or "
                    f"rowwise ({why}); {fix}")]
