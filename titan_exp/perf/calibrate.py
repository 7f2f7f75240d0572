"""What every rank of a calibration job runs: `python -m titan_exp.perf.calibrate RUN_DIR`
(started by an executor, like training: `titan_exp.calibrate` is the command).

All ranks measure at the same time, as they would compute during training, so a machine with
fewer cores than ranks shows it in every number. What is compared (a line's sizes, two models'
difference) is timed side by side in rounds (in_rounds), so a slow spell of the machine spoils a
round, not the comparison. Rank 0 writes the profile (perf.profile) and the
run's summary.json. What is measured, each over a few sizes and fitted as a Line:

- matmuls of the model's own GEMM shapes (fp32, bf16; float8 on GPUs that have it);
- one block by itself at every TP degree the world allows (heads and the SwiGLU width divided by
  tp), forward and forward + backward: its compute, and the forward that AC redoes, scaled by how
  much more a block costs inside the real model (measured at tp 1);
- the real model, forward + backward with its loss, with 1 and 3 blocks, at every TP degree
  (tensor + sequence parallel when tp > 1): the rest of the model (the 1-block model minus its
  block), and what TP adds (a real TP block, half of 3 blocks minus 1, minus its compute), and
  under TP the optimizer phase (gradient norm, clipping, AdamW) of both models; the blocks by
  themselves and the real models of every TP degree are timed in the same rounds
  (measure_compute), since each of these is a comparison between them;
- a real context-parallel block at every CP degree: what CP adds to the block;
- a real FSDP block (fully_shard, resharded after forward) at every shard degree: what FSDP adds
  to the block: its two all-gathers and reduce-scatter with their copies, the buffers it maps
  afresh (under the job's cluster.cpu_malloc_mmap_threshold_mib) and the waits for other ranks;
- collectives over groups of every size dividing the world, all groups at once: all-gather,
  reduce-scatter, all-reduce, all-to-all; send/recv between rank pairs;
- how many ranks compute at full speed at once (a block alone on rank 0 vs on every rank);
- how much of an all-gather hides behind a concurrent matmul;
- AdamW's step per parameter, on as many parameters as the model has; on a CPU, what memory
  fresh from the OS costs to touch (page faults); optionally (`compile`) the compiled block's
  speed-up.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from titan_exp.config import JobConfig, ModelConfig, load_job_config
from titan_exp.perf.profile import (BlockCost, Line, MachineProfile, find, machine_key, shape_key)
from titan_exp.record import RunDir, RunSummary, Status

logger = logging.getLogger("titan_exp")


@dataclass
class Options:
    """calibrate.json in the run dir, written by `python -m titan_exp.calibrate`."""

    refresh: bool = False
    tiny: bool = False  # smallest sizes and fewest repeats: for tests
    compile: bool = False
    profile_dir: str | None = None  # default: <cache>/perf

    @property
    def reps(self) -> int:
        return 2 if self.tiny else 6

    @property
    def sequences(self) -> list[int]:
        return [1, 2] if self.tiny else [1, 2, 4]

    @property
    def comm_bytes(self) -> list[int]:
        return [16 << 10, 256 << 10] if self.tiny else [64 << 10, 1 << 20, 8 << 20]


def model_shape(job: JobConfig) -> str:
    """The block a calibration measures: for an MoE model, one of its MoE blocks."""
    m = job.model
    key = shape_key(m.dim, m.n_heads, m.kv_heads, m.ffn_hidden_dim, m.vocab_size, job.training.seq_len)
    if m.is_moe:
        key += f"-moe{m.n_experts}k{m.top_k}h{m.expert_hidden_dim}s{m.n_shared_experts}"
    return key


def tp_degrees(m: ModelConfig, world: int) -> list[int]:
    return [tp for tp in range(1, world + 1)
            if world % tp == 0 and m.n_heads % tp == 0 and m.kv_heads % tp == 0 and m.ffn_hidden_dim % tp == 0]


# -- timing --------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median seconds of `fn` after one warm-up call."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def slowest(seconds: float, device: torch.device) -> float:
    """The slowest rank's time: a collective step waits for it."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def together(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Every rank runs `fn` at the same time; the slowest rank's median."""
    dist.barrier()
    return slowest(timed(fn, reps, device), device)


# Rounds of a full calibration: the median of 5 rather than 3 (stop 13's 100M world-2 profiles
# priced TP at 0.6 s and at 2.0 s a step in two calibrations an hour apart).
ROUNDS = 5


def in_rounds(fns: list[Callable[[], object]], opts: Options, device: torch.device) -> list[list[float]]:
    """Each of `fns` timed in turn, every rank at once, round after round: [round][fn] seconds.
    Timings compared with each other (sizes fitted as a line, a difference of two models) are
    taken side by side in every round, so a slow spell of a shared machine spoils one round, not
    the comparison (issue 13's sittings saw a block's cost double from one calibration to the
    next, and a line fitted on sizes timed one after the other bends with the machine's speed).
    A full calibration's round times each fn as the median of a third of `opts.reps` calls (2); a
    tiny one (the tests) is one round of all of them."""
    rounds, reps = (1, opts.reps) if opts.tiny else (ROUNDS, max(1, opts.reps // 3))
    return [[together(fn, reps, device) for fn in fns] for _ in range(rounds)]


def medians(times: list[list[float]]) -> list[float]:
    """in_rounds' timings: each fn's median over the rounds."""
    return [statistics.median(column) for column in zip(*times)]


@dataclass
class Runs:
    """Callables to time in rounds, and how their timings ([round][fn]) become the measurement."""

    fns: list[Callable[[], object]]
    finish: Callable[[list[list[float]]], Any]


def side_by_side(runs: list[Runs], opts: Options, device: torch.device) -> list[list[list[float]]]:
    """Several Runs' fns timed in the same rounds (in_rounds): each one's timings, [round][fn]."""
    times = in_rounds([fn for r in runs for fn in r.fns], opts, device)
    out, start = [], 0
    for r in runs:
        out.append([row[start:start + len(r.fns)] for row in times])
        start += len(r.fns)
    return out


# -- compute -------------------------------------------------------------------------------
def sharded_block(m: ModelConfig, tp: int, device: torch.device) -> nn.Module:
    """The model's block as one TP rank holds it: n_heads / tp heads, ffn / tp SwiGLU width. For
    an MoE model an MoE block, whose router and routed experts TP leaves whole (all experts
    local: under EP a rank computes as many routed tokens on average, sent by all-to-all, which
    is costed apart)."""
    from titan_exp.models.llama import FeedForward, TransformerBlock

    block = TransformerBlock(m, layer=m.n_dense_layers)
    a, hd = block.attention, m.head_dim
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
    cos, sin = (t.to(device) for t in rope_tables(m.head_dim, seq_len, m.rope_theta))
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
    (train.trainer.clip_grad_norm_) and AdamW's step, on each model's own gradients: a Line whose
    latency is the model's rest and whose per-unit cost is a block's. On DTensor parameters (TP)
    that phase is DTensor's dispatch per parameter and an all-reduce per gradient norm, not
    AdamW's arithmetic: a debug-model tp8 step at world 8 spent 1.2 of its 3.2 s there."""
    from titan_exp.models.llama import Transformer
    from titan_exp.train.trainer import clip_grad_norm_

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
            steps.append(functools.partial(optimizer_phase, params, torch.optim.AdamW(params, lr=1e-4, foreach=True)))

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
    fell below `tp2` (BENCHMARKS.md, stop 16). The factor is the median over rounds of each
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


def measure_fsdp_blocks(m: ModelConfig, seq_len: int, world: int, opts: Options, device: torch.device) -> dict[int, Line]:
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
    hd = m.head_dim
    out = []
    for seqs in opts.sequences:
        tokens = seqs * seq_len
        out += [(tokens, m.dim, m.n_heads * hd), (tokens, m.dim, m.kv_heads * hd), (tokens, m.dim, m.ffn_hidden_dim),
                (tokens, m.ffn_hidden_dim, m.dim), (tokens, m.dim, m.vocab_size)]
    return sorted(set(out))


def gemm_dtypes(device: torch.device) -> list[torch.dtype]:
    dtypes = [torch.float32, torch.bfloat16]
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        dtypes.append(torch.float8_e4m3fn)
    return dtypes


def measure_gemms(m: ModelConfig, seq_len: int, opts: Options, device: torch.device) -> tuple[dict, dict]:
    fits, tables = {}, {}
    for dtype in gemm_dtypes(device):
        name = str(dtype).removeprefix("torch.").replace("float8_e4m3fn", "float8")
        rows = []
        for mm, k, n in gemm_shapes(m, seq_len, opts):
            if dtype == torch.float8_e4m3fn:
                a = torch.randn(mm, k, device=device).to(dtype)
                b = torch.randn(n, k, device=device).to(dtype).t()
                one = torch.ones((), device=device)
                fn = lambda a=a, b=b, one=one: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
            else:
                a, b = torch.randn(mm, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
                fn = lambda a=a, b=b: a @ b  # noqa: E731
            rows.append([mm, k, n, together(fn, opts.reps, device)])
        fits[name] = Line.fit([2 * r[0] * r[1] * r[2] for r in rows], [r[3] for r in rows])
        tables[name] = rows
    return fits, tables


# -- communication ------------------------------------------------------------------------
def group_sizes(world: int) -> list[int]:
    return [g for g in range(2, world + 1) if world % g == 0]


def _collective_lines(groups: list[list[int]], opts: Options, device: torch.device) -> dict[str, Line]:
    """Each collective over `groups` (disjoint, equal sizes, all running at once), by bytes.
    Every rank creates every group, in the same order, as new_group requires."""
    rank, g = dist.get_rank(), len(groups[0])
    mine = None
    for members in groups:
        group = dist.new_group(members)
        if rank in members:
            mine = group
    out = {}
    for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        seconds = []
        for size in opts.comm_bytes:
            n = size // 4 // g * g
            full, part = torch.randn(n, device=device), torch.randn(n // g, device=device)
            fn = {
                "all_gather": lambda: dist.all_gather_single(full, part, group=mine),
                "reduce_scatter": lambda: dist.reduce_scatter_single(part, full, group=mine),
                "all_reduce": lambda: dist.all_reduce(full, group=mine),
                "all_to_all": lambda: dist.all_to_all_single(full, full.clone(), group=mine),
            }[op]
            seconds.append(together(fn, opts.reps, device))
        out[op] = Line.fit(opts.comm_bytes, seconds)
    return out


def _send_recv_line(peer: int, opts: Options, device: torch.device) -> Line:
    """One message to `peer` and back, halved; every pair at once (pipeline stages' P2P)."""
    rank, seconds = dist.get_rank(), []
    for size in opts.comm_bytes:
        t = torch.randn(size // 4, device=device)

        def ping_pong():
            first, second = (dist.send, dist.recv) if rank < peer else (dist.recv, dist.send)
            first(t, peer)
            second(t, peer)

        seconds.append(together(ping_pong, opts.reps, device) / 2)
    return Line.fit(opts.comm_bytes, seconds)


def measure_collectives(world: int, opts: Options, device: torch.device,
                        nodes: int = 1) -> tuple[dict[str, dict[int, Line]], dict[str, dict[int, Line]]]:
    """(over groups of consecutive ranks, over groups of one rank per node). Ranks are numbered
    node by node, so a group of consecutive ranks stays inside a node while it fits there; with
    more than one node, the same collectives also run over groups that take one rank from each
    of g nodes, and send/recv between ranks on different nodes: what a mesh dim that spans
    nodes pays, which the model uses for those dims (perf.step.across_nodes)."""
    out: dict[str, dict[int, Line]] = {}
    for g in group_sizes(world):
        for op, line in _collective_lines([list(range(s, s + g)) for s in range(0, world, g)], opts, device).items():
            out.setdefault(op, {})[g] = line
    rank = dist.get_rank()
    if world >= 2 and world % 2 == 0:  # neighbours: rank 2i <-> 2i+1
        out["send_recv"] = {2: _send_recv_line(rank ^ 1, opts, device)}
    inter: dict[str, dict[int, Line]] = {}
    per_node = world // nodes
    if nodes > 1 and world % nodes == 0:
        for g in group_sizes(nodes):  # g consecutive nodes, one rank of each: per_node x nodes/g groups
            groups = [[start + i * per_node for i in range(g)]
                      for base in range(0, world, g * per_node) for start in range(base, base + per_node)]
            for op, line in _collective_lines(groups, opts, device).items():
                inter.setdefault(op, {})[g] = line
        if nodes % 2 == 0:  # the same local rank on nodes 2j and 2j+1
            node = rank // per_node
            inter["send_recv"] = {2: _send_recv_line(rank + per_node if node % 2 == 0 else rank - per_node, opts, device)}
    return out, inter


def measure_overlap(world: int, opts: Options, device: torch.device) -> float:
    """Share of an all-gather that hides behind a matmul running at the same time (0: none)."""
    n = opts.comm_bytes[-1] // 4 // world * world
    full, part = torch.randn(n, device=device), torch.randn(n // world, device=device)
    comm = together(lambda: dist.all_gather_single(full, part), opts.reps, device)
    side = 256
    a = torch.randn(side, side, device=device)
    one_mm = timed(lambda: a @ a, opts.reps, device)
    count = max(1, round(comm / max(one_mm, 1e-9)))
    compute = together(lambda: [a @ a for _ in range(count)], opts.reps, device)

    def both():
        work = dist.all_gather_single(full, part, async_op=True)
        for _ in range(count):
            a @ a
        work.wait()

    both_s = together(both, opts.reps, device)
    return max(0.0, min(1.0, (comm + compute - both_s) / max(min(comm, compute), 1e-9)))


# The most memory a full calibration's AdamW timing takes, all ranks together: parameters,
# gradients and two moments, 16 bytes a parameter.
OPTIMIZER_BYTES = 8 << 30


def measure_optimizer(m: ModelConfig, opts: Options, device: torch.device) -> float:
    """AdamW's step per parameter, every rank at once on as many parameters as the whole model
    (a data-parallel rank's), so that the step streams its state from memory as a real one does:
    16 matrices of dim x dim (1M parameters for the debug model) had it at 4.7 ns a parameter,
    where the 100M model's step takes 6.2 ns at world 2 (up to OPTIMIZER_BYTES over all ranks)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    count = 4 if opts.tiny else max(1, min(m.num_params, OPTIMIZER_BYTES // (16 * world)) // (m.dim * m.dim))
    params = [nn.Parameter(torch.randn(m.dim, m.dim, device=device)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    return together(opt.step, opts.reps, device) / sum(p.numel() for p in params)


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


# -- the job -------------------------------------------------------------------------------
def calibrate(job: JobConfig, opts: Options, device: torch.device, folder: Path | None) -> tuple[MachineProfile, bool]:
    """(profile, whether anything was measured)."""
    world = dist.get_world_size()
    threads = torch.get_num_threads()
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    backend = dist.get_backend()
    shape = model_shape(job)
    m, seq_len = job.model, job.training.seq_len
    nodes = job.cluster.nodes_for(world)
    known = find(dev_name, backend, world, threads, folder, nodes)
    if known is not None and known.source != "calibrated":
        known = None  # the defaults, refit by an autotune sweep: nothing measured to keep
    if known is not None and not opts.refresh and shape in known.blocks and (not opts.compile or known.compile_speedup):
        return known, False
    start = time.perf_counter()
    keep_machine = known is not None and not opts.refresh  # a new model on a known machine: its blocks only
    if keep_machine:
        profile = dataclasses.replace(known, blocks=dict(known.blocks))
    else:
        profile = MachineProfile(key=machine_key(dev_name, backend, world, threads, nodes))
        profile.blocks = {k: v for k, v in (known.blocks if known else {}).items() if k != shape}  # other models'
        profile.concurrency = concurrency(m, seq_len, world, opts, device)
    # Compute is measured with every rank computing at once, as in a data-parallel step; the
    # model scales it for layouts where fewer ranks compute at a time (pipeline bubbles), by
    # `concurrency`, so a noisy concurrency only touches those.
    # A block inside the real model costs more than by itself (memory traffic, autograd across
    # blocks): one factor, from tp = 1 (measure_compute), scales every block's compute.
    plain, real, ratio = measure_compute(m, seq_len, world, opts, device)
    in_situ = min(3.0, max(1.0, ratio))  # below 1 taken as noise (0.78 for the debug model at world 8)
    cp_blocks = measure_cp_blocks(m, seq_len, world, opts, device)
    fsdp_blocks = measure_fsdp_blocks(m, seq_len, world, opts, device)
    profile.blocks[shape] = {}
    for tp, (fwd, fwd_bwd) in plain.items():
        in_situ_block, one, updates = real[tp]
        fwd, fwd_bwd = (Line(x.latency_s * in_situ, x.per_unit_s * in_situ) for x in (fwd, fwd_bwd))
        # The rest of the model: the 1-block model minus its block. What TP adds: the real TP
        # block (real_model_lines) minus its compute. Both floored at 0 (noise).
        rest = Line(max(0.0, one.latency_s - fwd_bwd.latency_s), max(0.0, one.per_unit_s - fwd_bwd.per_unit_s))
        tp_comm = Line(max(0.0, in_situ_block.latency_s - fwd_bwd.latency_s),
                       max(0.0, in_situ_block.per_unit_s - fwd_bwd.per_unit_s)) if tp > 1 else None
        # What CP adds: the real CP block on seq/cp positions minus the block on as many tokens.
        cp_extra = {cp: Line(max(0.0, line.latency_s - fwd_bwd.latency_s),
                             max(0.0, line.per_unit_s - fwd_bwd.per_unit_s / cp))
                    for cp, line in cp_blocks.items()} if tp == 1 else {}
        # What FSDP adds: the real FSDP block minus the block.
        fsdp_extra = {shard: Line(max(0.0, line.latency_s - fwd_bwd.latency_s), max(0.0, line.per_unit_s - fwd_bwd.per_unit_s))
                      for shard, line in fsdp_blocks.items()} if tp == 1 else {}
        profile.blocks[shape][tp] = BlockCost(fwd, fwd_bwd, rest, tp_comm=tp_comm, cp_extra=cp_extra,
                                              fsdp_extra=fsdp_extra, update=updates)
    profile.notes = [f"a block in the model costs {ratio:.2f}x the block by itself (tp 1): {in_situ:.2f}x used"]
    gemm, tables = measure_gemms(m, seq_len, opts, device)
    profile.gemm.update(gemm)
    profile.gemm_shapes.update(tables)
    if not keep_machine:
        profile.collectives, profile.inter_node = measure_collectives(world, opts, device, nodes) if world > 1 else ({}, {})
        profile.overlap = measure_overlap(world, opts, device) if world > 1 else 0.0
        profile.optimizer_s_per_param = measure_optimizer(m, opts, device)
        profile.fresh_memory_s_per_byte = measure_fresh_memory(opts, device)
        profile.step_overhead_s = 1e-3 if device.type == "cuda" else 5e-3  # refit from real runs
    if opts.compile:
        profile.compile_speedup = measure_compile(m, seq_len, opts, device)
    profile.created = time.strftime("%Y-%m-%dT%H:%M:%S")
    profile.calibration_s += time.perf_counter() - start
    return profile, True


def main(path: str) -> int:
    from titan_exp.train.rank import init_distributed, setup_logging, slurm_job_id

    run_dir = RunDir(path)
    rank = int(os.environ.get("RANK", 0))
    setup_logging(run_dir, rank)
    job = load_job_config(run_dir.config)
    opts = Options(**json.loads((run_dir.path / "calibrate.json").read_text()))
    summary = RunSummary.of(job, Status.running, run_dir.path, slurm_job_id=slurm_job_id())
    start = time.time()
    try:
        device = init_distributed(job.comm.init_timeout_seconds)
        torch.manual_seed(0)
        folder = Path(opts.profile_dir) if opts.profile_dir else None
        profile, measured = calibrate(job, opts, device, folder)
        if rank == 0:
            out = profile.save(folder) if measured else profile.path(folder)
            logger.info("%s machine profile %s", "wrote" if measured else "reusing (--refresh remeasures)", out)
            summary = summary.replace(status=Status.ok, machine_profile=str(out))
        dist.barrier()
        return 0
    except BaseException as exc:  # noqa: BLE001 - the summary says why
        summary = summary.replace(status=Status.failed, error=f"{type(exc).__name__}: {exc}")
        logger.exception("calibration failed on rank %d", rank)
        raise
    finally:
        if rank == 0:
            run_dir.write_summary(summary.replace(wall_time_s=time.time() - start))
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
