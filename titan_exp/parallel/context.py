"""Context parallel: the sequence is split across the cp ranks; attention all-gathers keys
and values.

torch's `context_parallel` (ring attention) has no sharding rule for the CPU flash-attention
kernel, and FlexAttention has no CPU backward, so titan_exp implements CP directly and the same
code runs on gloo and NCCL:

- Load balance for causal attention: the sequence is cut into 2*cp chunks and cp rank r holds
  chunks r and 2cp-1-r, so every rank has the same amount of attention work.
- Each rank computes q, k, v for its positions, all-gathers k and v along the sequence (an
  autograd-aware all-gather whose backward reduce-scatters the gradients) and restores global
  order. Each of its two chunks then attends to the keys up to its own end, causal aligned to
  the lower right (torch.nn.attention.bias.causal_lower_right): on a GPU SDPA runs that in its
  fused kernels, the causal half of the matrix and no mask in memory; on a CPU the mask is made
  for the chunk. RoPE uses global positions.

Memory for k/v is that of the full sequence (ring attention would keep 1/cp of it); activations
everywhere else, and the MLP and projection work, are 1/cp. Parameters are replicated over cp
and their gradients reduced by FSDP over the flattened dp_shard x cp dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.nn.attention.bias import causal_lower_right

from titan_exp.config import JobConfig, problem

# torch 2.13 renamed all_gather_tensor_autograd (kept as a deprecated alias); 2.11 has the old name only.
ALL_GATHER = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def check(job: JobConfig, dims, cuda: bool) -> list[str]:
    """Each sequence is cut into 2 x cp load-balanced chunks."""
    seq_len = job.training.seq_len
    if dims.cp > 1 and seq_len % (2 * dims.cp):
        return [problem("parallelism.context_parallel_degree", dims.cp,
                        f"training.seq_len = {seq_len} must be divisible by 2 x cp = {2 * dims.cp} "
                        "(load-balanced chunks)")]
    return []


def positions(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """Global positions held by `cp_rank`: chunks r and 2cp-1-r of 2cp equal chunks."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)
    return torch.cat([first, second])


@dataclass
class ContextParallel:
    """What an attention layer needs to know to run context parallel."""

    group: object  # ProcessGroup of the cp dimension
    rank: int
    size: int
    seq_len: int

    def __post_init__(self):
        self.q_pos = positions(self.seq_len, self.rank, self.size)
        # all_gather stacks rank 0's positions, then rank 1's, ...: where each global position sits.
        gathered = torch.cat([positions(self.seq_len, r, self.size) for r in range(self.size)])
        self.order = torch.argsort(gathered)

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's positions of a (batch, seq, ...) tensor."""
        return t[:, self.q_pos.to(t.device)]

    def attention(self, q, k, v, cos, sin, apply_rope) -> torch.Tensor:
        """q, k, v: (batch, local_seq, heads, head_dim) for this rank's positions."""
        from titan_exp.models.layers import causal_attention

        q_pos, order = self.q_pos.to(q.device), self.order.to(q.device)
        q = apply_rope(q, cos[q_pos], sin[q_pos])
        k = apply_rope(k, cos[q_pos], sin[q_pos])
        kv = torch.cat([k, v], dim=-1)  # one collective for both
        kv = ALL_GATHER(kv, gather_dim=1, group=self.group)[:, order]
        k, v = kv.split(q.shape[-1], dim=-1)
        chunk = self.seq_len // (2 * self.size)
        out = []
        for i, index in enumerate((self.rank, 2 * self.size - 1 - self.rank)):  # positions()'s two chunks
            end = (index + 1) * chunk  # the chunk's last position + 1: the keys it sees
            out.append(causal_attention(q[:, i * chunk:(i + 1) * chunk], k[:, :end], v[:, :end],
                                        causal_lower_right(chunk, end)))
        return torch.cat(out, dim=1)


def apply_cp(model: nn.Module, cp_mesh, seq_len: int) -> ContextParallel:
    cp = ContextParallel(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size(), seq_len)
    for block in model.layers.values():
        block.attention.context_parallel = cp
    return cp
