"""Muon (optimizer=muon): orthogonalised momentum for the transformer blocks' weight matrices,
AdamW for every other parameter, in one torch optimizer per model part.

The matrices (`is_matrix`): each block's attention and feed-forward projections, its shared
experts', and each routed expert's matrix on its own (a (E, out, in) weight is E matrices); not
the embeddings, the output, the norms or the routers. Their update is torch.optim.Muon's
(torch/optim/_muon.py): momentum as an exponential average (`lerp`), Nesterov optional, five
Newton-Schulz iterations with Keller Jordan's quintic coefficients, decoupled weight decay, and
the lr scaled by the matrix's shape. Newton-Schulz here is torch's, line by line, over a stack of
matrices too; in bfloat16 it gives torch's bits (tests/unit/test_muon.py).

torch.optim.Muon orthogonalises whatever tensor it holds: under FSDP2 or TP that is a shard, and
the orthogonal factor of a shard is not the shard of the matrix's. Here a sharded (DTensor)
update is first redistributed so each rank holds whole matrices (all of it, or under expert
parallel its own experts whole), orthogonalised, and the rank's shard taken back: the update of
every layout is the one-process update (tests/ranks/test_muon_layouts.py). The momentum buffer is
elementwise, so it stays sharded like the parameter and checkpoints reshard it as AdamW's moments.
Every rank of a mesh orthogonalises every matrix the gather gives it: one more all-gather of each
matrix a step, and each rank does the whole model's Newton-Schulz (docs/configs.md#optimizer).
"""

from __future__ import annotations

import functools
import math
import pydoc
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from titan_exp.config import JobConfig, ModelConfig, OptimizerConfig, problem

# Keller Jordan's quintic (torch.optim._muon's DEFAULT_A, _B, _C) and step count.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
ADAMW_STATE = ("exp_avg", "exp_avg_sq", "step")  # torch.optim.AdamW's state of a parameter
MUON_STATE = ("momentum_buffer",)
# Module names that wrappers insert into a parameter's name (activation checkpointing, compile).
WRAPPERS = {"_checkpoint_wrapped_module", "_orig_mod"}


def is_matrix(fqn: str, shape: torch.Size | tuple[int, ...]) -> bool:
    """Whether Muon updates the parameter `fqn`: a weight matrix (or a stack of routed experts'
    matrices) of a transformer block, other than its router's. Everything else is AdamW's."""
    parts = [p for p in fqn.split(".") if p not in WRAPPERS]
    return parts[0] == "layers" and len(shape) in (2, 3) and "router" not in parts


@functools.cache
def routes(target: str) -> bool:
    """Whether optimizer._target_ names this Muon (or a subclass), which takes its parameters
    as the two groups `param_groups` makes (a target that fails to import does not: targets.check
    says why)."""
    try:
        found = pydoc.locate(target)
    except pydoc.ErrorDuringImport:
        return False
    return isinstance(found, type) and issubclass(found, Muon)


def param_groups(part: torch.nn.Module, o: OptimizerConfig) -> list[dict[str, Any]]:
    """The part's parameters as Muon's group (the matrices, with optimizer.muon's settings) and
    AdamW's (the rest, with the optimizer's own); a group with no parameters is left out (a
    pipeline stage holding only the embedding has no matrices)."""
    m = o.muon
    named = list(part.named_parameters())
    on_gpu = any(p.device.type == "cuda" for _, p in named)
    matrices, rest = [], []
    for name, p in named:
        (matrices if is_matrix(name, p.shape) else rest).append(p)
    muon = {"params": matrices, "muon": True, "lr": o.lr if m.lr is None else m.lr,
            "weight_decay": o.weight_decay if m.weight_decay is None else m.weight_decay,
            "momentum": m.momentum, "nesterov": m.nesterov, "ns_coefficients": tuple(m.ns_coefficients),
            "ns_steps": m.ns_steps, "ns_eps": m.eps, "adjust_lr_fn": m.adjust_lr.value,
            "ns_dtype": m.ns_dtype.value if m.ns_dtype is not None else ("bfloat16" if on_gpu else "float32")}
    return [g for g in (muon, {"params": rest}) if g["params"]]


def state_names(o: OptimizerConfig, fqns: Iterable[tuple[str, torch.Size]]) -> dict[str, tuple[str, ...]] | None:
    """The state a checkpoint holds for each parameter (name, shape) under this optimizer:
    Muon's momentum for its matrices, AdamW's moments otherwise; None for an optimizer whose
    state is not known here (its rank's load says what does not fit)."""
    if routes(o._target_):
        return {name: MUON_STATE if is_matrix(name, shape) else ADAMW_STATE for name, shape in fqns}
    if o._target_ in ("torch.optim.AdamW", "torch.optim.Adam"):
        amsgrad = ("max_exp_avg_sq",) if o.kwargs.get("amsgrad") else ()
        return {name: ADAMW_STATE + amsgrad for name, _ in fqns}
    return None


def check(job: JobConfig) -> list[str]:
    """optimizer.muon's fields, and torch.optim.Muon named directly."""
    o, m, e = job.optimizer, job.optimizer.muon, []
    if o._target_ == "torch.optim.Muon":
        e.append(problem("optimizer._target_", o._target_,
                         "orthogonalises whatever tensor it holds (a shard under FSDP or TP) and takes only 2-D "
                         "parameters; use optimizer=muon (titan_exp.train.muon.Muon: whole matrices on every "
                         "layout, AdamW for the rest)"))
    if not routes(o._target_):
        return e
    if m.lr is not None and not m.lr > 0:
        e.append(problem("optimizer.muon.lr", m.lr, "must be > 0, or null for optimizer.lr"))
    if m.weight_decay is not None and m.weight_decay < 0:
        e.append(problem("optimizer.muon.weight_decay", m.weight_decay, "must be >= 0, or null for "
                                                                        "optimizer.weight_decay"))
    if not 0 <= m.momentum < 1:
        e.append(problem("optimizer.muon.momentum", m.momentum, "must be in [0, 1), e.g. 0.95"))
    if len(m.ns_coefficients) != 3:
        e.append(problem("optimizer.muon.ns_coefficients", m.ns_coefficients,
                         f"must be three numbers (a, b, c), e.g. [{', '.join(map(str, NS_COEFFICIENTS))}]"))
    if not 1 <= m.ns_steps < 100:
        e.append(problem("optimizer.muon.ns_steps", m.ns_steps, f"must be in [1, 100), e.g. {NS_STEPS}"))
    if not m.eps > 0:
        e.append(problem("optimizer.muon.eps", m.eps, "must be > 0, e.g. 1e-7"))
    return e


class Muon(torch.optim.AdamW):
    """AdamW over the groups without `muon`, Muon over the groups with `"muon": True` (their
    parameters 2-D matrices or 3-D stacks of them). A Muon group's settings default to this
    constructor's; `param_groups` sets them from the config."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, foreach: bool | None = None, fused: bool | None = None,
                 momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, ns_steps: int = NS_STEPS,
                 ns_eps: float = 1e-7, ns_dtype: str = "float32", adjust_lr_fn: str = "original"):
        self._muon_defaults = {"momentum": momentum, "nesterov": nesterov, "ns_coefficients": tuple(ns_coefficients),
                               "ns_steps": ns_steps, "ns_eps": ns_eps, "ns_dtype": ns_dtype,
                               "adjust_lr_fn": adjust_lr_fn}
        super().__init__(params, lr, betas, eps, weight_decay, foreach=foreach, fused=fused)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        muon = bool(param_group.get("muon"))
        param_group["muon"] = muon
        for key, value in self._muon_defaults.items() if muon else ():
            param_group.setdefault(key, value)
        super().add_param_group(param_group)
        flat = [p for p in self.param_groups[-1]["params"] if p.ndim not in (2, 3)]
        if muon and flat:
            raise ValueError(f"Muon updates matrices (2-D) and stacks of them (3-D); a parameter of shape "
                             f"{tuple(flat[0].shape)} belongs in a group without muon=True (AdamW's)")

    def __setstate__(self, state: dict[str, Any]) -> None:
        """torch's Adam upgrades every loaded parameter state's `step`, which a Muon group's state
        has not: it gets the AdamW groups only, then every group is back in its place."""
        groups = state["param_groups"]
        super().__setstate__({**state, "param_groups": [g for g in groups if not g.get("muon")]})
        self.param_groups = groups

    def _init_group(self, group, params_with_grad, grads, *states):
        """AdamW's pass (torch's Adam.step) gathers no parameter of a Muon group: `step` updates those."""
        if group["muon"]:
            return False
        return super()._init_group(group, params_with_grad, grads, *states)

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            if group["muon"]:
                for p in group["params"]:
                    if p.grad is not None:
                        self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        """torch.optim.Muon's update of one parameter (torch.optim._muon._single_tensor_muon),
        orthogonalising whole matrices."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        buf, grad, momentum = state["momentum_buffer"], p.grad, group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        update = orthogonalised(update, group["ns_coefficients"], group["ns_steps"], group["ns_eps"],
                                getattr(torch, group["ns_dtype"]))
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update, alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], p.shape))


def adjusted_lr(lr: float, adjust_lr_fn: str, shape: torch.Size) -> float:
    """The lr for a matrix of `shape` (a stack's: each matrix's, out A x in B): torch.optim.Muon's
    two rules, "original" sqrt(max(1, A / B)) and "match_rms_adamw" 0.2 sqrt(max(A, B))."""
    a, b = shape[-2:]
    return lr * (0.2 * math.sqrt(max(a, b)) if adjust_lr_fn == "match_rms_adamw" else math.sqrt(max(1, a / b)))


def newton_schulz(x: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation (torch.optim._muon._zeropower_via_newtonschulz) in
    `dtype`, of a matrix or of each matrix of a stack (..., A, B): normed to spectral norm <= 1,
    then `steps` quintic iterations on the wide orientation."""
    a, b, c = coefficients
    y = x.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        y = y.mT
    y = y / y.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    mm = torch.addmm if y.ndim == 2 else torch.baddbmm
    for _ in range(steps):
        gram = y @ y.mT
        y = mm(y, mm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    return y.mT if tall else y


def newton_schulz_matmuls(rows: int, cols: int, steps: int = NS_STEPS) -> list[tuple[int, int, int]]:
    """The matmuls `newton_schulz` runs on one rows x cols matrix, as (m, n, k) for (m x k) @ (k x n):
    each step, on the wide orientation (a x b, a <= b), the Gram matrix y y^T, its square inside the
    quintic, and that times y."""
    a, b = sorted((rows, cols))
    return [(a, a, b), (a, a, a), (a, b, a)] * steps


def newton_schulz_flops(rows: int, cols: int, steps: int = NS_STEPS) -> float:
    """FLOPs of `newton_schulz` on one rows x cols matrix: steps x (4 a^2 b + 2 a^3), a <= b."""
    return float(sum(2 * m * n * k for m, n, k in newton_schulz_matmuls(rows, cols, steps)))


def orthogonalised(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """Newton-Schulz of `update`'s whole matrices, laid out as `update` is. A DTensor is
    redistributed so that each rank holds whole matrices (replicated, or for a stack still split
    between ranks along the stack's dim 0, whole experts each), orthogonalised there, and each
    rank keeps its own shard of the result (no communication: a slice)."""
    if not isinstance(update, DTensor):
        return newton_schulz(update, coefficients, steps, eps, dtype)
    mesh, placements = update.device_mesh, update.placements
    whole = [p if update.ndim == 3 and p.is_shard(0) else Replicate() for p in placements]
    local = newton_schulz(update.redistribute(mesh, whole).to_local(), coefficients, steps, eps, dtype)
    result = DTensor.from_local(local.contiguous(), mesh, whole, shape=update.shape, stride=update.stride())
    return result.redistribute(mesh, placements)


def block_norm_params(m: ModelConfig) -> float:
    """One block's norms (two, and QK-norm's or MLA's latent norms) in ModelConfig's counts: with
    its router, the block's parameters `is_matrix` leaves to AdamW. The planner counts one moment
    (Muon's momentum) for the rest of a block where AdamW keeps two."""
    return 2 * m.dim + ((m.kv_lora_rank + m.q_lora_rank) if m.mla else 2 * m.head_size * m.qk_norm)
