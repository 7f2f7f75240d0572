"""The planner's FSDP working set, counted unit by unit in backward: at a unit's backward FSDP holds
its gathered parameters and their unsharded gradients, the next unit (prefetched) and the previous
unit's reduce-scatter input (its whole gradient in the reduce dtype), kept until the next
reduce-scatter; the logits live at the output layer's backward only. Checked against the shapes,
at the dry run's layouts (benchmarks/bench_dry_run.py), where a dry run measured these moments."""

from __future__ import annotations

import pytest
from conftest import job_config

from titan_exp.perf.model.memory import predict_memory

pytestmark = pytest.mark.quick

GIB = 2**30


def dry_layout(model: str, layers: int, nodes: int, *layout: str, precision: str = "fp32"):
    return job_config([f"model={model}", f"precision={precision}", "activation_checkpoint.mode=none",
                       f"model.n_layers={layers}", "training.seq_len=256", "training.local_batch_size=1",
                       "training.global_batch_size=-1", f"cluster.nnodes={nodes}", "cluster.nproc_per_node=8",
                       *layout])


def test_a_block_between_two_vocabulary_units_holds_both_and_its_own_twice():
    """Qwen3 32B's one block under FSDP 64: at its backward the output layer's reduce-scatter input
    (fp32), the block gathered and its gradients, the embedding prefetched; more than at the output
    layer's backward with the logits (measured 9.89 GiB in all, where the output's moment gives 8.71)."""
    job = dry_layout("qwen3_32b", 1, 8, "parallelism.data_parallel_shard_degree=64")
    m = job.model
    parts = predict_memory(job)
    block_moment = (m.output_params + 2 * m.block_params + m.embedding_params) * 4
    output_moment = (2 * m.output_params + m.block_params) * 4 + parts["logits"] * GIB
    assert block_moment > output_moment
    assert (parts["fsdp_working_set"] + parts["logits"]) * GIB == pytest.approx(block_moment)


def test_where_the_logits_outweigh_a_block_the_output_layers_backward_is_the_peak():
    """Llama 3 8B's two blocks under FSDP 64: the output layer gathered, its gradient and the last
    block prefetched; its logits beside them (their own part)."""
    job = dry_layout("llama3_8b", 2, 8, "parallelism.data_parallel_shard_degree=64")
    m = job.model
    parts = predict_memory(job)
    assert parts["fsdp_working_set"] * GIB == pytest.approx((2 * m.output_params + m.block_params) * 4)


def test_bf16_parameters_are_gathered_in_bf16_and_reduced_in_fp32_on_a_cpu_too():
    """precision=bf16 under FSDP on a CPU: FSDP gathers bf16 parameters, their unsharded gradients
    are bf16 and the reduce-scatter's input fp32; the last block's backward (the output's fp32
    reduce-scatter input beside it) is the peak."""
    job = dry_layout("llama3_8b", 2, 8, "parallelism.data_parallel_shard_degree=64", precision="bf16")
    m = job.model
    parts = predict_memory(job)
    last_block = m.output_params * 4 + 2 * m.block_params * 2 + m.block_params * 2
    assert (parts["fsdp_working_set"] + parts["logits"]) * GIB == pytest.approx(last_block)
    assert parts["logits"] * GIB == pytest.approx(256 * m.vocab_size * (2 + 8))  # bf16 logits, fp32 copy and grad


def test_under_tp_the_embeddings_whole_gradient_sits_beside_the_last_reduce_scatter():
    """Llama 3 70B's one block under FSDP 64 x TP 8: DTensor's whole embedding gradient, the gathered
    embedding shard and its gradient, and the block's reduce-scatter input (fp32), still held."""
    job = dry_layout("llama3_70b", 1, 64, "parallelism.data_parallel_shard_degree=64",
                     "parallelism.tensor_parallel_degree=8")
    m = job.model
    whole = m.embedding_params * 4
    expected = whole + 2 * whole / 8 + m.block_params / 8 * 4
    assert predict_memory(job)["fsdp_working_set"] * GIB == pytest.approx(expected)


def test_under_ep_the_block_reduces_its_routed_experts_first():
    """Qwen3 235B-A22B under FSDP 128 x TP 4 x EP 64: the routed experts are an FSDP unit of their own,
    reduced before the rest of the block, so what is still held at the embedding's backward is the
    block's other parameters' reduce-scatter input, not the experts'."""
    job = dry_layout("qwen3_235b_a22b", 1, 64, "parallelism.data_parallel_shard_degree=128",
                     "parallelism.tensor_parallel_degree=4", "parallelism.expert_parallel_degree=64")
    m = job.model
    whole = m.embedding_params * 4
    rest = (m.block_params - m.routed_params_per_block) / 4
    assert predict_memory(job)["fsdp_working_set"] * GIB == pytest.approx(whole + 2 * whole / 4 + rest * 4)


def test_a_pipeline_stage_accumulating_gradients_holds_its_largest_units_fresh_gradient():
    """Llama 3 8B's last stage under PP 4 x FSDP 16, four microbatches: the stage's parameters gathered,
    their unsharded fp32 gradients accumulated, and at the output layer's backward its fresh gradient
    (vocab x dim), before autograd adds it in (measured 8.80 GiB in all, where a block's gives 7.82)."""
    job = dry_layout("llama3_8b", 4, 8, "parallelism.pipeline_parallel_degree=4",
                     "parallelism.data_parallel_shard_degree=16", "training.local_batch_size=4")
    m = job.model
    stage = m.block_params + m.output_params
    working = predict_memory(job, pp_rank=3)["fsdp_working_set"] * GIB
    assert working == pytest.approx(stage * (4 + 4) + m.output_params * 4)


def _saved_by_a_bf16_block(job) -> float:
    """Bytes a token one of this toolkit's blocks saves for backward in bf16 (FSDP's mixed precision
    casts its weights and inputs so), counted with autograd's saved-tensor hooks; its input, rope
    tables and weights, saved as they are, take no new memory."""
    import torch
    from torch import nn

    from titan_exp.models.llama import TransformerBlock, rope_tables

    m, seq = job.model, 32
    holder = nn.Module()
    holder.block = TransformerBlock(m).to(torch.bfloat16)
    cos, sin = rope_tables(m.head_size, seq, m.rope_theta)
    x = torch.randn(1, seq, m.dim, dtype=torch.bfloat16, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        holder.block(x, cos, sin)
    held = {t.untyped_storage().data_ptr() for t in (x, cos, sin, *holder.parameters())}
    return sum(n for ptr, n in saved.items() if ptr not in held) / seq


@pytest.mark.parametrize("shape", [[], ["model.head_dim=64"], ["model.ffn_dim_multiplier=2.0"]])
def test_a_bf16_blocks_saves_are_the_accounts(shape):
    """What the account says a bf16 block keeps a token without AC (ACT_PER_TOKEN_* in bf16, the
    query heads' width beyond dim, the norms' fp32 upcasts: BF16_UPCAST_D) is what the block saves,
    counted by hooks, within 1 % (attention's fp32 log-sum-exp and the norms' rsqrt, a float a head
    and a token, are left out), at the debug shape, with heads four times dim wide together, and
    with a wider SwiGLU."""
    job = job_config(["model=debugmodel", "precision=bf16", "activation_checkpoint.mode=none",
                      "training.seq_len=32", "training.local_batch_size=1", "model.n_layers=1",
                      "parallelism.data_parallel_shard_degree=2", "cluster.nproc_per_node=2", *shape])
    parts = predict_memory(job, cuda=True)
    tokens = job.training.seq_len
    assert parts["activations"] * GIB / tokens == pytest.approx(_saved_by_a_bf16_block(job), rel=0.01)
