"""What a checkpoint holds, as DCP sees it: one Stateful adapter per part (`PARTS`).

The model is keyed by the FQNs of the unsplit model, so a checkpoint loads into any layout (FSDP
N, TP, PP, one process); the optimizer is flattened per parameter FQN, so its state reshards like
the parameters. The data position is the same on every rank: every data-parallel rank reads the
one token stream and keeps its slice of each global batch (see `titan_exp.data.loader`), so
resuming under another data-parallel degree continues the stream exactly where it stopped.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titan_exp.config import CheckpointPart
from titan_exp.parallel.pipeline import tied_copy

PARTS = tuple(p.value for p in CheckpointPart)  # model, optimizer, lr_scheduler, dataloader, train_state, rng


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ModelState:
    """Every model part (pipeline stages) of this rank as one state dict keyed by the FQNs of the
    unsplit model; DTensors stay sharded, DCP writes each shard once."""

    def __init__(self, parts: list[torch.nn.Module]):
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        return {k: v for part in self.parts for k, v in get_model_state_dict(part).items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part in self.parts:
            set_model_state_dict(part, {k: state[k] for k in get_model_state_dict(part)})


class OptimizerState:
    """One optimizer per model part, flattened to `state.<fqn>.<name>` / `param_groups.<fqn>.<key>`,
    so optimizer state reshards across layouts like the parameters. A pipeline's last stage keys its
    copy of a tied embedding (parallel.pipeline.tied_copy) by the embedding's FQN, as one process
    keys the one tied matrix: the copy's state equals the embedding's (both take the same updates)."""

    OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, parts: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]):
        self.pairs = list(zip(parts, optimizers))

    def state_dict(self) -> dict[str, Any]:
        return {saved_key(part, k): v for part, opt in self.pairs
                for k, v in get_optimizer_state_dict(part, opt, options=self.OPTIONS).items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part, opt in self.pairs:
            mine = get_optimizer_state_dict(part, opt, options=self.OPTIONS)
            set_optimizer_state_dict(part, opt, {k: loaded(state, part, k) for k in mine}, options=self.OPTIONS)


def saved_key(part: torch.nn.Module, key: str) -> str:
    """`key` of `part`'s flattened optimizer state as a checkpoint holds it: the tied copy's
    (`state.output.weight.<name>`, `param_groups.output.weight.<key>`) under the embedding's FQN."""
    kind, _, rest = key.partition(".")
    if rest.startswith("output.weight.") and tied_copy(part) is not None:
        return f"{kind}.tok_embeddings.weight.{rest.removeprefix('output.weight.')}"
    return key


def loaded(state: dict[str, Any], part: torch.nn.Module, key: str) -> Any:
    """The loaded value of `part`'s optimizer state `key`; the tied copy's tensors are its own
    (torch's optimizer keeps the tensors it loads, which a V's first rank, holding the embedding
    and its copy, would otherwise share between its two optimizers: each step would move them twice)."""
    saved = saved_key(part, key)
    return state[saved].clone() if saved != key and torch.is_tensor(state[saved]) else state[saved]


class SchedulerState:
    """The schedulers step together; one state (without the lambdas, which are code) loads into all.
    A per-group list (base_lrs, _last_lr) of another length than a scheduler's own stays its own:
    optimizer=muon gives a pipeline stage without weight matrices (the embedding alone) one group
    where the others have two."""

    def __init__(self, schedulers: list[torch.optim.lr_scheduler.LRScheduler]):
        self.schedulers = schedulers

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.schedulers[0].state_dict().items() if k != "lr_lambdas"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for scheduler in self.schedulers:
            own = scheduler.state_dict()
            fits = {k: v for k, v in state.items()
                    if not (isinstance(v, list) and isinstance(own.get(k), list) and len(v) != len(own[k]))}
            scheduler.load_state_dict({**own, **fits})


class JSONState:
    """A stateful object whose state is plain data (the data loader), saved as one JSON string."""

    def __init__(self, obj: Stateful):
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return {"json": json.dumps(self.obj.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.obj.load_state_dict(json.loads(state["json"]))


class RNGState:
    """Every rank seeds alike and training draws no per-rank random numbers, so one state
    (identical on all ranks, written once by DCP) restores every rank."""

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


class TrainState:
    def __init__(self):
        self.step = 0
        self.tokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step), "tokens_seen": torch.tensor(self.tokens_seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])


def flat_shapes(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Size]:
    """Global shape of every tensor in a nested state dict, under DCP's flattened keys."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(flat_shapes(v, f"{prefix}{k}."))
        elif torch.is_tensor(v):
            out[f"{prefix}{k}"] = v.shape
    return out
