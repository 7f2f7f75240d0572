"""Multi-head latent attention (MLA), DeepSeek-V2's and V3's: attention whose keys and values come
up from a narrow latent, on when `model.kv_lora_rank > 0`.

Per token: the hidden state goes down to a latent of kv_lora_rank (wkv_a, which also gives the
key's RoPE part, qk_rope_head_dim wide and shared by every head), is normalized (kv_norm) and goes
up to every head's key part without RoPE and its value (wkv_b). Queries come straight from the
hidden state (wq), or through a latent of q_lora_rank (wq_a, q_norm, wq_b). A query/key head is
qk_nope_head_dim + qk_rope_head_dim wide and RoPE rotates its last qk_rope_head_dim; a value head
is v_head_dim wide. Attention is then SDPA over n_heads heads, causal, at 1/sqrt(query width).

Under tensor parallel the up-projections split by heads as Llama's q/k/v do and wo by rows; the
down-projections and their norms run whole on every TP rank (titan_exp.parallel.tensor), and the
key's RoPE part, which every rank's heads read, has its gradient summed over the ranks. Under
context parallel the keys' RoPE part is rotated at each rank's positions with the rest
(titan_exp.parallel.context).
"""

from __future__ import annotations

import torch
from torch import nn

from titan_exp.config import JobConfig, ModelConfig, problem
from titan_exp.models.layers import SumGradOver, apply_rope, causal_attention

FIELDS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def check(job: JobConfig) -> list[str]:
    """MLA's fields: all three head widths with it, none of them (nor q_lora_rank) without it,
    and none of grouped-query attention's fields with it. (Hugging Face import and export refuse
    it: titan_exp.models.hf.check, which validation gathers.)"""
    m, e = job.model, []
    if not m.mla:
        for name in ("q_lora_rank", *FIELDS):
            if getattr(m, name):
                e.append(problem(f"model.{name}", getattr(m, name), "is used only by multi-head latent attention; "
                                 "set model.kv_lora_rank > 0 too (DeepSeek-V3: 512), or leave it unset"))
        return e
    for name in FIELDS:
        value = getattr(m, name)
        if value is None or value < 1:
            e.append(problem(f"model.{name}", value, "multi-head latent attention (model.kv_lora_rank > 0) needs it "
                             ">= 1 (DeepSeek-V3: qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128)"))
    if m.qk_rope_head_dim and m.qk_rope_head_dim % 2:
        e.append(problem("model.qk_rope_head_dim", m.qk_rope_head_dim, "must be even (RoPE rotates pairs)"))
    if m.head_dim is not None:
        e.append(problem("model.head_dim", m.head_dim, "multi-head latent attention sizes its heads with "
                         "model.qk_nope_head_dim, qk_rope_head_dim and v_head_dim; leave it unset"))
    if m.n_kv_heads not in (None, m.n_heads):
        e.append(problem("model.n_kv_heads", m.n_kv_heads, "multi-head latent attention gives every head its own "
                         "keys and values; leave it unset"))
    return e


def rope_tail(nope: int):
    """RoPE (layers.apply_rope) on the last part of each head only, past its first `nope` entries."""

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[..., :nope], apply_rope(x[..., nope:], cos, sin)], dim=-1)

    return rotate


class LatentAttention(nn.Module):
    # Set by titan_exp.parallel.context.apply_cp when the sequence is split across ranks.
    context_parallel = None
    # Set by titan_exp.parallel.tensor.apply_tp: the TP ranks, each holding n_heads / tp heads.
    tp_mesh = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.nope, self.rope, self.v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.latent = cfg.kv_lora_rank
        qk, h = self.nope + self.rope, cfg.n_heads
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, h * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, self.latent + self.rope, bias=False)
        self.kv_norm = nn.RMSNorm(self.latent, eps=cfg.norm_eps)
        self.wkv_b = nn.Linear(self.latent, h * (self.nope + self.v), bias=False)
        self.wo = nn.Linear(h * self.v, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallel each rank holds n_heads / tp of them.
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q = q.view(bsz, seqlen, -1, self.nope + self.rope)
        latent, k_rope = self.wkv_a(x).split([self.latent, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seqlen, -1, self.nope + self.v)
        k_nope, v = kv.split([self.nope, self.v], dim=-1)
        if self.tp_mesh is not None:  # the shared RoPE part serves every rank's heads: sum their gradients
            k_rope = SumGradOver.apply(k_rope, self.tp_mesh)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        rope = rope_tail(self.nope)
        if self.context_parallel is not None:
            out = self.context_parallel.attention(q, k, v, cos, sin, rope)
        else:
            out = causal_attention(rope(q, cos[:seqlen], sin[:seqlen]), rope(k, cos[:seqlen], sin[:seqlen]), v)
        return self.wo(out.reshape(bsz, seqlen, -1))
