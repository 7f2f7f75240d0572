"""The layers Llama (titan_exp.models.llama), its mixture of experts (titan_exp.models.moe) and
multi-head latent attention (titan_exp.models.mla) share: the SwiGLU, RoPE and causal SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) as Llama's complex formulation does.
    x: (batch, seq, heads, head_dim); cos/sin: (seq, head_dim/2)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """(batch, seq, heads, head_dim) in and out; k/v heads are repeated for GQA. Causal unless
    an explicit mask is given: boolean (True = attend), or one of torch's causal biases
    (torch.nn.attention.bias: context parallel's lower-right causal chunks)."""
    repeats = q.shape[2] // k.shape[2]
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None
    )
    return out.transpose(1, 2)


class SumGradOver(torch.autograd.Function):
    """The identity, whose backward sums the gradient over `mesh`'s ranks (each rank's gradient
    holds its own share: its tokens', or its heads')."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh) -> torch.Tensor:
        ctx.mesh = mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        from torch.distributed._functional_collectives import all_reduce, wait_tensor

        return wait_tensor(all_reduce(grad.contiguous(), "sum", ctx.mesh)), None
