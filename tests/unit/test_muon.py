"""optimizer=muon in one process: which parameters Muon updates, its update against torch's own
Muon and AdamW, the config group, and its refusals. (Every layout against one process, resume
and the AdamW <-> Muon checkpoint rule: tests/ranks/test_muon_layouts.py; the planner's state bytes:
tests/planner/test_optimizer_memory.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import compose, job_config, launch_cli
from omegaconf import OmegaConf

from titan_exp import targets
from titan_exp.train import muon
from titan_exp.train.optim import build_optimizers
from titan_exp.validation import validate

pytestmark = pytest.mark.quick

MUON = ["optimizer=muon"]
# The debug MoE cut to 2 blocks (one dense, one MoE): every kind of parameter, a fast step.
TINY_MOE = ["model=moe_debug", "model.n_layers=2"]


def model_of(overrides: list[str]) -> tuple[torch.nn.Module, object]:
    job = job_config(overrides)
    model = targets.build(job, "model", job.model)
    model.init_weights(0)
    return model, job


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    """Attention, SwiGLU, shared and routed experts (3-D: a matrix each) to Muon; embeddings, the
    output, every norm and the router to AdamW; MLA's projections to Muon, its latent norms not."""
    model, job = model_of([*TINY_MOE, *MUON])
    (opt,), _ = build_optimizers([model], job)
    names = {id(p): n for n, p in model.named_parameters()}
    by_group = {g["muon"]: sorted(names[id(p)] for p in g["params"]) for g in opt.param_groups}
    assert by_group[True] == sorted(
        [f"layers.{i}.attention.{w}.weight" for i in (0, 1) for w in ("wq", "wk", "wv", "wo")]
        + [f"layers.0.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")]
        + [f"layers.1.moe.experts.{w}" for w in ("w1", "w2", "w3")]
        + [f"layers.1.moe.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")])
    assert by_group[False] == sorted(["tok_embeddings.weight", "output.weight", "norm.weight",
                                      "layers.1.moe.router.gate.weight"]
                                     + [f"layers.{i}.{n}_norm.weight" for i in (0, 1) for n in ("attention", "ffn")])
    mla = dict(model_of(["model=deepseek_v3_debug"])[0].named_parameters())
    assert muon.is_matrix("layers.0.attention.wkv_a.weight", mla["layers.0.attention.wkv_a.weight"].shape)
    assert not muon.is_matrix("layers.0.attention.kv_norm.weight", mla["layers.0.attention.kv_norm.weight"].shape)
    assert muon.is_matrix("layers.3._checkpoint_wrapped_module.attention.wq.weight", (8, 8))  # under AC


def test_the_update_is_torch_muon_for_matrices_and_torch_adamw_for_the_rest():
    """Three steps on a real model's gradients: each matrix (each routed expert's too) moves as
    torch.optim.Muon moves it, bit for bit (bfloat16 Newton-Schulz, as torch's; Keller Jordan's lr
    rule and lr, torch's defaults), every other parameter as torch.optim.AdamW."""
    overrides = [*TINY_MOE, *MUON, "optimizer.muon.ns_dtype=bfloat16", "optimizer.muon.adjust_lr=original",
                 "optimizer.muon.lr=0.02", "optimizer.implementation=for-loop"]
    model, job = model_of(overrides)
    (opt,), _ = build_optimizers([model], job)
    o = job.optimizer
    # torch's optimizers on copies: each expert's matrix a 2-D parameter of its own
    copies = {n: p.detach().clone() for n, p in model.named_parameters()}
    before = model.layers["0"].attention.wq.weight.detach().clone()
    matrices = {(n, e): torch.nn.Parameter(copies[n][e]) for n, p in model.named_parameters() if p.ndim == 3
                for e in range(p.shape[0])}
    matrices |= {(n, None): torch.nn.Parameter(copies[n]) for n, p in model.named_parameters()
                 if p.ndim == 2 and muon.is_matrix(n, p.shape)}
    rest = {n: torch.nn.Parameter(copies[n]) for n, p in model.named_parameters() if not muon.is_matrix(n, p.shape)}
    lr = {g["muon"]: g["lr"] for g in opt.param_groups}  # the schedule's first step: warmup's share of each peak
    torch_muon = torch.optim.Muon(matrices.values(), lr=lr[True], weight_decay=o.weight_decay)
    torch_adamw = torch.optim.AdamW(rest.values(), lr=lr[False], betas=(o.beta1, o.beta2), eps=o.eps,
                                    weight_decay=o.weight_decay, foreach=False)
    tokens = torch.randint(0, job.model.vocab_size, (2, 33))
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        for (n, e), p in matrices.items():
            p.grad = grads[n][e] if e is not None else grads[n].clone()
        for n, p in rest.items():
            p.grad = grads[n].clone()
        opt.step()
        torch_muon.step()
        torch_adamw.step()
    params = dict(model.named_parameters())
    for (n, e), p in matrices.items():
        assert torch.equal(params[n][e] if e is not None else params[n], p), (n, e)
    for n, p in rest.items():
        assert torch.equal(params[n], p), n
    assert not torch.equal(params["layers.0.attention.wq.weight"], before)  # it moved


def test_newton_schulz_of_a_stack_is_each_matrix_orthogonalised():
    """A routed expert's update is its own matrix's: the stack's iteration equals each matrix's
    alone (bfloat16: exactly; float32 to rounding), and half a stack (expert parallel's share)
    is the half of the whole stack's, exactly. And it orthogonalises: singular values near 1."""
    torch.manual_seed(0)
    stack = torch.randn(8, 64, 32)
    args = (muon.NS_COEFFICIENTS, muon.NS_STEPS, 1e-7)
    for dtype in (torch.bfloat16, torch.float32):
        whole = muon.newton_schulz(stack, *args, dtype)
        each = torch.stack([muon.newton_schulz(m, *args, dtype) for m in stack])
        torch.testing.assert_close(whole, each, rtol=0 if dtype == torch.bfloat16 else 1e-5,
                                   atol=0 if dtype == torch.bfloat16 else 1e-6)
        assert torch.equal(muon.newton_schulz(stack[:4], *args, dtype), whole[:4])
    singular = torch.linalg.svdvals(muon.newton_schulz(stack[0], *args, torch.float32))
    assert 0.5 < singular.min() and singular.max() < 1.5  # Keller Jordan's quintic: S' in about (0.5, 1.5)
    shard = torch.cat([muon.newton_schulz(half, *args, torch.float32) for half in stack[0].chunk(2)])
    assert not torch.allclose(shard, muon.newton_schulz(stack[0], *args, torch.float32), atol=1e-2)  # a shard's is not


def test_lr_rules_and_groups_from_the_config():
    """match_rms_adamw (Moonlight) and original (Keller Jordan) by the matrix's out x in; the
    Muon group's lr and weight decay are optimizer.lr's and weight_decay's unless set; the lr
    schedule multiplies both groups."""
    assert muon.adjusted_lr(1.0, "match_rms_adamw", torch.Size((768, 256))) == pytest.approx(0.2 * 768 ** 0.5)
    assert muon.adjusted_lr(1.0, "original", torch.Size((768, 256))) == pytest.approx(3 ** 0.5)
    assert muon.adjusted_lr(1.0, "original", torch.Size((8, 256, 768))) == 1.0  # an expert stack: each matrix's
    model, job = model_of([*TINY_MOE, *MUON, "optimizer.lr=1e-3"])
    (opt,), (sched,) = build_optimizers([model], job)
    matrices, rest = sorted(opt.param_groups, key=lambda g: not g["muon"])
    assert matrices["lr"] == rest["lr"] == pytest.approx(1e-3 / job.lr_scheduler.warmup_steps)  # warmup's first step
    assert (matrices["weight_decay"], matrices["adjust_lr_fn"], matrices["ns_dtype"]) == (0.1, "match_rms_adamw",
                                                                                         "float32")
    model, job = model_of([*TINY_MOE, *MUON, "optimizer.muon.lr=0.02", "optimizer.muon.weight_decay=0"])
    (opt,), _ = build_optimizers([model], job)
    assert [(g["initial_lr"], g["weight_decay"]) for g in opt.param_groups] == [(0.02, 0.0), (8e-4, 0.1)]


def test_the_optimizer_group_leaves_every_composed_config_as_it_was():
    """conf/config.yaml's `optimizer: adamw` composes what the schema alone did, whatever else is
    chosen (a model preset's optimizer fields would still win: the group comes before it)."""
    for overrides in ([], ["model=llama3_8b"], ["optimizer.lr=1e-3", "parallelism=fsdp"],
                      ["+experiment=short", "precision=full_bf16"], ["optimizer._target_=torch.optim.SGD"]):
        with_group = OmegaConf.to_container(compose(overrides))
        assert with_group == OmegaConf.to_container(compose([*overrides, "~optimizer"])), overrides
    assert compose(MUON).optimizer._target_ == "titan_exp.train.muon.Muon"
    assert compose(MUON).optimizer.lr == compose([]).optimizer.lr


@pytest.mark.parametrize("overrides, message", [
    (["optimizer._target_=torch.optim.Muon"], "optimizer._target_ = 'torch.optim.Muon': orthogonalises whatever "
                                              "tensor it holds (a shard under FSDP or TP)"),
    ([*MUON, "optimizer.muon.momentum=1"], "optimizer.muon.momentum = 1.0: must be in [0, 1)"),
    ([*MUON, "optimizer.muon.ns_steps=0"], "optimizer.muon.ns_steps = 0: must be in [1, 100)"),
    ([*MUON, "optimizer.muon.ns_coefficients=[3.4,-4.7]"], "optimizer.muon.ns_coefficients = [3.4, -4.7]: must be "
                                                           "three numbers"),
    ([*MUON, "optimizer.muon.eps=0"], "optimizer.muon.eps = 0.0: must be > 0"),
    ([*MUON, "optimizer.muon.lr=0"], "optimizer.muon.lr = 0.0: must be > 0, or null for optimizer.lr"),
    ([*MUON, "optimizer.muon.weight_decay=-1"], "optimizer.muon.weight_decay = -1.0: must be >= 0"),
])
def test_bad_muon_fields_are_refused_by_name(overrides, message):
    errors = validate(job_config(overrides), cuda=False)
    assert any(e.startswith(message) for e in errors), errors


def test_a_good_muon_config_validates():
    assert validate(job_config([*MUON, "optimizer.muon.lr=0.02", "optimizer.muon.adjust_lr=original"]),
                    cuda=False) == []


@pytest.mark.parametrize("args, line", [
    (["optimizer._target_=torch.optim.Muon"],
     "optimizer._target_ = 'torch.optim.Muon': orthogonalises whatever tensor it holds (a shard under FSDP or TP) and "
     "takes only 2-D parameters; use optimizer=muon (titan_exp.train.muon.Muon: whole matrices on every layout, "
     "AdamW for the rest)"),
    ([*MUON, "optimizer.muon.lrr=0.02"], "optimizer.muon.lrr: unknown key; did you mean optimizer.muon.lr?"),
    ([*MUON, "optimizer.muon.adjust_lr=keller"], "optimizer.muon.adjust_lr=keller: not a choice; choose from "
                                                 "match_rms_adamw, original"),
], ids=["torch_muon", "typo", "choice"])
def test_refused_in_one_line_before_any_rank_starts(args, line, tmp_path):
    """As `python launch.py` refuses them: exit 2, one line, no run dir."""
    out = launch_cli([*args, f"hydra.run.dir={tmp_path / 'run'}"])
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [f"titan_exp: refused, nothing was started: {line}"]
    assert not (tmp_path / "run" / "logs").exists()


def test_help_lists_muons_fields():
    from titan_exp.config import help_text

    text = help_text()
    assert "  muon.adjust_lr = 'match_rms_adamw'\n      original | match_rms_adamw:" in text
    assert "  muon.ns_coefficients = [3.4445, -4.775, 2.0315]" in text
