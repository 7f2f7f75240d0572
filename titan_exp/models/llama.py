"""Llama 3: RMSNorm, RoPE, grouped-query attention, SwiGLU; DeepSeek-V3's multi-head latent
attention in its place (titan_exp.models.mla) and routed experts in the SwiGLU's
(titan_exp.models.moe) where the model config asks for them.

Written for parallelism from the start:
- blocks live in a ModuleDict keyed "0".."n-1", so a pipeline stage can drop blocks and keep
  every parameter's fully qualified name (checkpoints and weight init stay layout-independent);
- the embedding, final norm and output may be None on a pipeline stage that lacks them;
- attention infers its local head count from tensor shapes, so tensor parallel sharding of the
  projections needs no change here.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from titan_exp.config import JobConfig, ModelConfig, problem
from titan_exp.config.hf import config_errors
from titan_exp.models import mla, moe
from titan_exp.models.layers import FeedForward, apply_rope, causal_attention, rope_tables


def check(job: JobConfig, cuda: bool) -> list[str]:
    """Shapes Llama can be built with. (The vocabulary against the tokenizer is checked once the
    tokenizer exists: `check_vocab`.)"""
    m = job.model
    e = [] if m.mla else head_errors(m)  # MLA sizes its heads with fields of its own (mla.check)
    if m.kv_heads < 1 or m.n_heads % m.kv_heads:
        e.append(problem("model.n_kv_heads", m.n_kv_heads, f"must divide model.n_heads = {m.n_heads}"))
    for name in ("norm_eps", "rope_theta"):
        if not getattr(m, name) > 0:
            e.append(problem(f"model.{name}", getattr(m, name), "must be > 0"))
    if m.ffn_dim_multiplier is not None and not m.ffn_dim_multiplier > 0:
        e.append(problem("model.ffn_dim_multiplier", m.ffn_dim_multiplier, "must be > 0, or null"))
    if job.training.seq_len > m.max_seq_len:
        e.append(problem("training.seq_len", job.training.seq_len, f"exceeds model.max_seq_len = {m.max_seq_len}"))
    if m.intermediate_size is not None and m.intermediate_size < 1:
        e.append(problem("model.intermediate_size", m.intermediate_size, "must be >= 1, or null"))
    e += mla.check(job)
    if m.is_moe:
        e += moe.check(job)
    return e + config_errors(m)


def head_errors(m: ModelConfig) -> list[str]:
    """Grouped-query attention's head width: head_dim, or dim / n_heads, even for RoPE."""
    if m.head_dim is not None:
        if m.head_dim < 2 or m.head_dim % 2:
            return [problem("model.head_dim", m.head_dim, "must be even and >= 2 for RoPE, or null (dim / n_heads)")]
    elif m.dim % m.n_heads:
        return [problem("model.dim", m.dim, f"must be divisible by model.n_heads = {m.n_heads}, or set model.head_dim")]
    elif m.head_size % 2:
        return [problem("model.dim", m.dim, "head_dim = dim / n_heads must be even for RoPE; set model.head_dim")]
    return []


def check_vocab(cfg: ModelConfig, tokenizer_vocab: int) -> list[str]:
    if tokenizer_vocab > cfg.vocab_size:
        return [problem("model.vocab_size", cfg.vocab_size,
                        f"smaller than the tokenizer's vocabulary ({tokenizer_vocab}); set it to at least that")]
    return []


class Attention(nn.Module):
    # Set by titan_exp.parallel.context.apply_cp when the sequence is split across ranks.
    context_parallel = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_size
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)
        # Qwen3's QK-norm: one RMSNorm over each head's width, shared by the heads, before RoPE.
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallel each rank holds n_heads / tp of them.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.context_parallel is not None:
            out = self.context_parallel.attention(q, k, v, cos, sin, apply_rope)
        else:
            out = causal_attention(apply_rope(q, cos[:seqlen], sin[:seqlen]),
                                   apply_rope(k, cos[:seqlen], sin[:seqlen]), v)
        return self.wo(out.reshape(bsz, seqlen, -1))


class TransformerBlock(nn.Module):
    """Attention then a SwiGLU (`feed_forward`), or, in an MoE model's MoE layers, routed experts
    (`moe`, titan_exp.models.moe) in its place."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = mla.LatentAttention(cfg) if cfg.mla else Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        if cfg.is_moe_layer(layer):
            self.moe = moe.MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim)

    @property
    def ffn(self) -> nn.Module:
        return self.moe if hasattr(self, "moe") else self.feed_forward

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    # init_weights draws each parameter in full and cuts this rank's shard from it (layout-independent
    # weights), so every rank draws its whole stage. A dry run (cluster.dry_run), whose weights' values
    # do not matter under the fake process group, sets it False to draw its shards alone.
    draw_in_full = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.rope_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With `tie_word_embeddings`, make the output projection's weight the embedding's (one
        Parameter). Whatever builds a new Parameter per module undoes it, and is followed by this:
        `to_empty` (below), TP's distribution of each module's weights (parallel.parallelize)."""
        if self.cfg.tie_word_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def to_empty(self, *, device, recurse: bool = True) -> "Transformer":
        """nn.Module's, which gives each module a Parameter of its own (a model built on the meta
        device is materialized so), then the tie again."""
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) int64 -> logits (batch, seq, vocab); on a pipeline stage without
        the embedding the input is already hidden states, and without the output it stays so."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # Full RoPE tables: under sequence parallel a block's input holds seq/tp positions, and
        # attention (which sees the whole sequence) takes the rows it needs.
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic, layout-independent init: each parameter is drawn in full from a generator
        seeded by (seed, its name) and then cut to this rank's shard. A model split by FSDP, TP or
        PP therefore starts from exactly the weights of the single-process model. On a GPU the
        draws run there (a CPU takes about 25 s for a 3B model's): the same weights on
        every GPU layout, other numbers than a CPU's generator gives. With `draw_in_full` off each
        rank draws its shards alone: the same distributions, not the same numbers."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        cos, sin = rope_tables(self.cfg.rope_dim, self.cfg.max_seq_len, self.cfg.rope_theta)
        # Assigned, not copied: the tables stay fp32 even when the parameters are bf16.
        self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)
        for name, param in self.named_parameters():
            name = canonical_name(name)
            if name == "output.weight" and self.cfg.tie_word_embeddings:  # a pipeline's last stage: its copy
                name = "tok_embeddings.weight"  # of the embedding (one process names the tied matrix so)
            device = param.device if param.device.type == "cuda" else torch.device("cpu")
            gen = torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if not self.draw_in_full:  # the shard alone, from the same distribution
                _init_param(name, param.to_local() if isinstance(param, DTensor) else param, self.cfg, gen)
                continue
            full = torch.empty(param.shape, dtype=torch.float32, device=device)
            _init_param(name, full, self.cfg, gen)
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.copy_(full)
        for module in self.modules():
            if hasattr(module, "init_buffers"):  # MoE: the load-balancing bias and counts
                module.init_buffers()


def canonical_name(name: str) -> str:
    """A parameter's name without wrapper prefixes (activation checkpointing inserts one), so
    seeds and checkpoints do not depend on which wrappers a run used."""
    return name.replace("_checkpoint_wrapped_module.", "")


def _init_param(name: str, t: torch.Tensor, cfg: ModelConfig, gen: torch.Generator) -> None:
    """TorchTitan's Llama init: unit-normal embeddings, 0.02 for input projections, depth-scaled
    std for projections that write into the residual stream, dim^-0.5 for the output. A tied
    matrix (named tok_embeddings) takes the output's: as the output's weight a unit normal gives
    logits of size sqrt(dim), a first loss of 250 on the debug model; the first block's norm takes
    the embedding's scale away."""
    if name.endswith("norm.weight"):
        t.fill_(1.0)
    elif name.startswith("tok_embeddings") and not cfg.tie_word_embeddings:
        t.normal_(0.0, 1.0, generator=gen)
    elif name.startswith(("output", "tok_embeddings")):
        std = cfg.dim**-0.5
        nn.init.trunc_normal_(t, 0.0, std, -3 * std, 3 * std, generator=gen)
    elif name.startswith("layers."):
        layer_id = int(name.split(".")[1])
        residual = name.endswith(("wo.weight", "w2.weight", "w3.weight", "experts.w2", "experts.w3"))
        std = 0.02 / math.sqrt(2 * (layer_id + 1)) if residual else 0.02
        nn.init.trunc_normal_(t, 0.0, std, -2 * std, 2 * std, generator=gen)
    else:
        raise ValueError(f"no init rule for parameter {name!r}")


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token, TorchTitan's count:
        6 * (N - N_embedding) + 6 * n_layers * n_heads * (2 * head_dim) * seq_len
    The first term is forward (2) + backward (4) FLOPs of every matmul weight; the embedding is a
    lookup, not a matmul. The second is the attention scores and the weighted sum of values
    (QK^T and PV, 2 * head_dim multiply-adds per head, position and layer; under multi-head latent
    attention the query/key width plus the value width), without a causal discount. With tied
    embeddings the shared matrix is counted once, as the output matmul. In an MoE model N counts
    the active parameters: the experts a token is routed to, not all of them."""
    dense = cfg.active_params - (0 if cfg.tie_word_embeddings else cfg.embedding_params)
    return 6 * dense + 6 * cfg.n_layers * cfg.n_heads * (cfg.head_size + cfg.v_head_size) * seq_len
