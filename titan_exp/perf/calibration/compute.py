"""What calibration measures of compute (titan_exp.perf.calibration.measure): the model's blocks, by
themselves and inside real TP / CP / FSDP models, the GEMMs, AdamW, fresh memory and compile."""

from __future__ import annotations

import dataclasses
import functools
import statistics
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from titan_exp.config import ModelConfig, OptimizerImpl
from titan_exp.perf.calibration.kernels import matmul, matmul_dtypes
from titan_exp.perf.calibration.timing import Options, Runs, in_rounds, medians, side_by_side, timed, together
from titan_exp.perf.model.shapes import attention_linears, tp_degrees
from titan_exp.perf.rates.profile import Line
from titan_exp.train.optim import kernels


def sharded_block(m: ModelConfig, tp: int, device: torch.device) -> nn.Module:
    """The model's block as one TP rank holds it: n_heads / tp heads (multi-head latent attention's
    with its latents' projections whole, as TP leaves them), ffn / tp SwiGLU width. For
    an MoE model an MoE block, whose router and routed experts TP leaves whole (all experts
    local: under EP a rank computes as many routed tokens on average, sent by all-to-all, which
    is costed apart)."""
    from titan_exp.models.layers import FeedForward
    from titan_exp.models.llama import TransformerBlock

    block = TransformerBlock(m, layer=m.n_dense_layers)
    if m.mla:
        from titan_exp.models.mla import LatentAttention

        block.attention = LatentAttention(dataclasses.replace(m, n_heads=m.n_heads // tp))
    else:
        a, hd = block.attention, m.head_size
        a.wq = nn.Linear(m.dim, m.n_heads // tp * hd, bias=False)
        a.wk = nn.Linear(m.dim, m.kv_heads // tp * hd, bias=False)
        a.wv = nn.Linear(m.dim, m.kv_heads // tp * hd, bias=False)
        a.wo = nn.Linear(m.n_heads // tp * hd, m.dim, bias=False)
    if m.is_moe:
        for w in block.moe.experts.parameters():
            nn.init.normal_(w, std=0.02)
        block.moe.init_buffers()
        if m.n_shared_experts:
            block.moe.shared_experts = FeedForward(m.dim, m.expert_hidden_dim * m.n_shared_experts // tp)
    else:
        block.feed_forward = FeedForward(m.dim, m.ffn_hidden_dim // tp)
    return block.to(device)


def block_runs(m: ModelConfig, tp: int, seqs: int, seq_len: int, device: torch.device):
    """(block, forward, forward + backward) of one TP rank's block on `seqs` sequences."""
    from titan_exp.models.llama import rope_tables

    block = sharded_block(m, tp, device)
    cos, sin = (t.to(device) for t in rope_tables(m.rope_dim, seq_len, m.rope_theta))
    x = torch.randn(seqs, seq_len, m.dim, device=device, requires_grad=True)

    @torch.no_grad()
    def fwd():
        return block(x, cos, sin)

    def fwd_bwd():
        block(x, cos, sin).sum().backward()

    return block, fwd, fwd_bwd


def plain_block_runs(m: ModelConfig, tp: int, seq_len: int, opts: Options, device: torch.device) -> Runs:
    """One TP rank's share of a block by itself, forward and forward + backward, by sequences:
    finished as (forward, forward + backward) Lines."""
    runs = [block_runs(m, tp, seqs, seq_len, device)[1:] for seqs in opts.sequences]

    def finish(times: list[list[float]]) -> tuple[Line, Line]:
        t = medians(times)
        return Line.fit(opts.sequences, t[0::2]), Line.fit(opts.sequences, t[1::2])

    return Runs([fn for run in runs for fn in run], finish)


# The real models compared: a block in situ is (MORE_BLOCKS-block model - 1-block model) / (MORE_BLOCKS - 1).
# 3 rather than 2: the difference is twice the signal for the same timing noise (a calibration of
# the 100M model at world 2 saw one block's in-situ cost at 4 sequences come out 0.23, 0.30 and
# 0.25 s in three rounds of 1 vs 2 blocks), for a third more time.
MORE_BLOCKS = 3


def real_model_runs(m: ModelConfig, seq_len: int, opts: Options, device: torch.device,
                    parallelize: Callable[[nn.Module], object], *, free_grads: bool = False,
                    update: bool = False) -> Runs:
    """A real model with 1 and with MORE_BLOCKS blocks, `parallelize`d in place, forward +
    backward with its loss on sequences of seq_len positions, by sequences: finished as (one
    more block, the 1-block model, and with `update` the optimizer phase by blocks), each a Line.
    `free_grads` sets the gradients to None before each step, as training does. `update` also
    times what a training step does after backward, the gradient norm and clipping
    (train.optim.clip_grad_norm_) and AdamW's step, on each model's own gradients: a Line whose
    latency is the model's rest and whose per-unit cost is a block's. On DTensor parameters (TP)
    that phase is DTensor's dispatch per parameter and an all-reduce per gradient norm, not
    AdamW's arithmetic: a debug-model tp8 step at world 8 spent 1.2 of its 3.2 s there."""
    from titan_exp.models.llama import Transformer
    from titan_exp.train.optim import clip_grad_norm_

    models = {}
    for layers in (1, MORE_BLOCKS):
        models[layers] = Transformer(dataclasses.replace(m, n_layers=layers)).to(device)
        parallelize(models[layers])
        models[layers].init_weights(0)  # an MoE's experts and buffers start empty

    def step(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        if free_grads:
            model.zero_grad(set_to_none=True)
        F.cross_entropy(model(tokens).flatten(0, 1), labels).backward()

    def optimizer_phase(params: list[nn.Parameter], opt: torch.optim.Optimizer) -> None:
        clip_grad_norm_(params, 1.0)
        opt.step()

    steps = []  # by sequences: the 1-block model, then the bigger one
    for seqs in opts.sequences:
        tokens = torch.randint(0, m.vocab_size, (seqs, seq_len), device=device)
        labels = torch.randint(0, m.vocab_size, (seqs * seq_len,), device=device)
        steps += [functools.partial(step, models[layers], tokens, labels) for layers in (1, MORE_BLOCKS)]
    n = len(steps)
    if update:  # after the forward + backward steps of each round, so every model has gradients
        for layers in (1, MORE_BLOCKS):
            params = list(models[layers].parameters())
            optimizer = torch.optim.AdamW(params, lr=1e-4, **adamw(device))
            steps.append(functools.partial(optimizer_phase, params, optimizer))

    def finish(times: list[list[float]]) -> tuple[Line, Line, Line | None]:
        one = medians([r[:n] for r in times])[0::2]
        updates = None
        if update:
            first, more = medians([r[n:] for r in times])
            per_block = max(0.0, (more - first) / (MORE_BLOCKS - 1))
            updates = Line(max(0.0, first - per_block), per_block)
        extra = medians([block_differences(r, len(opts.sequences)) for r in times])
        return Line.fit(opts.sequences, extra), Line.fit(opts.sequences, one), updates

    return Runs(steps, finish)


def block_differences(round_times: list[float], sizes: int) -> list[float]:
    """One round of real_model_runs' timings: one block's share of the difference between the
    two models, by sequences."""
    steps = round_times[:2 * sizes]
    return [(b - a) / (MORE_BLOCKS - 1) for a, b in zip(steps[0::2], steps[1::2])]


def real_model_lines(m: ModelConfig, seq_len: int, opts: Options, device: torch.device,
                     parallelize: Callable[[nn.Module], object], **kwargs) -> tuple[Line, Line, Line | None]:
    """real_model_runs, timed by themselves."""
    runs = real_model_runs(m, seq_len, opts, device, parallelize, **kwargs)
    return runs.finish(in_rounds(runs.fns, opts, device))


def submesh(world: int, size: int, name: str, device: torch.device):
    """The groups of `size` consecutive ranks, all at once: a mesh dim named `name`."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world // size, size), mesh_dim_names=("rest", name))[name]


def measure_compute(m: ModelConfig, seq_len: int, world: int, opts: Options, device: torch.device
                    ) -> tuple[dict[int, tuple[Line, Line]], dict[int, tuple[Line, Line, Line | None]], float]:
    """Per TP degree (1 included): the plain block (plain_block_runs) and the real model
    (real_model_runs: tensor parallel with titan_exp.parallel.tensor's plan and sequence parallel
    on a mesh of that size, its optimizer phase timed when tp > 1); and how much more a block
    costs inside the real model than by itself (tp 1). All of them are timed side by side in the
    same rounds: a block's compute, TP's addition (real minus plain) and the in-situ factor (real
    over plain) are each a comparison, and timed a minute apart they took the machine's drift
    between the two for a cost. The factor scales the layouts without TP and cancels out of the
    TP ones (priced by their real TP block): the 100M model's at world 2 came out 1.14 and 1.24 in
    two calibrations timed apart, 1.00 in two side by side, and at 1.24 `pp2` and `dp_replicate2`
    fell below `tp2`. The factor is the median over rounds of each
    round's ratio of sums over the sizes (one size's block difference is noisy by itself)."""
    from titan_exp.parallel.tensor import apply_tp

    degrees = tp_degrees(m, world)
    plain, real = {}, {}
    for tp in degrees:
        mesh = submesh(world, tp, "tp", device) if tp > 1 else None

        def parallelize(model, mesh=mesh):
            if mesh is not None:
                apply_tp(model, mesh, loss_parallel=False)

        plain[tp] = plain_block_runs(m, tp, seq_len, opts, device)
        real[tp] = real_model_runs(m, seq_len, opts, device, parallelize, update=tp > 1)
    times = side_by_side([plain[tp] for tp in degrees] + [real[tp] for tp in degrees], opts, device)
    plain_times, real_times = dict(zip(degrees, times)), dict(zip(degrees, times[len(degrees):]))
    sizes = len(opts.sequences)
    ratios = [sum(block_differences(r, sizes)) / sum(p[1::2]) for r, p in zip(real_times[1], plain_times[1])]
    return ({tp: plain[tp].finish(plain_times[tp]) for tp in degrees},
            {tp: real[tp].finish(real_times[tp]) for tp in degrees}, statistics.median(ratios))


def measure_cp_blocks(m: ModelConfig, seq_len: int, world: int, opts: Options, device: torch.device) -> dict[int, Line]:
    """Per CP degree: one block of a real context-parallel model (titan_exp.parallel.context) on
    this rank's seq_len / cp positions, forward + backward, by sequences (a block of real_model_lines)."""
    from titan_exp.parallel.context import apply_cp

    out = {}
    for cp in [c for c in range(2, world + 1) if world % c == 0 and seq_len % (2 * c) == 0]:
        mesh = submesh(world, cp, "cp", device)
        out[cp] = real_model_lines(m, seq_len // cp, opts, device, lambda model: apply_cp(model, mesh, seq_len))[0]
    return out


def measure_fsdp_blocks(m: ModelConfig, seq_len: int, world: int, opts: Options,
                        device: torch.device) -> dict[int, Line]:
    """Per shard degree: one block of a real FSDP model (titan_exp.parallel.fsdp, fp32, resharded
    after forward), forward + backward with the gradients freed between steps as training does,
    by sequences (a block of real_model_lines). Every group of that size runs at once."""
    from titan_exp.parallel.fsdp import apply_fsdp

    out = {}
    for shard in [s for s in range(2, world + 1) if world % s == 0]:
        mesh = submesh(world, shard, "shard", device)
        out[shard] = real_model_lines(m, seq_len, opts, device, lambda model: apply_fsdp(
            model, mesh, param_dtype=None, reduce_dtype=torch.float32, reshard_mode="default", pp_enabled=False),
            free_grads=True)[0]
    return out


def concurrency(m: ModelConfig, seq_len: int, world: int, opts: Options, device: torch.device) -> float:
    """How many ranks compute at full speed at once: world x (time alone / time together)."""
    _, _, fwd_bwd = block_runs(m, 1, opts.sequences[-1], seq_len, device)
    ratios = []
    for _ in range(3):  # alternating, so a slow spell of a shared machine hits both
        both = together(fwd_bwd, opts.reps, device)
        alone = timed(fwd_bwd, opts.reps, device) if dist.get_rank() == 0 else 0.0
        dist.barrier()
        t = torch.tensor([alone], dtype=torch.float64, device=device)
        dist.broadcast(t, src=0)
        ratios.append(t.item() / both)
    return max(1.0, min(float(world), world * statistics.median(ratios)))


def gemm_shapes(m: ModelConfig, seq_len: int, opts: Options) -> list[tuple[int, int, int]]:
    hd = m.head_size
    out = []
    for seqs in opts.sequences:
        tokens = seqs * seq_len
        out += [(tokens, m.dim, m.n_heads * hd), (tokens, m.dim, m.kv_heads * hd), (tokens, m.dim, m.ffn_hidden_dim),
                (tokens, m.ffn_hidden_dim, m.dim), (tokens, m.dim, m.vocab_size)]
        if m.mla:  # its projections to and from the latents, and its narrower values' (perf.model.shapes)
            out += [(tokens, k, n) for k, n, _ in attention_linears(m).values()]
    return sorted(set(out))


def measure_gemms(m: ModelConfig, seq_len: int, opts: Options, device: torch.device) -> tuple[dict, dict]:
    fits, tables = {}, {}
    for dtype in matmul_dtypes(device):
        name = str(dtype).removeprefix("torch.").replace("float8_e4m3fn", "float8")
        rows = [[mm, k, n, together(matmul(mm, k, n, dtype, device), opts.reps, device)]
                for mm, k, n in gemm_shapes(m, seq_len, opts)]
        fits[name] = Line.fit([2 * r[0] * r[1] * r[2] for r in rows], [r[3] for r in rows])
        tables[name] = rows
    return fits, tables


# The most memory a full calibration's AdamW timing takes, all ranks together: parameters,
# gradients and two moments, 16 bytes a parameter.
OPTIMIZER_BYTES = 8 << 30


def measure_optimizer(m: ModelConfig, opts: Options, device: torch.device) -> float:
    """AdamW's step per parameter, every rank at once on as many parameters as the whole model
    (a data-parallel rank's), so that the step streams its state from memory as a real one does:
    16 matrices of dim x dim (1M parameters for the debug model) had it at 4.7 ns a parameter,
    where the 100M model's step takes 6.2 ns at world 2 (up to OPTIMIZER_BYTES over all ranks).
    On a GPU, the optimizer phase as a step runs it, on as many of the model's parameters as a
    quarter of the free memory holds at 16 bytes each (optimizer_phase)."""
    if device.type == "cuda":
        return optimizer_phase(m, opts, device, torch.cuda.mem_get_info(device)[0] // 4 // 16)
    world = dist.get_world_size() if dist.is_initialized() else 1
    count = 4 if opts.tiny else max(1, min(m.num_params, OPTIMIZER_BYTES // (16 * world)) // (m.dim * m.dim))
    return timed_adamw([torch.Size((m.dim, m.dim))] * count, opts, device, clip=False)


def optimizer_phase(m: ModelConfig, opts: Options, device: torch.device, room: int) -> float:
    """Seconds per parameter of a step's optimizer phase as training runs it: the gradient norm
    and clipping (train.optim.clip_grad_norm_), then AdamW's step with the device's kernels (fused
    on a GPU), over the model's own tensors in its order, at most `room` parameters (one at least).
    On an H200 this measured 9.4 ps a parameter over the 8-layer 8B's tensors, and a
    3B's traced step spent 10.5 in the phase (fused AdamW 9.2, the gradient norm 1.3: 34 ms);
    read with the previous step's optimizer kernels, which its trace's window also held, that
    step had seemed to spend twice as much (BENCHMARKS.md)."""
    from titan_exp.models.llama import Transformer

    with torch.device("meta"):
        shapes = [p.shape for p in Transformer(m).parameters()]
    taken, total = [], 0
    for shape in shapes:
        if taken and total + shape.numel() > room:
            break
        taken.append(shape)
        total += shape.numel()
    return timed_adamw(taken, opts, device, clip=True)


def timed_adamw(shapes: list[torch.Size], opts: Options, device: torch.device, *, clip: bool) -> float:
    """Seconds per parameter of AdamW's step (with the device's kernels) over parameters of these
    shapes with random gradients, every rank at once; with `clip`, after the gradient norm and
    clipping as training runs them (train.optim.clip_grad_norm_)."""
    from titan_exp.train.optim import clip_grad_norm_

    params = [nn.Parameter(torch.randn(shape, device=device)) for shape in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, **adamw(device))

    def phase() -> None:
        if clip:
            clip_grad_norm_(params, 1.0)
        opt.step()

    return together(phase, opts.reps, device) / sum(p.numel() for p in params)


def adamw(device: torch.device) -> dict[str, bool]:
    """The kernels training's AdamW runs with on this device (optimizer.implementation=auto)."""
    return kernels(OptimizerImpl.auto, on_gpu=device.type == "cuda")


def measure_fresh_memory(opts: Options, device: torch.device) -> float:
    """Seconds per byte of filling memory just mapped from the OS, beyond filling memory already
    mapped: the page faults (and the unmapping when it is freed) of a buffer glibc serves by mmap.
    Every rank at once, as in a step. 48 MiB is over glibc's largest mmap threshold (32 MiB), so
    each allocation is mapped afresh whatever cluster.cpu_malloc_mmap_threshold_mib says."""
    if device.type != "cpu":
        return 0.0  # the caching allocator keeps what it got
    n = 48 << 20
    reused = torch.empty(n, dtype=torch.uint8)
    times = in_rounds([lambda: reused.fill_(1), lambda: torch.empty(n, dtype=torch.uint8).fill_(1)], opts, device)
    return max(0.0, statistics.median(fresh - mapped for mapped, fresh in times)) / n


def measure_compile(m: ModelConfig, seq_len: int, opts: Options, device: torch.device) -> float:
    """Eager over compiled time of a block's forward + backward."""
    block, _, fwd_bwd = block_runs(m, 1, opts.sequences[-1], seq_len, device)
    eager = together(fwd_bwd, opts.reps, device)
    block.compile()
    fwd_bwd()  # compiles
    return eager / together(fwd_bwd, opts.reps, device)
