"""What each published source's engine runs where it differs from this toolkit, read from the
source's own code: its attention kernel, whether its elementwise kernels are fused, and what the
cost model prices differently (a titan_exp.perf.model.engine.Engine: TP overlap, float8 experts,
the loss under compile) (`ENGINES`); and the memory-bound kernels of the model it ran
(`elementwise`: TORCHTITAN_LLAMA, MEGATRON_LLAMA and MPT, as perf.rates.model_ops counts them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titan_exp.perf.model.engine import TITAN_EXP, Engine
from titan_exp.perf.rates.model_ops import Elementwise

# TorchTitan's Llama as its December 2024 tables ran it (torchtitan/models/norms.py and
# models/llama/model.py at ba2469780, the last commit before 2024-12-20), bytes per token of a
# block's forward in bf16. Eager: RMSNorm in fp32 from separate ops (upcast, square, mean, scale,
# cast back, weight), 36 x 2; residual adds 6 x 2; RoPE as a complex product in fp32, 20;
# the attention output's layout copy, 4; SiLU and product, 10. Compiled: each norm with its
# residual add 6 x 2, RoPE 4, the copy 4, SiLU and product 6. The loss: the fp32 upcast,
# log-softmax and its gradient, 36 eager, 10 fused. (The tables' own commit, 9dec370, has the same
# model code and leaves the loss eager under compile, and Inductor runs its complex RoPE eagerly,
# not generating code for complex operators (pytorch/torchtitan issue 15); both are priced fused
# as written before its rows were scored: BENCHMARKS.md, compile against float8 on TorchTitan.)
# Megatron's rows, whose engine fuses these kernels, take its compiled counts (an assumption:
# Transformer Engine's fusions are not these).
TORCHTITAN_LLAMA = Elementwise(eager_bytes=(2 * 36 + 2 * 6 + 4, 20, 10), compiled_bytes=(2 * 6 + 4, 4, 6),
                               eager_ops=40, compiled_kernels=14, loss_bytes_eager=36, loss_bytes_compiled=10)

# LLM Foundry's MPT block as its tables ran it, read from llmfoundry/models at the tables' commit
# (5e85bd62d: mpt/configuration_mpt.py, layers/blocks.py, layers/ffn.py, layers/norm.py, and
# submit_benchmarks.py, which sets norm_type 'low_precision_layernorm'), bytes per token of a
# block's forward in bf16:
#   two LPLayerNorms, each one fused kernel that reads and writes the row in bf16: 4 x dim each;
#   two residual adds, 6 x dim each (resid_pdrop 0: the dropout returns its input);
#   no RoPE (learned position embeddings, added once per model); q, k and v are views of the
#   fused Wqkv GEMM's output, which the Triton kernel reads as they lie: no layout copies;
#   the biases are added in the GEMMs' epilogue;
#   GELU (approximate 'none') reads and writes the MLP's width F, 4 x F; the job's SwiGLU width is
#   2F/3 (job_for), so 6 per unit of it;
#   17 ops eager (two norms, four linears, the chunk, four rearranges, attention, GELU, two
#   dropouts, two adds); compiled, each norm fused with the add before it, 8 kernels;
#   the loss: flash-attn's fused cross-entropy (modeling_mpt.py's default loss_fn
#   'fused_crossentropy'), reading the bf16 logits forward, reading and writing them backward: 6
#   bytes per logit;
#   its FP8 rows' casts are Transformer Engine's (Composer's amp_fp8 runs te.Linear), not
#   torchao's eager ones (perf.rates.float8_casts.CASTS).
MPT = Elementwise(eager_bytes=(2 * 4 + 2 * 6, 0, 4 * 3 / 2), compiled_bytes=(2 * 6, 0, 4 * 3 / 2), eager_ops=17,
                  compiled_kernels=8, loss_bytes_eager=6, loss_bytes_compiled=6, float8_casts="transformer_engine")


# Megatron keeps its parameters in bf16 (fp32 copies in its optimizer) and runs no autocast: a
# replica without FSDP pays none of autocast's casts (Elementwise.autocast_bytes), which TorchTitan
# and Composer, running torch's autocast over fp32 parameters there, do.
MEGATRON_LLAMA = dataclasses.replace(TORCHTITAN_LLAMA, autocast_bytes=(0, 0), autocast_weight_bytes=(0, 0))


@dataclass(frozen=True)
class SourceEngine:
    """Where a source's engine runs other kernels than this toolkit (PyTorch SDPA's flash attention,
    elementwise kernels eager or compiled as the row says), read from the source's own code."""

    attention: dict[str, str]  # GPU architecture -> attention kernel (perf.rates.kernels.ATTENTION); else "flash"
    fused: bool  # norms, RoPE, SwiGLU, float8 casts and the loss fused as torch.compile fuses them
    engine: Engine  # what the cost model prices as this engine runs it
    why: str

    def kernel(self, architecture: str) -> str:
        """The attention kernel this engine ran on a GPU of `architecture`."""
        return self.attention.get(architecture, "flash")

    @property
    def overlaps_tp(self) -> bool:
        """Whether it overlaps TP's collectives with their GEMMs itself (not as torch's async TP)."""
        return self.engine.tp_overlap != TITAN_EXP.tp_overlap


ENGINES = {
    "torchtitan": SourceEngine(
        {}, False, Engine(elementwise=TORCHTITAN_LLAMA, loss_compiled=False),
        "PyTorch SDPA's flash attention (flash first in torch's order in December "
        "2024; torch 2.11 on, this toolkit's SDPA runs cuDNN's on Hopper: perf.rates.kernels.SDPA_KERNEL); its "
        "Llama's memory-bound kernels as TORCHTITAN_LLAMA counts them, compiled where the table says; "
        "its loss eager, compile or not (torchtitan/train.py at 9dec370 compiles the blocks alone)"),
    "megatron_bridge": SourceEngine(
        {"hopper": "cudnn", "blackwell": "cudnn"}, True, Engine(tp_overlap="userbuffers", float8_experts=True),
        "Transformer Engine: src/megatron/bridge/recipes/llama/h100/llama3.py sets transformer_impl "
        "'transformer_engine' (norms fused with the linear after them and its float8 cast), attention_backend "
        "None (TE picks cuDNN's fused attention on Hopper and Blackwell) and cross_entropy_loss_fusion; "
        "scripts/performance/utils/overrides.py sets apply_rope_fusion; the 70B and 405B recipes (recipes/llama/"
        "llama3.py) set tp_comm_overlap (TE's userbuffers), which scripts/performance/configs/llama/ keeps, and "
        "sets for 8B wherever TP > 1; its MoE recipes (recipes/qwen/h100/qwen3_moe.py, recipes/gpt_oss/h100/"
        "gpt_oss.py) set moe_grouped_gemm (TE's grouped linears, which take the float8 recipe) and "
        "moe_permute_fusion"),
    "megatron_lm": SourceEngine(
        {"hopper": "cudnn"}, True, Engine(tp_overlap="userbuffers", float8_experts=True),
        "Megatron-Core with Transformer Engine (the README's figures, which name --tp-comm-overlap): as "
        "megatron_bridge; its A100 row (2021) predates flash attention and is priced at FlashAttention-2 all "
        "the same"),
    "llm_foundry": SourceEngine(
        {"ampere": "triton", "hopper": "triton"}, False, Engine(),
        "scripts/train/benchmarking/submit_benchmarks.py: --attn_impl defaults to 'triton' at every commit "
        "the tables were written at (Triton FlashAttention, 2023); eager PyTorch"),
}


def elementwise(row) -> Elementwise:
    """The memory-bound kernels of the model a row ran: MPT's for an MPT (LLM Foundry's rows), else
    TorchTitan's Llama (Megatron's GPT rows too, without autocast's casts: an assumption, their
    engine fuses them as compile does)."""
    if row["model"].startswith("mpt"):
        return MPT
    return MEGATRON_LLAMA if row.source.startswith("megatron") else TORCHTITAN_LLAMA
