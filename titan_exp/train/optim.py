"""The optimizer, the learning-rate schedule and gradient clipping: their config checks and how
they are built."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_exp import targets
from titan_exp.config import DecayType, JobConfig, LRSchedulerConfig, OptimizerImpl, problem
from titan_exp.train import muon


def check(job: JobConfig, cuda: bool) -> list[str]:
    e: list[str] = []
    o, s, steps = job.optimizer, job.lr_scheduler, job.training.steps
    if job.training.max_norm < 0:
        e.append(problem("training.max_norm", job.training.max_norm, "must be >= 0 (0 disables clipping)"))
    if not o.lr > 0:
        e.append(problem("optimizer.lr", o.lr, "must be > 0"))
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(o, name) < 1:
            e.append(problem(f"optimizer.{name}", getattr(o, name), "must be in [0, 1)"))
    if not o.eps > 0:
        e.append(problem("optimizer.eps", o.eps, "must be > 0"))
    if o.weight_decay < 0:
        e.append(problem("optimizer.weight_decay", o.weight_decay, "must be >= 0"))
    asked = {OptimizerImpl.fused: "fused", OptimizerImpl.foreach: "foreach"}.get(o.implementation)
    if asked and not targets.takes(o._target_, asked):
        e.append(problem("optimizer.implementation", o.implementation, f"{o._target_} takes no {asked}= argument; "
                                                                       "use auto, which runs what it offers"))
    if not 0 <= s.warmup_steps <= steps:
        e.append(problem("lr_scheduler.warmup_steps", s.warmup_steps, f"must be in [0, training.steps = {steps}]"))
    if s.decay_ratio is not None and not 0 <= s.decay_ratio <= 1:
        e.append(problem("lr_scheduler.decay_ratio", s.decay_ratio, "must be in [0, 1] or null"))
    elif s.decay_ratio is not None and s.warmup_steps + round(s.decay_ratio * steps) > steps:
        e.append(problem("lr_scheduler.decay_ratio", s.decay_ratio,
                         "warmup plus decay steps exceed training.steps; lower one of them"))
    if not 0 <= s.min_lr_factor <= 1:
        e.append(problem("lr_scheduler.min_lr_factor", s.min_lr_factor, "must be in [0, 1]"))
    return e + muon.check(job)


def lr_lambda(cfg: LRSchedulerConfig, steps: int):
    """Warmup-stable-decay as a multiplier of the peak lr, for optimizer step s = 1..steps."""
    warmup = cfg.warmup_steps
    decay = round(cfg.decay_ratio * steps) if cfg.decay_ratio is not None else steps - warmup
    decay_start = steps - decay
    curves = {
        DecayType.linear: lambda progress: 1.0 - progress,
        DecayType.sqrt: lambda progress: 1.0 - math.sqrt(progress),
        DecayType.cosine: lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    }

    def factor(last_epoch: int) -> float:
        s = last_epoch + 1
        if s <= warmup:
            return s / warmup
        if s <= decay_start or decay <= 0:
            return 1.0
        progress = min(1.0, (s - decay_start) / decay)
        return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * curves[cfg.decay_type](progress)

    return factor


def build_optimizers(model_parts: list[torch.nn.Module], job: JobConfig
                     ) -> tuple[list[torch.optim.Optimizer], list[torch.optim.lr_scheduler.LRScheduler]]:
    """One optimizer (and lr schedule) per model part, as TorchTitan does: each part's optimizer
    state is then keyed by that part's FQNs, which are the unsplit model's, so checkpoints move
    between pipeline and non-pipeline layouts. The update is elementwise, so this gives the same
    numbers as one optimizer over every parameter. Both are built from their `_target_`
    (titan_exp.targets), offered the typed fields; Muon (optimizer=muon) gets each part's
    parameters as its two groups (titan_exp.train.muon.param_groups)."""
    o, steps = job.optimizer, job.training.steps
    grouped = muon.routes(o._target_)
    optimizers = [
        targets.build(job, "optimizer", muon.param_groups(part, o) if grouped else part.parameters(),
                      lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                      weight_decay=o.weight_decay,
                      **kernels(o.implementation, on_gpu=any(p.device.type == "cuda" for p in part.parameters())))
        for part in model_parts
    ]
    factor = lr_lambda(job.lr_scheduler, steps)
    return optimizers, [targets.build(job, "lr_scheduler", opt, lr_lambda=factor, total_steps=steps)
                        for opt in optimizers]


def kernels(implementation: OptimizerImpl, *, on_gpu: bool) -> dict[str, bool]:
    """The optimizer's foreach= and fused= for optimizer.implementation; auto is fused where the
    parameters live on a GPU and foreach elsewhere."""
    if implementation == OptimizerImpl.auto:
        implementation = OptimizerImpl.fused if on_gpu else OptimizerImpl.foreach
    return {"foreach": implementation == OptimizerImpl.foreach, "fused": implementation == OptimizerImpl.fused}


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float, pp_group=None,
                    uncounted: list[torch.Tensor] = ()) -> torch.Tensor:
    """Total gradient norm over every parameter of the model, wherever its shards live; clips
    in place when 0 < max_norm < inf (0 and inf: no limit). Gradients on different meshes
    (expert-parallel experts beside the dense parameters) are normed per mesh, since DTensor ops
    cannot mix meshes. Under PP each rank holds some stages, so squares are summed across the
    pipeline group. `uncounted` are clipped but left out of the norm: a pipeline's copy of a tied
    embedding, whose gradient is the embedding's (parallel.pipeline.sum_tied_grads)."""
    skip = {id(p) for p in uncounted}
    by_mesh: dict[object, list[torch.Tensor]] = {}  # the parameters with a gradient, by the gradient's mesh
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group if id(p) not in skip], foreach=True)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = torch.stack(squares).sum() if squares else torch.zeros(())
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    total = total.sqrt()
    if 0 < max_norm < math.inf:
        for group in by_mesh.values():  # torch scales each parameter's .grad
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
