"""Counted on one rank of torch's fake process group (no other rank runs): the collectives TP, CP
and EP run in a forward and backward, and those activation checkpointing runs again, against what
perf.model.comm prices; the tensors per-op selective AC keeps, against perf.model.memory's count; and
what the policy saves, on fake CUDA tensors."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import job_config

# What each collective costs in the counts below: their kinds told apart by their size.
COSTS = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1e3, "all_reduce": 1e6, "all_to_all_single": 1e9}


@pytest.fixture
def fake_2():
    """One rank of 2 on torch's fake process group, and its mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def split_over(mesh, job):
    """`job`'s model, its experts over `mesh` under EP and its layers over it under TP, as the job
    sets them (EP over TP's ranks), weights not yet drawn."""
    from titan_exp.models.llama import Transformer
    from titan_exp.parallel.expert import apply_ep
    from titan_exp.parallel.tensor import apply_tp

    model = Transformer(job.model)
    if job.parallelism.expert_parallel_degree > 1:
        apply_ep(model, mesh, mesh)
    if job.parallelism.tensor_parallel_degree > 1:
        apply_tp(model, mesh, loss_parallel=False)
    return model


def collective_costs(mesh, overrides: list[str], monkeypatch) -> tuple[object, float]:
    """The job of a 2-block model at `overrides`, and the COSTS of the collectives one rank runs in
    a forward and backward: TP, CP and EP over the 2 ranks where the job sets them (EP over TP's
    ranks), under the job's activation checkpointing. Under EP each MoE layer exchanges its token
    counts by a real all-to-all (counted; the fake group returns none, so the counts used are
    balanced). Under CP a chunk's lower-right causal mask is given as booleans, the same mask
    (torch's CausalBias cannot be made under a counting dispatch mode)."""
    from torch.distributed import _functional_collectives as funcol
    from torch.utils._python_dispatch import TorchDispatchMode

    from titan_exp.cluster.dry_run import balanced_expert_counts
    from titan_exp.models.moe import MoE
    from titan_exp.parallel import context
    from titan_exp.parallel.activation_checkpoint import apply_ac

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.cost = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.cost += COSTS.get(func.overloadpacket.__name__, 0)
            return func(*args, **(kwargs or {}))

    job = job_config(["model.n_layers=2", "training.seq_len=64", *overrides])
    p = job.parallelism
    model = split_over(mesh, job)
    if p.context_parallel_degree > 1:
        monkeypatch.setattr(context, "causal_lower_right",
                            lambda chunk, end: torch.ones(chunk, end, dtype=torch.bool).tril(end - chunk))
        context.apply_cp(model, mesh, 64)
    if job.activation_checkpoint.mode != "none":
        apply_ac(model, job.activation_checkpoint.mode, job.activation_checkpoint.selective_ac_option)
    model.init_weights(0)
    with balanced_expert_counts():
        balanced = MoE._exchange_counts

        def exchanged(self, counts_E):
            funcol.all_to_all_single(counts_E, None, None, group=self.ep_mesh).wait()
            return balanced(self, counts_E)

        MoE._exchange_counts = exchanged
        with Count() as count:
            model(torch.randint(0, job.model.vocab_size, (2, 64 // p.context_parallel_degree))).sum().backward()
    return job, count.cost


@pytest.mark.quick
def test_an_moe_layers_tp_collectives_are_those_the_step_model_prices(fake_2, monkeypatch):
    """One rank of TP 2: the collectives a 2-block model runs with its second block MoE, beside the
    same model all dense, counted by kind, forward and backward, without EP and with EP 2 over the
    TP ranks, with and without shared experts, are what perf.model.comm.moe_tp_extra prices one
    MoE layer beyond a dense block."""
    from titan_exp.perf.model.comm import moe_tp_extra
    from titan_exp.perf.rates.profile import Line

    tp = "parallelism.tensor_parallel_degree=2"
    _, dense = collective_costs(fake_2, ["model=debugmodel", tp], monkeypatch)
    rs, ar = (Line(COSTS[kind], 0) for kind in ("reduce_scatter_tensor", "all_reduce"))
    for shared in (1, 0):
        for ep in (1, 2):
            job, total = collective_costs(fake_2, ["model=moe_debug", "model.n_dense_layers=1", tp,
                                                   f"model.n_shared_experts={shared}",
                                                   f"parallelism.expert_parallel_degree={ep}"], monkeypatch)
            # EP's own all-to-alls, as perf.model.comm.inline_comm prices them: forward the counts, the
            # tokens there and back; backward the tokens' gradients there and back.
            ep_a2a = 5 * COSTS["all_to_all_single"] if ep > 1 else 0
            priced = moe_tp_extra(job, rs, ar, 1, 1)
            tp_extra = total - dense - ep_a2a  # the MoE layer's TP collectives beyond a dense block's
            assert tp_extra == pytest.approx(priced * job.model.n_layers / job.model.n_moe_layers), (shared, ep)


@pytest.mark.quick
@pytest.mark.parametrize("ac", [["activation_checkpoint.mode=full"], ["activation_checkpoint.mode=selective"],
                                ["activation_checkpoint.mode=selective",
                                 "activation_checkpoint.selective_ac_option=2"]],
                         ids=["full", "selective_op", "selective_2"])
@pytest.mark.parametrize("model", [["model=debugmodel", "parallelism.tensor_parallel_degree=2"],
                                   ["model=moe_debug", "model.n_dense_layers=0", "parallelism.tensor_parallel_degree=2",
                                    "parallelism.expert_parallel_degree=2"],
                                   ["model=debugmodel", "parallelism.context_parallel_degree=2"]],
                         ids=["dense_tp2", "moe_ep2_over_tp2", "dense_cp2"])
def test_the_collectives_activation_checkpointing_runs_again_are_those_the_step_model_prices(fake_2, monkeypatch,
                                                                                            model, ac):
    """What each AC mode adds to a 2-block model's collectives (TP 2; the MoE's with EP 2 over the TP
    ranks and a shared expert; CP 2), counted on one rank, is what perf.model.comm prices a block's
    recompute at: per-op selective reruns TP's and CP's all-gathers only (its policy saves
    reduce-scatters and all-to-alls), full AC also the attention's reduce-scatter and EP's
    all-to-alls, every 2nd block checkpointed half of full's. Without AC, CP's collectives are
    what it prices: one all-gather of K and V a block, one reduce-scatter back."""
    from titan_exp.perf.model.comm import BlockWork, StepShape, inline_comm
    from titan_exp.perf.rates.profile import BlockCost, Line, defaults

    lines = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
             "all_reduce": "all_reduce", "all_to_all": "all_to_all_single"}
    profile = defaults("cpu", "gloo", 2, 1)
    profile.collective = lambda op, *_: Line(COSTS[lines[op]], 0)

    def priced(job):
        s = StepShape.of(job, profile, cuda=False)
        nothing = Line(0.0, 0.0)
        inline = inline_comm(s, BlockWork(0.0, 0.0, 0.0, 0.0, BlockCost(nothing, nothing, nothing), None),
                             "micro_pipeline", False)
        return job.model.n_layers * (inline.tp_block + inline.cp_block + inline.ep_block)

    none_job, none = collective_costs(fake_2, model, monkeypatch)
    job, total = collective_costs(fake_2, [*model, *ac], monkeypatch)
    assert total > none  # something runs again
    assert total - none == pytest.approx(priced(job) - priced(none_job))
    if none_job.parallelism.context_parallel_degree > 1:
        assert none == pytest.approx(priced(none_job))


def selective_kept(mesh, overrides: list[str], n_layers: int, monkeypatch) -> tuple[object, float]:
    """The job, and the bytes of live tensors after the forward of an `n_layers` model's blocks
    under per-op selective AC, on one rank of 2 (TP and EP as the job sets them), every token
    routed round-robin (each expert the same share: the memory model's balanced experts)."""
    from titan_exp.cluster.dry_run import balanced_expert_counts, tensor_peak
    from titan_exp.models.moe import Router
    from titan_exp.parallel.activation_checkpoint import apply_ac

    routed = Router.forward

    def round_robin(self, x_TD, bias_E):
        _, _, scores_TE = routed(self, x_TD, bias_E)
        ids_TK = (torch.arange(len(x_TD))[:, None] * self.top_k + torch.arange(self.top_k)) % scores_TE.shape[-1]
        return scores_TE.gather(-1, ids_TK) * self.route_scale, ids_TK, scores_TE

    monkeypatch.setattr(Router, "forward", round_robin)
    job = job_config([f"model.n_layers={n_layers}", "training.seq_len=512", "activation_checkpoint.mode=selective",
                      *overrides])
    model = split_over(mesh, job)
    apply_ac(model, "selective", "op")
    model.init_weights(0)
    model.norm = model.output = None  # the blocks' output, not the logits
    with balanced_expert_counts(), tensor_peak() as live:
        for t in [*model.parameters(), *model.buffers()]:
            live.track(t)
        before = live.live
        out = model(torch.randint(0, job.model.vocab_size, (2, 512)))
        out = out.to_local() if hasattr(out, "to_local") else out
        return job, live.live - before - out.numel() * out.element_size()


MOE_ONLY, TP2 = ["model=moe_debug", "model.n_dense_layers=0"], "parallelism.tensor_parallel_degree=2"


def test_a_dry_run_draws_each_shard_alone_from_the_full_draws_distributions(fake_2):
    """Under the dry run's shard_draws a TP rank's init draws its shards alone: no whole parameter
    is made (the live tensors' peak is less by at least the largest one, the 32,768-row
    embedding), and each shard follows its rule (a unit-normal embedding, 0.02 for an input
    projection cut at two of them, ones for a norm). Outside it every parameter is drawn in full."""
    from torch.distributed.tensor import DTensor

    from titan_exp.cluster.dry_run import shard_draws, tensor_peak
    from titan_exp.models.llama import Transformer

    job = job_config(["model.n_layers=2", "model.vocab_size=32768", TP2])
    model = split_over(fake_2, job)
    peaks = {}
    for name, draws in (("full", contextlib.nullcontext()), ("shards", shard_draws())):
        with draws, tensor_peak() as live:
            model.init_weights(0)
        peaks[name] = live.peak
    assert Transformer.draw_in_full  # restored
    largest = max(p.numel() for p in model.parameters()) * 4  # fp32, as drawn in full
    assert largest == 32768 * 256 * 4 and peaks["full"] - peaks["shards"] >= largest
    local = {n: (p.to_local() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
    assert local["tok_embeddings.weight"].shape == (32768 // 2, 256)  # the shard: the vocabulary split by tp
    assert local["tok_embeddings.weight"].std().item() == pytest.approx(1.0, rel=0.02)
    w1 = local["layers.0.feed_forward.w1.weight"]
    assert w1.abs().max().item() <= 0.04 and w1.std().item() == pytest.approx(0.02 * 0.88, rel=0.05)
    assert bool((local["norm.weight"] == 1).all())


@pytest.mark.quick
@pytest.mark.parametrize("overrides", [["model=debugmodel"], ["model=debugmodel", TP2], MOE_ONLY, [*MOE_ONLY, TP2],
                                       [*MOE_ONLY, TP2, "parallelism.expert_parallel_degree=2"]],
                         ids=["dense", "dense_tp2", "moe", "moe_tp2", "moe_tp2_ep2"])
def test_what_per_op_selective_ac_keeps_is_what_the_memory_model_counts(fake_2, monkeypatch, overrides):
    """A block's tensors alive after the forward under per-op selective AC (a 4-block model's less
    a 2-block one's, over 2) are perf.model.memory.selective_saved's bytes: its input, every other
    matmul's output, attention's, the reduce-scatters' and all-to-alls' (fp32, 1,024 tokens)."""
    from titan_exp.perf.model.memory import selective_saved

    job, two = selective_kept(fake_2, overrides, 2, monkeypatch)
    _, four = selective_kept(fake_2, overrides, 4, monkeypatch)
    moe = job.model.n_moe_layers > 0
    assert (four - two) / 2 / 1024 == pytest.approx(selective_saved(job, moe, cuda=False, act_bytes=4), rel=2e-3)


@pytest.mark.quick
def test_per_op_selective_ac_saves_what_a_gpu_copies_to_the_host():
    """The per-op policy saves a copy from a GPU to the host (an MoE layer's token counts under EP,
    read by .tolist() to size its all-to-alls), so that the recompute does not make the host wait
    for the GPU again; it recomputes other copies and keeps every other matmul. On torch's fake
    tensors of a CUDA device."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.checkpoint import CheckpointPolicy

    from titan_exp.parallel.activation_checkpoint import op_policy

    aten, forward = torch.ops.aten, SimpleNamespace(is_recompute=False)
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    policy = op_policy()
    with FakeTensorMode():
        counts, on_host = torch.empty(8, dtype=torch.int64, device="cuda"), torch.empty(8)
    assert policy(forward, aten._to_copy.default, counts, device=torch.device("cpu")) == save
    assert policy(forward, aten._to_copy.default, counts, dtype=torch.float32) == recompute
    assert policy(forward, aten._to_copy.default, on_host, device=torch.device("cpu")) == recompute
    assert [policy(forward, aten.mm.default, counts, counts) for _ in range(3)] == [save, recompute, save]


@pytest.mark.quick
@pytest.mark.parametrize("model", ["debugmodel", "moe_debug", "deepseek_v3_debug"])
def test_a_blocks_matmuls_run_in_the_order_the_cost_models_name_them(model):
    """The matrix products a dense block and an MoE block run in their forward, in order, by their
    (in, out) widths, are perf.model.shapes.block_matmuls' (the experts run one at a time, as on a CPU):
    per-op selective AC saves every other one of them, which perf.model.memory counts and perf.model.block prices
    as not recomputed. Two blocks (the first dense, the second MoE), the output head, one process."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from titan_exp.models.llama import Transformer
    from titan_exp.perf.model.shapes import FFN_LINEARS, ROUTER, SHARED_LINEARS, attention_on_rank, block_matmuls

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func == torch.ops.aten.mm.default:
                self.shapes.append((args[0].shape[1], args[1].shape[1]))
            return func(*args, **(kwargs or {}))

    job = job_config([f"model={model}", "model.n_layers=2", "training.seq_len=256"])
    m = job.model
    widths = {name: (int(k), int(n)) for name, (k, n) in attention_on_rank(m, 1).items()}
    widths |= dict(zip(FFN_LINEARS, ((m.dim, m.ffn_hidden_dim), (m.dim, m.ffn_hidden_dim), (m.ffn_hidden_dim, m.dim))))
    shared = m.n_shared_experts * m.expert_hidden_dim
    widths |= {ROUTER: (m.dim, m.n_experts)}
    widths |= dict(zip(SHARED_LINEARS, ((m.dim, shared), (m.dim, shared), (shared, m.dim))))
    widths |= {f"moe.experts.{i}.{w}": kn for i in range(m.n_experts)
               for w, kn in (("w1", (m.dim, m.expert_hidden_dim)), ("w3", (m.dim, m.expert_hidden_dim)),
                             ("w2", (m.expert_hidden_dim, m.dim)))}
    named = [widths[name] for layer in range(2)
             for name in block_matmuls(m, m.is_moe_layer(layer), m.n_experts * m.is_moe_layer(layer))]
    model = Transformer(m)
    model.init_weights(0)
    with torch.no_grad(), Products() as products:
        model(torch.randint(0, m.vocab_size, (2, 256)))
    assert products.shapes == [*named, (m.dim, m.vocab_size)]
