"""Mixture of experts: the SwiGLU of a Llama block replaced by routed experts.

Token-choice top-k routing (softmax or sigmoid scores), optional shared experts that every token
goes through, capacity-free dispatch (no token is dropped or re-routed), and DeepSeek-V3's
auxiliary-loss-free load balancing: a per-expert bias, added to the scores only to choose the top
k, nudged after every step towards the experts that got fewer tokens (`update_expert_bias`). An
optional sequence-wise balance loss (`model.aux_loss_coeff`) enters through the router's backward.

Dispatch sorts the tokens by expert. Without expert parallel the experts then run locally; with it
(`ep_mesh` set by titan_exp.parallel.expert) each rank holds n_experts / ep of them, the token
counts per expert are exchanged first, then the tokens themselves go to their experts' ranks in
one all-to-all and come back in another (`_exchange`). Under tensor parallel (`tp_mesh`) the layer
sees the whole (gathered) sequence and every TP rank routes all of it; no routed expert's work is
done twice. With expert parallel, which spreads over the TP ranks, each TP rank dispatches only the
tokens of its own sequence shard, the one it keeps of the output. Without it, each TP rank holds a
slice of every expert's hidden width (titan_exp.parallel.tensor) and runs every routed token
through it, so its output is a partial sum that TP reduce-scatters, as a dense SwiGLU's. The
routing, the combine and the order of every sum are the same either way, so a TP or EP layout
computes what one process does.

Shape letters: T tokens, D model dim, E experts, e local experts, K top-k, N = T*K routed rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_exp.config import AuxLoss, JobConfig, ModelConfig, ScoreFunc, problem
from titan_exp.models.layers import FeedForward, SumGradOver


def check(job: JobConfig) -> list[str]:
    """An MoE model's own fields, and what it does not compose with (yet)."""
    m, e = job.model, []
    if m.top_k > m.n_experts:
        e.append(problem("model.top_k", m.top_k, f"exceeds model.n_experts = {m.n_experts}"))
    if m.moe_hidden_dim is not None and m.moe_hidden_dim < 1:
        e.append(problem("model.moe_hidden_dim", m.moe_hidden_dim, "must be >= 1, or null for the dense width"))
    if m.n_dense_layers >= m.n_layers:
        e.append(problem("model.n_dense_layers", m.n_dense_layers,
                         f"leaves no MoE layer of model.n_layers = {m.n_layers}; lower it or set model.n_experts=0"))
    if not m.route_scale > 0:
        e.append(problem("model.route_scale", m.route_scale, "must be > 0 (it scales the routed experts' output)"))
    if m.load_balance_coeff is not None and not m.load_balance_coeff > 0:
        e.append(problem("model.load_balance_coeff", m.load_balance_coeff, "must be > 0, or null to turn the bias off"))
    if m.aux_loss_coeff < 0:
        e.append(problem("model.aux_loss_coeff", m.aux_loss_coeff, "must be >= 0 (0 turns the balance loss off)"))
    if m.aux_loss_coeff > 0 and job.parallelism.context_parallel_degree > 1:
        e.append(problem("model.aux_loss_coeff", m.aux_loss_coeff,
                         "the sequence-wise balance loss needs whole sequences, which context parallel splits; "
                         "set it to 0 (the bias balances the load) or context_parallel_degree=1"))
    return e


class Router(nn.Module):
    """Scores every expert for every token (in fp32, whatever the compute dtype: small score
    differences decide the routing) and picks each token's top k."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.top_k, self.score_func = cfg.top_k, cfg.score_func
        self.route_norm, self.route_scale = cfg.route_norm, cfg.route_scale

    def forward(self, x_TD: torch.Tensor, bias_E: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        logits = F.linear(x_TD.float(), _local(self.gate.weight).float())
        scores_TE = logits.softmax(-1) if self.score_func == ScoreFunc.softmax else logits.sigmoid()
        choice = scores_TE if bias_E is None else scores_TE + bias_E  # the bias chooses; it never weighs
        ids_TK = choice.topk(self.top_k, dim=-1).indices
        weights_TK = scores_TE.gather(-1, ids_TK)
        if self.route_norm:
            weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
        return weights_TK * self.route_scale, ids_TK, scores_TE


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as three (E, ...) tensors, so expert parallel shards dim 0.

    Under expert parallel an expert's gradient is the sum over the tokens of all ep ranks (the
    all-to-all's backward brings them), where every other gradient is one rank's share, averaged by
    FSDP over the data-parallel ranks. FSDP averages the experts over efsdp only, so `grad_scale`
    (tp / ep, set by titan_exp.parallel.expert) divides by the rest, the data-parallel ranks in
    ep (TP's ranks dispatch parts of the same sequences: their shares add up): every gradient is
    then the mean over all data-parallel ranks, as in one process."""

    grad_scale = 1.0

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x_ND: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
        """x_ND holds the rows of local expert 0, then 1, ...; counts_e says how many each."""
        w1, w2, w3 = (_ScaleGrad.apply(_local(w), self.grad_scale) for w in (self.w1, self.w2, self.w3))
        if x_ND.is_cuda and hasattr(torch, "_grouped_mm") and x_ND.dtype == torch.bfloat16:
            # One kernel for all experts, and no host sync; bf16 weights (under autocast they are fp32).
            w1, w2, w3 = (w.to(torch.bfloat16) for w in (w1, w2, w3))
            offsets = counts_e.cumsum(0, dtype=torch.int32)
            h = F.silu(torch._grouped_mm(x_ND, w1.transpose(-2, -1), offs=offsets))
            h = h * torch._grouped_mm(x_ND, w3.transpose(-2, -1), offs=offsets)
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)
        outs = []
        for i, rows in enumerate(x_ND.split(counts_e.tolist())):
            h = F.silu(rows @ w1[i].transpose(0, 1)) * (rows @ w3[i].transpose(0, 1))
            outs.append(h @ w2[i].transpose(0, 1))
        return torch.cat(outs)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the routed experts compute in: autocast's where it is on (bf16 without FSDP,
    whose residual stream stays fp32), else x's. Routed rows are cast to it before they are copied
    and sent, so that a bf16 run takes CUDA's grouped GEMM (bf16 only) and moves half the bytes."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def _local(w: torch.Tensor) -> torch.Tensor:
    """A weight as this rank holds it: its experts under EP (a DTensor sharded over experts), its
    slice of every expert's width under TP without EP, the router whole (a DTensor replicated over
    TP; parallel/tensor.py)."""
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale if ctx.scale != 1.0 else grad, None


class _AddAuxLoss(torch.autograd.Function):
    """Returns x unchanged; in backward, gives `aux` the gradient 1, as if it had been added to
    the loss. The balance loss so needs no second output, which a pipeline stage could not carry."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


class MoE(nn.Module):
    # Set by titan_exp.parallel.expert.apply_ep: the mesh the routed experts are split over; and by
    # titan_exp.parallel.tensor.distribute_moe_params (tp > 1): the TP mesh, whose ranks dispatch
    # their own sequence shards under EP, or each run a slice of every expert's width without it.
    ep_mesh = tp_mesh = None
    # Whether a forward with gradients counts its tokens per expert (off for a pipeline stage's
    # shape inference: titan_exp.parallel.pipeline.Stage).
    counting = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.expert_hidden_dim)
        self.shared_experts = (FeedForward(cfg.dim, cfg.expert_hidden_dim * cfg.n_shared_experts)
                               if cfg.n_shared_experts else None)
        self.load_balance_coeff, self.aux_loss_coeff = cfg.load_balance_coeff, cfg.aux_loss_coeff
        # The balance loss per sequence, and how layers add up: DeepSeek-V3's summed, Switch's averaged.
        self.balance_loss = BALANCE_LOSSES[cfg.aux_loss]
        self.layer_weight = 1.0 if cfg.aux_loss == AuxLoss.sequence else 1.0 / cfg.n_moe_layers
        # 1 / sequences per rank per optimizer step; the trainer sets it so the balance loss of every
        # microbatch adds up to the rank's mean over its sequences, as the token loss does.
        self.aux_loss_scale = 1.0
        # The bias is state (checkpointed); the counts are this step's, summed by the trainer.
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.n_experts), persistent=False)
        # This step's balance loss of this layer without its coefficient (logged apart from the loss).
        self.register_buffer("aux_loss", torch.zeros(()), persistent=False)

    def init_buffers(self) -> None:
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()
        self.aux_loss.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, dim = x.shape
        x_TD = x.reshape(-1, dim)
        bias = self.expert_bias if self.load_balance_coeff is not None else None
        weights_TK, ids_TK, scores_TE = self.router(x_TD, bias)
        choices = ids_TK.flatten()
        counts_E = self._counts(choices)
        if self.counting and torch.is_grad_enabled():  # training forwards only (validation runs without grad)
            self.tokens_per_expert.add_(counts_E)
        # Sort the (token, choice) pairs by expert; stable, so the order never depends on layout.
        x_routed = x_TD
        if self.tp_mesh is not None and self.ep_mesh is not None:  # this TP rank's sequence shard's pairs only
            pairs_N = self._own_pairs(bsz, seqlen, x.device)
            own_N = choices[pairs_N]
            order_N, counts_E = pairs_N[own_N.argsort(stable=True)], self._counts(own_N)
        else:
            order_N = choices.argsort(stable=True)
            if self.tp_mesh is not None:  # each TP rank's slice of the experts' width adds its share of x's gradient
                x_routed = SumGradOver.apply(x_TD, self.tp_mesh)
        if self.tp_mesh is not None:
            # Each rank's combine weighs its own tokens or its partial outputs: their gradients add
            # up over TP, so the router, which every TP rank runs whole, gets the same gradient on each.
            weights_TK = SumGradOver.apply(weights_TK, self.tp_mesh)
        token_N = order_N // self.top_k
        routed_ND = self._exchange(x_routed.to(compute_dtype(x_TD))[token_N], counts_E)
        weighted = routed_ND.float() * weights_TK.flatten()[order_N, None]
        out_TD = torch.zeros_like(x_TD).index_add_(0, token_N, weighted.to(x_TD.dtype))
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        if self.aux_loss_coeff and torch.is_grad_enabled():
            aux = self.layer_weight * self.aux_loss_scale * self.balance_loss(scores_TE, ids_TK, bsz, self.top_k)
            if self.counting:
                self.aux_loss.add_(aux.detach())
            out_TD = _AddAuxLoss.apply(out_TD, self.aux_loss_coeff * aux)
        return out_TD.view(bsz, seqlen, dim)

    def _counts(self, choices_N: torch.Tensor) -> torch.Tensor:
        """Rows per expert, by scatter-add into E slots, not bincount, whose output size depends
        on the data: a host sync on CUDA and a graph break under compile, every MoE layer."""
        ones = torch.ones_like(choices_N)
        return torch.zeros(self.n_experts, dtype=torch.int64, device=choices_N.device).scatter_add_(0, choices_N, ones)

    def _own_pairs(self, bsz: int, seqlen: int, device) -> torch.Tensor:
        """The (token, choice) pairs, as indices into the flattened top-k ids, of this TP rank's
        sequence shard (sequence parallel's Shard(1): an equal run of positions of every
        sequence), in order; as many whatever the routing, so no host sync."""
        shard = seqlen // self.tp_mesh.size()
        first = torch.arange(bsz, device=device)[:, None] * seqlen + self.tp_mesh.get_local_rank() * shard
        tokens = (first + torch.arange(shard, device=device)).flatten()
        return (tokens[:, None] * self.top_k + torch.arange(self.top_k, device=device)).flatten()

    def _exchange(self, rows_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for rows sorted by expert. Under expert parallel: send each row to
        the rank holding its expert, run the local experts, send the results back."""
        if self.ep_mesh is None:
            return self.experts(rows_ND, counts_E)
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        ep = self.ep_mesh.size()
        counts_se = self._exchange_counts(counts_E)
        # The rows each rank sends and receives: one copy to the host, which waits for the GPU (once
        # a layer, not once a list), and the total given to repeat_interleave so it need not wait.
        sizes = torch.cat([counts_E.view(ep, -1).sum(1), counts_se.sum(1)]).tolist()
        send, recv = sizes[:ep], sizes[ep:]
        got = all_to_all_single_autograd(rows_ND, recv, send, group=self.ep_mesh)
        # Arrived grouped by source rank then expert; the experts want expert then source.
        segment = torch.repeat_interleave(torch.arange(counts_se.numel(), device=counts_se.device), counts_se.flatten(),
                                          output_size=sum(recv))
        e = counts_se.shape[1]
        perm = ((segment % e) * ep + segment // e).argsort(stable=True)
        out = self.experts(got[perm], counts_se.sum(0))[perm.argsort()]
        return all_to_all_single_autograd(out, send, recv, group=self.ep_mesh)

    def _exchange_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """(ep, local experts): counts[s, j] is how many rows source rank s sends to this rank's
        local expert j (an all-to-all of every rank's counts per expert)."""
        from torch.distributed._functional_collectives import all_to_all_single

        return all_to_all_single(counts_E, None, None, group=self.ep_mesh).wait().view(self.ep_mesh.size(), -1)


def sequence_balance_loss(scores_TE: torch.Tensor, ids_TK: torch.Tensor, bsz: int, top_k: int) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss, summed over the sequences:
    per sequence, sum_i f_i * P_i with f_i = E / (K * S) * (tokens choosing expert i) and P_i the
    mean normalized score of expert i. Summed (the caller scales by 1 / sequences), so splitting
    the batch over ranks or microbatches changes nothing."""
    n_experts = scores_TE.shape[-1]
    probs = (scores_TE / scores_TE.sum(-1, keepdim=True)).view(bsz, -1, n_experts)
    seqlen = probs.shape[1]
    chosen = torch.zeros_like(probs).scatter_(-1, ids_TK.view(bsz, seqlen, top_k), 1.0)
    f = chosen.sum(1) * (n_experts / (top_k * seqlen))
    return (f * probs.mean(1)).sum()


def switch_balance_loss(scores_TE: torch.Tensor, ids_TK: torch.Tensor, bsz: int, top_k: int) -> torch.Tensor:
    """Switch Transformer's balance loss as transformers computes Qwen3-MoE's, summed over the
    sequences: per sequence, E * sum_i f_i * P_i with f_i the tokens choosing expert i over the
    sequence's length (top-k choices: the f_i add up to K) and P_i expert i's mean router
    probability. transformers takes f and P over its whole batch and all layers at once; per
    sequence (and averaged over layers, MoE.layer_weight) it is the same for every layout and
    microbatching, and transformers' own for one sequence and one MoE layer."""
    n_experts = scores_TE.shape[-1]
    probs = (scores_TE / scores_TE.sum(-1, keepdim=True)).view(bsz, -1, n_experts)  # softmax's already are
    seqlen = probs.shape[1]
    chosen = torch.zeros_like(probs).scatter_(-1, ids_TK.view(bsz, seqlen, top_k), 1.0)
    return n_experts * (chosen.mean(1) * probs.mean(1)).sum()


BALANCE_LOSSES = {AuxLoss.sequence: sequence_balance_loss, AuxLoss.switch: switch_balance_loss}


def aux_loss_sum(layers: list[MoE], device) -> torch.Tensor:
    """This rank's balance loss of the step, without its coefficient: its MoE layers' summed
    (each already weighted as the layers add up; 0 on a stage without one)."""
    return sum((layer.aux_loss for layer in layers), torch.zeros((), device=device))


def moe_layers(model_parts) -> list[MoE]:
    return [m for part in model_parts for m in part.modules() if isinstance(m, MoE)]


@torch.no_grad()
def reset_counts(layers: list[MoE]) -> None:
    for layer in layers:
        layer.tokens_per_expert.zero_()
        layer.aux_loss.zero_()


@torch.no_grad()
def update_expert_bias(layers: list[MoE], group, move: bool = True) -> torch.Tensor | None:
    """After a step's backward: sum each layer's token counts over the data-parallel ranks
    (`group`, the ranks that saw different tokens), then, if the step's update is made (`move`),
    move each bias by load_balance_coeff towards balance (up for experts below the mean load,
    down above it; centred). Returns the global counts (layers, E), still on the device, for the
    load metrics."""
    if not layers:
        return None
    counts = torch.stack([layer.tokens_per_expert for layer in layers])
    if group is not None:
        torch.distributed.all_reduce(counts, group=group)
    for layer, c in zip(layers, counts):
        if layer.load_balance_coeff is None or not move:
            continue
        delta = layer.load_balance_coeff * torch.sign(c.mean() - c)
        layer.expert_bias.add_(delta - delta.mean())
    return counts


def load_stats(counts: torch.Tensor, layers: list[MoE]) -> torch.Tensor:
    """(max/mean load, min/mean load, largest |bias|) over this rank's MoE layers, on the
    device: 1.0 / 1.0 is perfect balance, max/mean = E / K means one expert took every token."""
    ratio = counts / counts.mean(-1, keepdim=True).clamp_min(1e-9)
    bias = torch.stack([layer.expert_bias.abs().max() for layer in layers])
    return torch.stack([ratio.max(), -ratio.min(), bias.max()])  # negated: reduced by MAX across stages
