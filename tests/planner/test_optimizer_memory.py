"""The planner's optimizer state: AdamW's two moments a parameter, Muon's one for the blocks'
matrices (optimizer=muon), against what a real optimizer holds after a step."""

from __future__ import annotations

import pytest
import torch
from conftest import job_config

from titan_exp import targets
from titan_exp.metrics import state_bytes
from titan_exp.perf.model.memory import predict_memory
from titan_exp.train import muon
from titan_exp.train.optim import build_optimizers

pytestmark = pytest.mark.quick

SHAPE = ["training.seq_len=64", "training.global_batch_size=8"]


def held_after_a_step(overrides: list[str]) -> int:
    """Parameters, gradients and optimizer state (bytes) of the one-process model after one step."""
    job = job_config(overrides)
    model = targets.build(job, "model", job.model)
    model.init_weights(0)
    optimizers, _ = build_optimizers([model], job)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizers[0].step()
    return state_bytes(list(model.parameters()), optimizers)


@pytest.mark.parametrize("model", ["debugmodel", "moe_debug"])
def test_states_are_what_adamw_and_muon_hold(model):
    """Predicted to within AdamW's step counters (4 bytes a parameter tensor, not modelled)."""
    for optimizer in ("adamw", "muon"):
        overrides = [*SHAPE, f"model={model}", f"optimizer={optimizer}", "model.n_layers=2"]
        predicted = predict_memory(job_config(overrides))["states"] * 2**30
        assert predicted == pytest.approx(held_after_a_step(overrides), abs=4 * 60), optimizer


def test_muon_saves_a_moment_of_every_matrix_on_a_gpu_replica_too():
    """One GPU under bf16 autocast (counted part by part): 4 bytes fewer a matrix parameter, the
    matrices being those `is_matrix` gives Muon."""
    overrides = ["model=llama3_1b", "precision=bf16"]
    adamw, with_muon = (predict_memory(job_config([*overrides, *o]), cuda=True)["states"] * 2**30
                        for o in ([], ["optimizer=muon"]))
    job = job_config(overrides)
    with torch.device("meta"):
        model = targets.build(job, "model", job.model)
    matrices = sum(p.numel() for n, p in model.named_parameters() if muon.is_matrix(n, p.shape))
    assert adamw - with_muon == 4 * matrices
