"""Mixture of experts and expert parallel.

In one process: the MoE layer against a token-by-token reference (forward and gradients), the
balance loss's gradient against adding it to the loss, the bias update, the published shapes, the
validation rules and the planner's EP layouts (one rank's collectives: test_one_rank.py). Then
real gloo runs of the debug MoE: every EP layout, and TP without EP (each expert's width split),
gives one process's losses and gradient norms (fp32, deterministic; the norms catch a wrong
expert gradient scale, which AdamW's updates would hide from the losses), and an EP 2 checkpoint
continues under EP 4 and in one process (DCP reshards the experts).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SMALL, job_config, run_job

slow = pytest.mark.slow

MOE = [*SMALL, "model=moe_debug", "training.steps=4"]
SAVES = ["checkpoint=default", "checkpoint.interval=2", "checkpoint.keep_latest_k=0"]
W2 = ["cluster.nproc_per_node=2", "training.local_batch_size=4"]
W4 = ["cluster.nproc_per_node=4", "training.local_batch_size=2"]
EP = {  # name -> overrides; every one must equal the single process
    "ep2": ["parallelism=ep", *W2],
    "dp_shard4_ep2": ["parallelism=ep", "parallelism.data_parallel_shard_degree=4", *W4],  # experts also FSDP over 2
    "tp2_ep2": ["parallelism=2d", "parallelism.expert_parallel_degree=2", *W4],  # EP over the TP ranks
    "tp2_ep4": ["parallelism=2d", "parallelism.expert_parallel_degree=4", *W4],  # over FSDP x TP
    # per-op selective AC: the experts' FSDP unit nested in a checkpointed block, the all-to-alls saved
    "tp2_ep4_selective_ac": ["parallelism=2d", "parallelism.expert_parallel_degree=4",
                             "activation_checkpoint.mode=selective", *W4],
    "pp2_ep2": ["parallelism=pp", "parallelism.data_parallel_shard_degree=2", "parallelism.expert_parallel_degree=2",
                *W4],
    "hsdp_ep2": ["parallelism=hsdp", "parallelism.expert_parallel_degree=2", *W4],
    "cp2_ep2": ["parallelism=cp", "parallelism.data_parallel_shard_degree=2", "parallelism.expert_parallel_degree=2",
                *W4],
    "tp2": ["parallelism=tp", *W2],  # each expert's width split over TP
    "fsdp2_tp2": ["parallelism=2d", *W4],  # and FSDP over the slices
    "3d": ["parallelism=3d", "cluster.nproc_per_node=8", "training.local_batch_size=4"],  # PP x FSDP x TP, no EP
    "ep2_compile_full_ac": ["parallelism=ep", "compile.enable=true", "activation_checkpoint.mode=full", *W2],
    "3d_ep": ["parallelism=3d_ep", "cluster.nproc_per_node=8", "training.local_batch_size=4"],
}
FAST = ("tp2_ep4_selective_ac", "pp2_ep2", "fsdp2_tp2")  # tp2_ep4's layout runs in the first; ep2 itself in the
# checkpoint fixture below, dp_shard4_ep2's layout in test_experts_fewer_than_their_fsdp_ranks_shard_by_rows


def ok(code, summary):
    assert code == 0 and summary["status"] == "ok", summary and summary.get("error")
    return summary


def same_run(summary: dict, reference: dict) -> None:
    assert summary["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    assert summary["grad_norms"] == pytest.approx(reference["grad_norms"], rel=3e-4)
    assert summary["expert_load"] == pytest.approx(reference["expert_load"])  # same routing, same bias


# -- one process ---------------------------------------------------------------------------
def _layer(**fields):
    from titan_exp.config.model import ModelConfig
    from titan_exp.models.moe import MoE

    cfg = ModelConfig(dim=32, n_heads=4, n_experts=4, top_k=2, moe_hidden_dim=16, n_shared_experts=1, **fields)
    torch.manual_seed(0)
    layer = MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layer.init_buffers()
    return layer


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.quick
def test_moe_layer_equals_a_token_by_token_reference(score_func):
    """Dispatch (sort by expert, run each expert on its rows, weigh, add back) against looping over
    tokens and their chosen experts; the bias picks experts but never weighs them."""
    import torch.nn.functional as F

    layer = _layer(score_func=score_func, route_norm=True)
    layer.expert_bias.copy_(torch.tensor([0.5, -0.5, 0.0, 0.0]))
    x = torch.randn(2, 5, 32, requires_grad=True)
    out = layer(x)
    e = layer.experts

    def expert(i, t):
        return (F.silu(t @ e.w1[i].T) * (t @ e.w3[i].T)) @ e.w2[i].T

    ref = []
    for t in x.reshape(-1, 32):
        logits = layer.router.gate.weight @ t
        scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
        chosen = (scores + layer.expert_bias).topk(2).indices
        weights = scores[chosen] / scores[chosen].sum()
        ref.append(sum(w * expert(i, t) for w, i in zip(weights, chosen)) + layer.shared_experts(t))
    ref = torch.stack(ref).view(2, 5, 32)
    assert torch.allclose(out, ref, atol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), [x, e.w1, layer.router.gate.weight])
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, e.w1, layer.router.gate.weight])
    for got, want in zip(grads, ref_grads):
        assert torch.allclose(got, want, atol=1e-5)
    assert layer.tokens_per_expert.sum() == 2 * 5 * 2  # every token counted top_k times


@pytest.mark.quick
def test_routed_experts_compute_in_the_autocast_dtype(monkeypatch):
    """A bf16 run without FSDP autocasts, and its residual stream, hence the MoE's input, stays
    fp32. The routed rows must still reach the experts in bf16: CUDA's grouped GEMM takes bf16
    only, and fp32 rows sent a single-GPU run down the loop over experts, with a host sync per
    layer. The matmuls autocast to bf16 either way, so the output is the same to the bit."""
    from titan_exp.models import moe

    layer, x = _layer(), torch.randn(2, 5, 32)
    seen = []
    layer.experts.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
        monkeypatch.setattr(moe, "compute_dtype", lambda t: t.dtype)
        uncast = layer(x)
    assert seen == [torch.bfloat16, torch.float32]
    assert torch.equal(out, uncast)
    assert layer(x).dtype == torch.float32 and seen[-1] == torch.float32  # no autocast: as given


@pytest.mark.quick
def test_tokens_per_expert_are_counted_without_a_data_dependent_shape():
    """bincount's output size depends on its data: a host sync on CUDA and a graph break under
    compile in every MoE layer. The counts come from a scatter-add into n_experts slots, so the
    only breaks left on CPU are the loop over experts' split sizes (CUDA's grouped GEMM has none)."""
    layer, x = _layer(), torch.randn(2, 5, 32)
    explained = torch._dynamo.explain(layer)(x)
    assert explained.break_reasons and all("tolist()" in r.user_stack[-1].line for r in explained.break_reasons)
    layer.init_buffers()
    with torch.no_grad():
        ids = layer.router(x.reshape(-1, 32), layer.expert_bias)[1]
    with torch.enable_grad():
        layer(x)
    assert torch.equal(layer.tokens_per_expert, torch.bincount(ids.flatten(), minlength=4).float())


def test_balance_loss_gradient_is_that_of_adding_it_to_the_loss():
    from titan_exp.models.moe import sequence_balance_loss

    x = torch.randn(3, 6, 32)
    with_aux = _layer(aux_loss_coeff=0.1)
    with_aux.aux_loss_scale = 1 / 3
    with_aux(x).sum().backward()
    plain = _layer()
    out = plain(x)
    weights, ids, scores = plain.router(x.reshape(-1, 32), plain.expert_bias)
    (out.sum() + 0.1 / 3 * sequence_balance_loss(scores, ids, 3, 2)).backward()
    assert plain.router.gate.weight.grad.abs().sum() > 0
    assert torch.allclose(with_aux.router.gate.weight.grad, plain.router.gate.weight.grad, atol=1e-6)


def test_bias_update_moves_towards_balance():
    from titan_exp.models.moe import load_stats, update_expert_bias

    layer = _layer(load_balance_coeff=0.01)
    layer.tokens_per_expert.copy_(torch.tensor([10.0, 2.0, 4.0, 0.0]))  # mean 4
    counts = update_expert_bias([layer], group=None)
    assert layer.expert_bias.tolist() == pytest.approx([-0.0125, 0.0075, -0.0025, 0.0075])  # sign, centred
    assert load_stats(counts, [layer]).tolist() == pytest.approx([2.5, -0.0, 0.0125])


def test_published_shapes_and_active_flops():
    from titan_exp.models.llama import flops_per_token

    olmoe, mixtral = job_config(["model=olmoe_1b_7b"]).model, job_config(["model=mixtral_8x7b"]).model
    assert (round(olmoe.num_params / 1e9, 1), round(olmoe.active_params / 1e9, 1)) == (6.9, 1.3)  # OLMoE-1B-7B
    assert (round(mixtral.num_params / 1e9, 1), round(mixtral.active_params / 1e9, 1)) == (46.7, 12.9)  # 8x7B
    debug = job_config(["model=moe_debug"]).model
    dense = job_config([]).model  # debugmodel: the same active SwiGLU width
    attention = 6 * 6 * 16 * 16 * 2 * 64
    assert flops_per_token(debug, 64) == 6 * (debug.active_params - debug.embedding_params) + attention
    assert flops_per_token(debug, 64) - flops_per_token(dense, 64) == 6 * 5 * 256 * 8  # the routers only


def test_float8_keeps_the_router_and_routed_experts_in_high_precision():
    """TorchTitan's rule: the router's scores decide the routing, so it stays high precision; the
    routed experts are not linears (three (E, ...) weights), so no converter touches them."""
    from torchao.float8.float8_linear import Float8Linear

    from titan_exp.models.llama import Transformer
    from titan_exp.precision import apply_converter

    job = job_config(["model=moe_debug", "precision=float8", "model.n_experts=16"])  # a router float8 could take
    with torch.device("meta"):
        model = Transformer(job.model)
    apply_converter(model, job.precision)
    moe = model.layers["1"].moe
    assert type(moe.router.gate) is torch.nn.Linear
    assert isinstance(moe.shared_experts.w1, Float8Linear) and isinstance(model.layers["1"].attention.wq, Float8Linear)
    assert all(type(w) is torch.nn.Parameter for w in moe.experts.parameters())


@pytest.mark.parametrize("overrides, message", [
    (["parallelism=ep", "cluster.nproc_per_node=2"], "parallelism.expert_parallel_degree = 2: needs an MoE model"),
    (["model=moe_debug", "parallelism=ep", "parallelism.expert_parallel_degree=3", "cluster.nproc_per_node=3",
      "parallelism.data_parallel_shard_degree=3"],
     "does not divide model.n_experts = 8"),
    (["model=moe_debug", "parallelism=ep", "cluster.nproc_per_node=3", "parallelism.data_parallel_shard_degree=3"],
     "ep / (cp x tp) = 2 must divide data_parallel_shard_degree = 3"),
    (["model=moe_debug", "parallelism=2d", "parallelism.expert_parallel_degree=3", "cluster.nproc_per_node=4",
      "model.n_experts=6"], "must be a multiple of context_parallel_degree x tensor_parallel_degree = 1 x 2"),
    (["model=moe_debug", "parallelism=cp", "parallelism.expert_parallel_degree=3",
      "parallelism.data_parallel_shard_degree=3", "cluster.nproc_per_node=6", "model.n_experts=6"],
     "must be a multiple of context_parallel_degree x tensor_parallel_degree = 2 x 1"),
    (["model=moe_debug", "parallelism=cp", "cluster.nproc_per_node=2", "model.aux_loss_coeff=0.01"],
     "model.aux_loss_coeff = 0.01: the sequence-wise balance loss needs whole sequences"),
    (["model=moe_debug", "parallelism=tp", "cluster.nproc_per_node=2", "model.moe_hidden_dim=129",
      "model.n_shared_experts=2"],  # the shared experts' 258 divide by 2, the routed experts' 129 do not
     "parallelism.tensor_parallel_degree = 2: does not divide the routed experts' width (model.moe_hidden_dim; "
     "without expert parallel TP splits every expert) = 129"),
    (["model=moe_debug", "model.top_k=9"], "model.top_k = 9: exceeds model.n_experts = 8"),
    (["model=moe_debug", "model.route_scale=0"], "model.route_scale = 0.0: must be > 0"),
    (["model=moe_debug", "model.n_dense_layers=6"], "model.n_dense_layers = 6: leaves no MoE layer"),
    (["model=moe_debug", "checkpoint.last_save_in_hf=true"], "checkpoint.last_save_in_hf = True: Hugging Face export"),
    (["model=moe_debug", "checkpoint=default", "checkpoint.initial_load_in_hf=true",
      "checkpoint.initial_load_path=/tmp"],
     "checkpoint.initial_load_in_hf = True: Hugging Face loading reads Llama, Qwen3 and Qwen3-MoE weights; a model "
     "with routed experts without QK-norm"),
])
@pytest.mark.quick
def test_invalid_moe_configs_are_refused_by_name(overrides, message):
    from titan_exp.validation import validate

    errors = validate(job_config(overrides))
    assert any(message in e for e in errors), errors


@pytest.mark.quick
def test_planner_searches_expert_parallel():
    from titan_exp.perf.rates.profile import defaults
    from titan_exp.perf.search.planner import plan

    job = job_config(["model=moe_debug", "training.seq_len=64", "training.global_batch_size=8"])
    plans = {pl.name: pl for pl in plan(job, 4, device_memory_gib=100, profile=defaults("cpu", "gloo", 4, 1))}
    assert {"dp_shard4", "dp_shard4 x ep2", "dp_shard4 x ep4", "dp_shard2 x tp2 x ep2", "dp_shard2 x tp2 x ep4",
            "cp4 x ep4"} <= set(plans)
    # Both split the routed experts over the 4 FSDP x TP ranks, and the routed work over TP: EP by
    # experts (each TP rank dispatching half the tokens), TP alone by each expert's width (every
    # token through half of it). FSDP gathers a quarter of the experts under EP, half of each without.
    tp_ep4, tp = plans["dp_shard2 x tp2 x ep4"], plans["dp_shard2 x tp2"]
    assert tp_ep4.parts_gib["states"] == pytest.approx(tp.parts_gib["states"], rel=0.01)  # the router: whole over TP
    assert tp_ep4.step.parts["compute"] == pytest.approx(tp.step.parts["compute"])
    assert tp_ep4.parts_gib["fsdp_working_set"] < tp.parts_gib["fsdp_working_set"]
    assert "parallelism.expert_parallel_degree=1" in plans["dp_shard4"].overrides
    ep4, fsdp = plans["dp_shard4 x ep4"], plans["dp_shard4"]
    assert ep4.step.parts["ep"] > 0 and "ep" not in fsdp.step.parts
    assert (ep4.parts_gib["states"]
            == pytest.approx(fsdp.parts_gib["states"]))  # ep x efsdp shard the experts as FSDP did
    assert ep4.parts_gib["fsdp_working_set"] < fsdp.parts_gib["fsdp_working_set"]  # 1/4 of the experts gathered
    dense = plan(job_config(["training.seq_len=64", "training.global_batch_size=8"]), 4, device_memory_gib=100,
                 profile=defaults("cpu", "gloo", 4, 1))
    assert not any("ep" in pl.degrees for pl in dense)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="grouped matmul runs on CUDA")
def test_grouped_matmul_equals_the_loop():
    from titan_exp.models.moe import GroupedExperts

    experts = GroupedExperts(4, 64, 128).cuda()
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(48, 64, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([16, 0, 8, 24], device="cuda")
    grouped = experts.bfloat16()(x, counts)  # torch._grouped_mm
    loop = experts.float()(x.float(), counts)  # the same (bf16-rounded) weights, one expert at a time
    assert torch.allclose(grouped.float(), loop, atol=2e-2, rtol=2e-2)


# -- real runs -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    return ok(*run_job(MOE, tmp_path_factory.mktemp("moe_single")))


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory):
    """EP 2 on 2 ranks, saving at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("moe_ep2")
    return run_dir, ok(*run_job([*MOE, *EP["ep2"], *SAVES], run_dir))


def test_ep2_equals_one_process_and_logs_expert_load(ep2_run, moe_reference):
    run_dir, summary = ep2_run
    same_run(summary, moe_reference)
    assert summary["layout"]["ep"] == 2
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(1.0 <= m["moe/max_load"] <= 4.0 and 0.0 <= m["moe/min_load"] <= 1.0 for m in logged)  # E / K = 4
    assert logged[-1]["moe/max_bias"] > 0  # the bias moved
    assert summary["expert_load"]["max_load"] == logged[-1]["moe/max_load"]


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in FAST else [slow]) for n in EP if n != "ep2"])
def test_ep_layouts_equal_one_process(name, moe_reference, tmp_path):
    summary = ok(*run_job([*MOE, *EP[name]], tmp_path))
    same_run(summary, moe_reference)


def test_experts_fewer_than_their_fsdp_ranks_shard_by_rows(tmp_path):
    """6 experts, EP 2: 3 per rank, FSDP-sharded over efsdp 2, which dim 0 cannot split evenly;
    they are sharded along dim 1 instead (parallel/fsdp.py) and train as one process does."""
    six = [*MOE, "model.n_experts=6", "training.steps=3"]
    single = ok(*run_job(six, tmp_path / "single"))
    same_run(ok(*run_job([*six, *EP["dp_shard4_ep2"]], tmp_path / "ep2")), single)


def test_a_pipeline_stage_of_dense_blocks_only_reports_the_others_load(tmp_path):
    """Blocks 0-2 dense: the first stage has no MoE layer, yet joins the load's reduction."""
    summary = ok(*run_job([*MOE, "model.n_dense_layers=3", "parallelism=pp", "training.local_batch_size=4"], tmp_path))
    assert 1.0 <= summary["expert_load"]["max_load"] <= 4.0


@slow
@pytest.mark.parametrize("name", ["pp2_ep2", "tp2_ep4"])
def test_balance_loss_is_the_same_under_pipeline_and_expert_parallel(tmp_path, name):
    """The sequence-wise balance loss over microbatches of pipeline stages with EP, or over TP
    ranks that each dispatch their sequence shard, equals one process's (each microbatch adds its
    sequences' share; every TP rank routes, and so scores, the whole sequence)."""
    aux = [*MOE, "model.aux_loss_coeff=0.01"]
    single = ok(*run_job(aux, tmp_path / "single"))
    same_run(ok(*run_job([*aux, *EP[name]], tmp_path / name)), single)


@pytest.mark.parametrize("target", [pytest.param(["parallelism=ep", "parallelism.data_parallel_shard_degree=4",
                                                  "parallelism.expert_parallel_degree=4", *W4], marks=slow), []],
                         ids=["ep4", "single"])
def test_ep2_checkpoint_continues_in_another_expert_layout(target, ep2_run, moe_reference, tmp_path):
    """The full state of EP 2's step 2 (the experts split in two, the load-balancing bias) loads
    where the experts are split in four, or whole, and training goes on as one process's did."""
    run_dir, _ = ep2_run
    summary = ok(*run_job([*MOE, *target, "checkpoint=default",
                           f"checkpoint.initial_load_path={run_dir}/checkpoints/step-2",
                           "checkpoint.initial_load_model_only=false"], tmp_path))
    assert summary["start_step"] == 3
    assert summary["losses"] == pytest.approx(moe_reference["losses"][2:], abs=1e-5)
    # The bias after 4 updates: only if the checkpoint's 2 were loaded.
    assert summary["expert_load"] == pytest.approx(moe_reference["expert_load"])
