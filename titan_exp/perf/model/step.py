"""The performance model: seconds per step and tokens/s per device of one layout, from a machine
profile (perf.rates.profile), by part, so a report can say where the time goes.

Compute. A rank's work per microbatch is its blocks' measured forward + backward (at its TP
degree, on sequences of seq_len / cp) plus the head on the last stage, scaled for the precision
(the GEMM share of the block at the dtype's measured matmul rate), for compile (when its
speed-up was calibrated) and by the profile's fitted correction. Activation checkpointing adds a
forward per block (full), the non-matmul part of a forward (selective per op), or a forward every
Nth block.

A GPU whose profile has no measured block of the model but its kernels' rates (`kernels`: from
its spec sheet, perf.rates.devices, or measured by calibrate, perf.calibration.kernels) has its block, head
and the non-matmul part selective AC recomputes priced from their parts by perf.model.block (precision
and compile inside them), and what FSDP, DDP and async TP hide follows the schedule there
(overlap.fsdp_exposed, overlap.async_tp_exposed) rather than a measured overlap.

Ranks share the machine. Costs were measured with every rank computing at once, and the profile
says how many ranks compute at full speed at once (S). If on average `active` ranks compute, each
runs max(1, active / S) / max(1, world / S) times the measured time: every rank of a
data/tensor-parallel layout is busy all step (1x), while pipeline ranks idle in the bubble and
leave the cores to the others, which is why pp4 does well on a 2-core CPU and not on 4 GPUs.

Pipeline. The critical path of a schedule is the microbatches at the slowest rank's time per
microbatch, plus the fill and drain through the other ranks at their own times, x b / v (v stages
per rank, b = 1, or 1/2 for the zero-bubble schedules: backward split into input and weight
gradients fills part of the bubble); equal stages give (microbatches + b x (pp - 1) / v) x the
time. On a GPU priced from its parts that time holds the TP, CP and EP collectives inside the
rank's blocks. The rank holding the last stage also runs the head (output projection and loss: at
a 128k vocabulary the FLOPs of 2.4 blocks of Llama 3 8B); the first stage's embedding lookup and
its gradient: on a GPU memory-bound and priced as nothing, on a CPU (whose measured head, a
one-block model less its block, holds it) the dense fp32 gradient's passes (embedding_s).
stage_split_steps prices other splits of the blocks over the stages (perf.search.stages).
Every rank waits the path out and adds the rest of its own communication and its optimizer: the
step is the rank that ends last.

Communication, by part (FSDP, HSDP, DDP, TP, CP, PP's sends, EP): perf.model.comm, from the
profile's measured latency + bytes / bandwidth of each collective at its group size.

Then the optimizer phase and a fixed per-step overhead. The optimizer phase is AdamW on the local
shard, per parameter; under TP, what a real TP model's gradient norm, clipping and AdamW step took
by blocks (calibrated), since there DTensor's dispatch per parameter and the norm's all-reduces
outweigh the arithmetic (a debug-model tp8 step on a 2-core CPU: 1.2 s of 3.2).

Fresh memory (CPU). glibc serves each allocation at or over its mmap threshold
(cluster.cpu_malloc_mmap_threshold_mib) with pages fresh from the OS, and a rank pays their page
faults every step (fresh_bytes): on the 100M model's FSDP at the default 16 MiB, 0.44 s of a 6.6 s
step; at 1 MiB every layout pays for its gradients too. Activations are in the calibrated block
costs, which were measured under the calibration job's threshold.

MoE models: a block's FLOPs are those of its active parameters (the experts a token goes to);
under TP the router runs whole on every TP rank and the rest is divided by tp, the routed experts
too: expert parallel spreads over TP's ranks (each dispatches 1/tp of the tokens), or without it
each TP rank runs 1/tp of every expert's width (a calibrated block, measured with them whole, is
taken at the share of its FLOPs left). A calibrated MoE block (calibrate model=<an MoE model>)
measures dispatch as well; a GPU block from its parts prices the router, the grouped GEMM over the local experts and the
dispatch's copies (gpu.routed_experts).

Optimizer. AdamW (and Muon's elementwise part) per local parameter, as calibrated. optimizer=muon
adds Newton-Schulz on every matrix of a rank's blocks, whole on every rank (train.muon gathers them:
a stack split by experts, its own experts only), at the rate the blocks' matmuls are priced at
(newton_schulz_s), and its all-gathers of the updates to FSDP's and TP's parts (comm.muon_gathers).

In code, predict_step reads: the layout's shape (comm.StepShape), a block's compute
(block_work), the collectives inside the blocks (comm.inline_comm), the schedule's critical
path (pipeline_schedule), and each distinct pipeline rank's step (rank_step), of which the
slowest is the step (slowest_rank).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from titan_exp.config import ACMode, ActivationCheckpointConfig, JobConfig
from titan_exp.parallel.pipeline import RankLoad
from titan_exp.perf.model.block import block_times, gemm_s
from titan_exp.perf.model.comm import (
    COMM_PARTS,
    BlockWork,
    InlineComm,
    StepShape,
    communication,
    inline_comm,
    measured_fsdp,
    muon_experts,
    muon_gathers,
)
from titan_exp.perf.model.engine import TITAN_EXP, Engine
from titan_exp.perf.model.shapes import muon_matrices
from titan_exp.perf.rates.profile import BlockCost, Line, MachineProfile, model_shape
from titan_exp.train import muon
from titan_exp.validation import resolved

# Extra bubble a schedule leaves, as a share of 1F1B's.
BUBBLE = {"GPipe": 1.0, "1F1B": 1.0, "Interleaved1F1B": 1.0, "LoopedBFS": 1.0,
          "InterleavedZeroBubble": 0.5, "ZBVZeroBubble": 0.5, "DualPipeV": 0.5}
NONMATMUL = 1.3  # a block's time over its matmuls' when no block was measured (estimate)
UNMEASURED_GEMM = Line(20e-6, 1 / 80e9)  # a matmul line where the profile measured none (80 GFLOP/s, an estimate)

# How the parts add up into the report's breakdown.
BREAKDOWN = {"compute": ("compute", "optimizer", "fresh_memory", "overhead"), "exposed_comm": COMM_PARTS,
             "bubble": ("bubble",), "recompute": ("recompute",)}


@dataclass
class StepPrediction:
    step_s: float
    tokens_per_s_per_device: float
    parts: dict[str, float]  # seconds per step by part (COMM_PARTS are exposed seconds)
    notes: list[str] = field(default_factory=list)

    def breakdown(self) -> dict[str, float]:
        """compute / exposed_comm / bubble / recompute, seconds per step."""
        return {k: sum(self.parts.get(p, 0.0) for p in parts) for k, parts in BREAKDOWN.items()}


def estimated_block(job: JobConfig, tp: int, profile: MachineProfile) -> BlockCost:
    """A block not calibrated: its FLOPs at the fp32 matmul rate, times NONMATMUL."""
    m, seq = job.model, job.training.seq_len
    gemm = profile.gemm.get("float32") or UNMEASURED_GEMM
    fwd_flops = 2 * m.block_matmul_params(tp) * seq + 4 * m.dim / tp * seq * seq
    fwd = Line(4 * gemm.latency_s, gemm.per_unit_s * fwd_flops * NONMATMUL)
    fwd_bwd = Line(3 * fwd.latency_s, 3 * fwd.per_unit_s)
    head = Line(3 * gemm.latency_s, gemm.per_unit_s * 6 * m.dim * m.vocab_size / tp * seq * NONMATMUL)
    return BlockCost(fwd, fwd_bwd, head)


def dtype_factor(job: JobConfig, profile: MachineProfile, flops: float, block_s: float, notes: list[str]) -> float:
    """Block time at the job's matmul dtype over its fp32 time: only the GEMM share changes."""
    pr = job.precision
    dtype = "float8" if pr.converter != "none" else ("bfloat16" if pr.param_dtype == "bfloat16" else "float32")
    if dtype == "float32":
        return 1.0
    fp32 = profile.gemm.get("float32")
    if dtype not in profile.gemm and dtype == "float8":
        notes.append("float8 matmuls not measured on this device (emulated on CPU): modelled as bf16")
        dtype = "bfloat16"
    if fp32 is None or dtype not in profile.gemm:
        return 1.0
    share = min(1.0, fp32(flops) / max(block_s, 1e-12))
    return (1 - share) + share * profile.gemm[dtype](flops) / fp32(flops)


def recomputed(ac: ActivationCheckpointConfig, fwd: float, per_op: float) -> float:
    """What activation checkpointing recomputes of a block whose forward takes `fwd`: all of it
    (full), `per_op` (per-op selective: what its policy does not save), or every n-th block's
    forward (selective_ac_option n), spread over the blocks; in `fwd`'s units."""
    if ac.mode == ACMode.full:
        return fwd
    if ac.mode == ACMode.selective:
        return per_op if ac.selective_ac_option == "op" else fwd / int(ac.selective_ac_option)
    return 0.0


def block_work(s: StepShape, engine: Engine, notes: list[str]) -> BlockWork:
    """A block's compute per microbatch on one rank, and its head's: on a GPU whose profile has its
    kernels' rates (measured, or the spec sheet's), from its parts (perf.model.block); else the profile's
    measured block (or one estimated from FLOPs), scaled for precision, compile and the block's
    share of what was measured."""
    job, profile, m, t = s.job, s.profile, s.job.model, s.job.training
    gpu_kernels = profile.kernels if profile.kernels and profile.kernels.architecture != "cpu" else None
    # A GPU profile may also hold blocks timed in fp32 without autocast (older calibrations), which say
    # nothing of bf16 or float8 kernels (8x a bf16 block's share of an H200 step): unread.
    if gpu_kernels and s.cuda:
        gpu = block_times(job, s.tp, gpu_kernels, engine)
        notes += gpu.notes
        cost = BlockCost(Line(0.0, 0.0), Line(0.0, 0.0), Line(0.0, 0.0))  # nothing measured
        c = profile.corrections.compute
        fwd, block, head = gpu.fwd * c, (gpu.fwd + gpu.bwd) * c, gpu.head * c
        kept = fwd - gpu.selective_s * c  # what per-op selective AC saves rather than recomputes
        embedding = 0.0  # a GPU's head is the output and the loss alone (perf.model.block)
    else:
        gpu = None
        cost = profile.block(model_shape(job), s.tp)
        if cost is None:
            notes.append(f"block {model_shape(job)} at tp={s.tp} not calibrated: estimated from FLOPs "
                         f"(python -m titan_exp.perf.calibrate model={m.flavor} training.seq_len={t.seq_len})")
            cost = estimated_block(job, s.tp, profile)
        gemm32 = profile.gemm.get("float32")
        block_fwd_flops = 2 * m.block_matmul_params(s.tp, experts_whole=True) * s.mb * t.seq_len / s.cp  # as measured
        scale = (dtype_factor(job, profile, 3 * block_fwd_flops, cost.fwd_bwd(s.seqs), notes)
                 * profile.corrections.compute)
        if job.compile.enable:
            if profile.compile_speedup:
                scale /= profile.compile_speedup
            else:
                notes.append("compile speed-up not calibrated (calibrate --compile): modelled as eager")
        scale *= m.measured_block_share(s.tp)  # measured with the routed experts whole on every TP rank
        block = cost.fwd_bwd(s.seqs) * scale
        fwd = cost.fwd(s.seqs) * scale
        head = cost.head(s.seqs) * scale
        kept = gemm32(block_fwd_flops) * scale if gemm32 else 0.6 * fwd  # the matmuls
        embedding = min(head, embedding_s(s))
    ac = job.activation_checkpoint
    if ac.mode == ACMode.selective and ac.selective_ac_option == "op" and gpu is not None and not job.compile.enable:
        notes.append("selective AC without compile runs its per-op policy in Python, which is not priced (the 1B on "
                     "one H200 ran 26-38 % slower than predicted): take it as optimistic, or compile")
    return BlockWork(fwd, block, head, recomputed(ac, fwd, max(0.0, fwd - kept)), cost, gpu, embedding)


def embedding_s(s: StepShape) -> float:
    """The embedding's share of a calibrated CPU head per microbatch (the head is measured on a model
    whose blocks are removed: embedding, norm, output and loss together): its backward fills a dense
    fp32 gradient of the whole table with zeros, writes it, and adds it to the accumulated one (two
    reads and a write): 4 passes over vocab x dim / tp x 4 bytes, at the profile's memory-bound rate
    (nothing without its kernels)."""
    kern, m = s.profile.kernels, s.job.model
    if kern is None or not kern.memory_tb_s:
        return 0.0
    return 4 * m.vocab_size * m.dim / s.tp * 4 / (kern.memory_tb_s * 1e12) * s.profile.corrections.compute


@dataclass(frozen=True)
class Schedule:
    """The pipeline schedule's timing: each pipeline rank's compute per microbatch (`per_mb`), the
    collectives inside its blocks (`comm_mb`: a microbatch's seconds by part) and its period with
    them (`period`), the critical path every rank waits out, and how much slower each rank
    computes for sharing the machine's cores."""

    per_mb: list[float]
    comm_mb: list[dict[str, float]]
    period: list[float]
    critical: float
    slowdown: float


def pipeline_schedule(s: StepShape, work: BlockWork, inline: InlineComm, output_heads: int) -> Schedule:
    """The critical path of the schedule: the microbatches at the slowest rank's period, and the
    fill and drain through the other ranks once, at their own periods, b / v of it (b the schedule's
    bubble share, v the stages a rank holds): microbatches x the slowest period + b x (the sum of the
    periods less the slowest) / v. Equal periods give (microbatches + b x (pp - 1) / v) x the period;
    a light rank adds its own period, not the heavy one's (a flow shop of equal jobs). On a GPU
    priced from its parts the collectives inside the blocks lengthen each microbatch of a stage, so
    the fill and drain of the pipeline too."""
    profile = s.profile
    per_mb, comm_mb, period = rank_periods(s, work, inline, output_heads)
    critical = critical_path(s, period)
    # Costs were measured with all `world` ranks computing; fewer at a time run faster.
    active = s.world / s.pp * sum(s.n_mb * c for c in per_mb) / critical
    slowdown = max(1.0, active / profile.concurrency) / max(1.0, s.world / profile.concurrency)
    return Schedule(per_mb, comm_mb, period, critical, slowdown)


def rank_periods(s: StepShape, work: BlockWork, inline: InlineComm,
                 output_heads: int) -> tuple[list[float], list[dict[str, float]], list[float]]:
    """Per load of `s.loads`: its compute per microbatch (its blocks, the embedding's share on the
    first stage, the rest of the head on the last), the collectives inside its blocks per
    microbatch, and its period (on a GPU priced from its parts, compute and those collectives)."""
    head_rest = work.head - work.embedding
    per_mb = [r.blocks * (work.block + work.recompute) + r.first * work.embedding + r.last * output_heads * head_rest
              for r in s.loads]
    comm_mb = [inline.of(s, r) for r in s.loads]
    period = [compute + (sum(comm.values()) * s.profile.corrections.communication if work.gpu is not None else 0.0)
              for compute, comm in zip(per_mb, comm_mb)]
    return per_mb, comm_mb, period


def critical_path(s: StepShape, periods: list[float]) -> float:
    """pipeline_schedule's critical path for the pipeline ranks' periods (one per rank, in order)."""
    v, slowest = s.loads[0].stages, max(periods)
    others = sum(periods) - slowest if s.pp > 1 else 0.0
    return s.n_mb * slowest + BUBBLE[s.job.parallelism.pipeline_parallel_schedule] * others / v


def newton_schulz_s(s: StepShape, load: RankLoad) -> float:
    """optimizer=muon's Newton-Schulz on a rank holding `load`: every matrix of its blocks whole (each
    rank orthogonalises every matrix it gathers, train.muon), of the routed experts' stacks its own
    experts (comm.muon_experts); each matmul (train.muon.newton_schulz_matmuls) at the rate the
    blocks' are priced at: a GPU's kernels (perf.model.block.gemm_s), else the profile's measured
    matmul line in the iterations' dtype (optimizer.muon.ns_dtype: bf16 on a GPU, fp32 on a CPU)."""
    o, m, profile = s.job.optimizer, s.job.model, s.profile
    if not load.blocks or not muon.routes(o._target_):
        return 0.0
    dtype = o.muon.ns_dtype.value if o.muon.ns_dtype is not None else ("bfloat16" if s.cuda else "float32")
    kern = profile.kernels if profile.kernels and profile.kernels.architecture != "cpu" and s.cuda else None
    line = profile.gemm.get(dtype) or profile.gemm.get("float32") or UNMEASURED_GEMM

    def matrix(rows: int, cols: int) -> float:
        matmuls = muon.newton_schulz_matmuls(rows, cols, o.muon.ns_steps)
        if kern is not None:
            return sum(gemm_s(kern, a, b, k, dtype if dtype in kern.matmul_tflops else "bfloat16")
                       for a, b, k in matmuls)
        return sum(line(2 * a * b * k) for a, b, k in matmuls)

    whole, routed = muon_matrices(m)
    experts = m.n_experts / muon_experts(s)[0]
    return load.blocks * (sum(c * matrix(k, n) for k, n, c in whole)
                          + experts * sum(c * matrix(k, n) for k, n, c in routed))


def optimizer_s(s: StepShape, work: BlockWork, load: RankLoad) -> float:
    """A rank's optimizer phase: AdamW's (or Muon's elementwise) on its local shard, per parameter;
    under TP, a real TP model's gradient norm, clipping and AdamW step as calibrated, by its blocks
    and its rest; and under optimizer=muon its Newton-Schulz (newton_schulz_s)."""
    profile = s.profile
    local_params = sum(s.units(load)) / s.shard + (load.blocks * s.routed / (s.shard * s.tp) if s.ep > 1 else 0.0)
    if s.tp > 1 and work.cost.update is not None:  # a real TP model's, measured: its blocks and its rest
        rest = (load.first + load.last) / 2  # the embedding's and the output's halves of it
        seconds = work.cost.update.latency_s * rest + work.cost.update.per_unit_s * load.blocks
    else:
        seconds = local_params * profile.optimizer_s_per_param
    return (seconds + newton_schulz_s(s, load)) * profile.corrections.compute


def rank_step(s: StepShape, work: BlockWork, schedule: Schedule, rank: int) -> dict[str, float]:
    """Pipeline rank `rank`'s step by part: the schedule's critical path, of which its own blocks'
    compute and (GPU) the collectives inside them, the rest idle (bubble); then the rest of its
    communication (perf.model.comm), its optimizer and the step's fixed overhead."""
    load, profile = s.loads[rank], s.profile
    busy = s.n_mb * schedule.per_mb[rank]
    share_recompute = load.blocks * work.recompute / schedule.per_mb[rank] if schedule.per_mb[rank] else 0.0
    parts = {
        "compute": s.accumulation * busy * (1 - share_recompute) * schedule.slowdown,
        "recompute": s.accumulation * busy * share_recompute * schedule.slowdown,
        "bubble": s.accumulation * (schedule.critical - s.n_mb * schedule.period[rank]) * schedule.slowdown,
    }
    parts.update(communication(s, work, schedule.comm_mb[rank], load, parts["compute"] + parts["recompute"]))
    for part, seconds in muon_gathers(s, load).items():  # optimizer=muon's, after backward
        parts[part] = parts.get(part, 0.0) + seconds
    parts["optimizer"] = optimizer_s(s, work, load)
    if not s.cuda and profile.fresh_memory_s_per_byte:
        blocks = 0 if measured_fsdp(s, work, load) is not None else load.blocks  # measured FSDP blocks: in their cost
        from titan_exp.perf.model.memory_cpu import fresh_bytes  # only a CPU's terms read it

        parts["fresh_memory"] = (fresh_bytes(s.job, blocks, load.first, load.last, s.accumulation)
                                 * profile.fresh_memory_s_per_byte * profile.corrections.compute)
    parts["overhead"] = profile.step_overhead_s + profile.corrections.overhead_s
    return parts


def slowest_rank(s: StepShape, work: BlockWork, inline: InlineComm, engine: Engine) -> dict[str, float]:
    """The step by part of the rank that ends last: the critical path is every rank's, the rest of
    its communication and its optimizer its own (fewer blocks but more of those can end last)."""
    schedule = pipeline_schedule(s, work, inline, engine.output_heads)
    ranks = {load: i for i, load in enumerate(s.loads)}.values()  # one of each load
    return max((rank_step(s, work, schedule, i) for i in ranks), key=lambda d: sum(d.values()))


def stage_split_steps(job: JobConfig, profile: MachineProfile, splits: list[list[RankLoad]], *, cuda: bool,
                      engine: Engine = TITAN_EXP, keep: int = 8) -> list[float]:
    """Seconds per step of `job` with its pipeline ranks loaded as each of `splits` says
    (pipeline.rank_loads of another split of its blocks), as predict_step prices one: the block's
    work and the collectives inside it are priced once, each distinct rank's period once, and the
    schedule and each rank's step only for the `keep` splits with the shortest critical paths
    (critical_path of their periods; the rest of a step, a rank's communication and optimizer,
    moves little between splits): the others are infinite."""
    s = StepShape.of(resolved(job), profile, cuda)
    work = block_work(s, engine, [])
    inline = inline_comm(s, work, engine.tp_overlap, engine.ep_overlap)
    distinct = list({load for loads in splits for load in loads})
    period = dict(zip(distinct, rank_periods(dataclasses.replace(s, loads=distinct), work, inline,
                                             engine.output_heads)[2]))
    critical = [critical_path(s, [period[load] for load in loads]) for loads in splits]
    shortest = set(sorted(range(len(splits)), key=critical.__getitem__)[:keep])
    return [sum(slowest_rank(dataclasses.replace(s, loads=loads), work, inline, engine).values())
            if i in shortest else float("inf") for i, loads in enumerate(splits)]


def predict_step(job: JobConfig, profile: MachineProfile, *, cuda: bool | None = None,
                 engine: Engine = TITAN_EXP) -> StepPrediction:
    """One training step of `job` on `profile`'s machine, as `engine` runs it (model.engine: this
    toolkit's by default; another's to predict a published run of it)."""
    job = resolved(job)
    cuda = profile.key.get("device", "cpu") != "cpu" if cuda is None else cuda
    s = StepShape.of(job, profile, cuda)
    notes: list[str] = []
    work = block_work(s, engine, notes)
    if s.spans and not profile.inter_node:
        notes.append("groups across nodes are costed as inside one: the profile has no inter-node "
                     "measurements (calibrate on the nodes: python -m titan_exp.perf.calibrate cluster.nnodes=N ...)")
    if s.ep > 1 and work.gpu is not None:
        notes.append("expert parallel: its all-to-all is priced by its bytes and NCCL's latencies; Megatron-Bridge's "
                     "published MoE runs over NCCL's all-to-all ran slower than that prices them (BENCHMARKS.md, "
                     "Megatron's MoE engine beyond the parts), so take EP layouts' times as optimistic")
    parts = slowest_rank(s, work, inline_comm(s, work, engine.tp_overlap, engine.ep_overlap), engine)
    step = sum(parts.values())
    tokens = job.training.global_batch_size * job.training.seq_len
    return StepPrediction(step, tokens / step / s.world, parts, notes)


def gpu_work_by_kind(job: JobConfig, profile: MachineProfile, engine: Engine = TITAN_EXP) -> dict[str, float]:
    """Seconds of one GPU's device work in a step of `job` (one replica: no PP, TP, CP or EP) by
    kind of kernel, as train.trace.gpu_summary splits a traced step (busy_by_kind_ms): the blocks'
    and the head's GEMMs, attention and memory-bound kernels, recomputation included, at
    `profile`'s kernel rates and compute correction, and the optimizer phase. What a prediction
    says of each part, to set beside a trace of the step."""
    job = resolved(job)
    p, m = job.parallelism, job.model
    if max(p.pipeline_parallel_degree, p.tensor_parallel_degree, p.context_parallel_degree,
           p.expert_parallel_degree) > 1:
        raise ValueError("gpu_work_by_kind prices one replica's blocks: a layout without PP, TP, CP or EP")
    if not profile.kernels or profile.kernels.architecture == "cpu":
        raise ValueError(f"profile {profile.name} has no GPU kernel rates: a GPU's calibrated or spec-sheet profile")
    times = block_times(job, 1, profile.kernels, engine)
    fwd = times.kinds["fwd"]
    recompute = {kind: recomputed(job.activation_checkpoint, fwd[kind], times.kinds["selective"][kind]) for kind in fwd}
    microbatches = job.accumulation
    c = profile.corrections.compute
    work = {kind: c * microbatches * (m.n_layers * (fwd[kind] + times.kinds["bwd"][kind] + recompute[kind])
                                      + times.kinds["head"][kind]) for kind in times.kinds["fwd"]}
    work["optimizer"] = predict_step(job, profile, cuda=True, engine=engine).parts["optimizer"]
    return work
