"""What a Qwen3 block keeps for backward, counted on the block with autograd's saved-tensor hooks
against the memory model's terms for it: heads whose width together is not dim (Qwen3's are 128
wide at any dim) and QK-norm (perf.model.memory.wide_attention_saved; one replica under bf16
autocast, perf.model.memory_gpu.AUTOCAST_SAVED and QK_NORM_SAVED)."""

from __future__ import annotations

import pytest
import torch
from conftest import job_config

from tests.gpu_data.test_gpu_h200 import saved_by_one_block
from titan_exp.models.llama import TransformerBlock, rope_tables
from titan_exp.perf.model import memory_gpu as mg
from titan_exp.perf.model.memory import wide_attention_saved
from titan_exp.validation import resolve


def saved_fp32(overrides: list[str], seq: int = 64) -> float:
    """Bytes a token the debug model's block (with `overrides`) saves for backward in fp32, without
    autocast, as a CPU rank runs it: its input, parameters and the RoPE tables left out."""
    m = job_config(["model=debugmodel", *overrides]).model
    block = TransformerBlock(m)
    cos, sin = rope_tables(m.head_size, seq, m.rope_theta)
    x = torch.randn(1, seq, m.dim, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, cos, sin)
    held = {t.untyped_storage().data_ptr() for t in (x, cos, sin, *block.parameters())}
    return sum(n for ptr, n in saved.items() if ptr not in held) / seq


@pytest.mark.quick
@pytest.mark.parametrize("overrides", [["model.head_dim=32"], ["model.head_dim=8"],
                                       ["model.qk_norm=true"], ["model.head_dim=32", "model.qk_norm=true"]],
                         ids=["wider", "narrower", "qk_norm", "wider_qk_norm"])
def test_a_blocks_saves_beyond_llamas_are_wide_attention_saved(overrides):
    """The debug Llama block (16 heads of 16: 256 wide, its dim) against the same block with its 16
    heads twice or half as wide, QK-norm, or both: what it saves beyond the Llama block's is
    wide_attention_saved's elements, fp32 (CPU's 4 bytes each; its norm runs decomposed)."""
    m = job_config(["model=debugmodel", *overrides]).model
    assert m.n_heads * m.head_size != m.dim or m.qk_norm
    assert saved_fp32(overrides) - saved_fp32([]) == 4 * wide_attention_saved(m, 1, cuda=False)
    assert wide_attention_saved(job_config(["model=debugmodel"]).model, 1, cuda=False) == 0


@pytest.mark.parametrize("mode", ["eager", pytest.param("compiled", marks=pytest.mark.slow),
                                  pytest.param("selective", marks=pytest.mark.slow)])
@pytest.mark.parametrize("overrides", [["model=qwen3_0.6b"], ["model=qwen3_0.6b", "model.head_dim=32"],
                                       ["model=qwen3_0.6b", "model.qk_norm=false"]],
                         ids=["qwen3_0.6b", "narrow_heads", "no_qk_norm"])
def test_one_replicas_saves_of_a_qwen3_block_are_counted(overrides, mode):
    """AUTOCAST_SAVED and QK_NORM_SAVED at Qwen3-0.6B's shape (16 heads of 128: twice its dim of
    1024, QK-norm), with heads half its dim together, and without QK-norm: what the block saves
    under bf16 autocast, eager, compiled and under selective AC per op, to the byte."""
    job = resolve(job_config([*overrides, "training.seq_len=64", "precision=bf16", "activation_checkpoint.mode="
                              + ("selective" if mode == "selective" else "none")]))
    counted = saved_by_one_block(job, compiled=mode != "eager")
    assert counted == pytest.approx(mg.autocast_saved(job, mode, cuda=False), abs=1)
