"""The performance model: seconds per step and tokens/s per device of one layout, from a machine
profile (perf.profile), by part, so a report can say where the time goes.

Compute. A rank's work per microbatch is its blocks' measured forward + backward (at its TP
degree, on sequences of seq_len / cp) plus the head on the last stage, scaled for the precision
(the GEMM share of the block at the dtype's measured matmul rate), for compile (when its
speed-up was calibrated) and by the profile's fitted correction. Activation checkpointing adds a
forward per block (full), the non-matmul part of a forward (selective per op), or a forward every
Nth block.

A GPU whose profile has no measured block of the model but its kernels' rates (`kernels`: from
its spec sheet, perf.devices, or measured by calibrate, perf.measure_kernels) has its block, head
and the non-matmul part selective AC recomputes priced from their parts by perf.gpu (precision
and compile inside them), and what FSDP, DDP and async TP hide follows the schedule there
(overlap.fsdp_exposed, overlap.async_tp_exposed) rather than a measured overlap.

Ranks share the machine. Costs were measured with every rank computing at once, and the profile
says how many ranks compute at full speed at once (S). If on average `active` ranks compute, each
runs max(1, active / S) / max(1, world / S) times the measured time: every rank of a
data/tensor-parallel layout is busy all step (1x), while pipeline ranks idle in the bubble and
leave the cores to the others, which is why pp4 does well on a 2-core CPU and not on 4 GPUs.

Pipeline. The critical path of a schedule is (microbatches + b x (pp - 1) / v) x the slowest
rank's time per microbatch, with v stages per rank and b = 1, or 1/2 for the zero-bubble
schedules (backward split into input and weight gradients fills part of the bubble). On a GPU
priced from its parts that time holds the TP, CP and EP collectives inside the rank's blocks.
Every rank waits the path out and adds the rest of its own communication and its optimizer: the
step is the rank that ends last.

Communication, from the measured latency + bytes / bandwidth of each collective at its group size:
  FSDP   all-gather per block forward (and again in backward when resharded after forward;
         once per step under PP, whose stages keep parameters gathered), reduce-scatter per block;
         hidden behind compute by the measured overlap only on GPUs (FSDP2 prefetches on a
         separate stream; on a CPU there is none). Where calibration measured a real FSDP block
         at the shard degree (tp 1), a block costs what it added (its copies, fresh buffers and
         waits for other ranks as well), scaled from two fp32 all-gathers and a reduce-scatter
         to the job's gathers and dtype by the collectives' lines. Under float8 all-gather the
         blocks' float8 linears travel a byte each, cast from the shard first (shapes.float8_gathered).
  HSDP   + an all-reduce of each block's gradient shard over the replicas (on a GPU priced from its
         parts, beside the backward after its reduce-scatter, as FSDP2 issues it).
  DDP    one all-reduce of the gradients in 25 MiB buckets, overlapped with backward as measured.
  TP/SP  per block and microbatch what a real TP + SP block took beyond the plain sharded one
         (calibrated: its collectives and DTensor's own overhead); else 4 all-gathers and 4
         reduce-scatters of the activations in their dtype (+2 each with full AC; the forward
         all-gathers in float8 under float8 TP on a GPU); plus the embedding's and output's.
         Async TP hides them behind the matmuls they are fused with: on a GPU priced from its
         parts, those torch's pass fuses (overlap.async_tp_exposed); else by the measured overlap.
         An MoE layer's collectives differ from a dense SwiGLU's (moe_tp_extra), waited for in full.
  CP     per block and microbatch what a real CP block took beyond the plain one on 1/cp of the
         sequence (calibrated: the K/V all-gather, and its chunks' attention over the keys before them);
         else an all-gather of K and V forward (again when recomputed), a reduce-scatter backward.
  PP     a send and a receive per stage and microbatch, forward and backward; on a GPU priced from
         its parts, only what the schedule cannot hide (overlap.p2p_exposed).
  EP     per MoE layer and microbatch, the tokens' trip to their experts and back, forward and
         backward (again when recomputed): four all-to-alls of tokens x top_k x dim over ep ranks
         (each TP rank's 1/tp of the tokens: EP spreads over TP, parallel.expert), and the
         token-count exchange before each forward one, over the network only where ep ranks
         outgrow a node (ep_spans_nodes), and then only the bytes for other nodes' ranks
         (ep_node_ranks: half of them over two nodes). The routed experts are gathered by
         FSDP over efsdp = dp_shard x cp x tp / ep ranks only, 1/ep of them per rank.
A group that spans nodes pays the profile's inter-node line, through as many NICs at once as it
has ranks in each node (node_ranks; MachineProfile.collective): FSDP over two full nodes of 8
GPUs moves its bytes 8 x faster than HSDP's replicas, one rank per node, do.
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
taken at the share of its FLOPs left). A calibrated MoE block (calibrate model=<an MoE model>) measures dispatch as well; a GPU
block from its parts prices the router, the grouped GEMM over the local experts and the
dispatch's copies (gpu.routed_experts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from titan_exp.config import ACMode, ActivationCheckpointConfig, JobConfig
from titan_exp.parallel.pipeline import RankLoad, rank_loads
from titan_exp.parallel.tensor import float8_collectives
from titan_exp.perf.gpu import block_times, hbm
from titan_exp.perf.model_ops import LLAMA, Elementwise
from titan_exp.perf.overlap import async_tp_exposed, ep_exposed, fsdp_exposed, p2p_exposed
from titan_exp.perf.placement import across_nodes, ep_node_ranks, ep_spans_nodes, node_ranks
from titan_exp.perf.profile import BlockCost, Line, MachineProfile, model_shape
from titan_exp.perf.shapes import float8_gathered, fsdp_rounds
from titan_exp.validation import resolve

# Extra bubble a schedule leaves, as a share of 1F1B's.
BUBBLE = {"GPipe": 1.0, "1F1B": 1.0, "Interleaved1F1B": 1.0, "LoopedBFS": 1.0,
          "InterleavedZeroBubble": 0.5, "ZBVZeroBubble": 0.5, "DualPipeV": 0.5}
DDP_BUCKET_BYTES = 25 * 2**20
NONMATMUL = 1.3  # a block's time over its matmuls' when no block was measured (estimate)

# How the parts add up into the report's breakdown.
COMM_PARTS = ("fsdp", "hsdp", "ddp", "tp", "cp", "p2p", "ep")
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
    gemm = profile.gemm.get("float32") or Line(20e-6, 1 / 80e9)
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


def moe_tp_extra(job: JobConfig, rs: Line, ar: Line, act_elements: float, act_bytes: float,
                 full: int) -> float:
    """The mean block's TP collectives per microbatch beyond a dense block's, from its MoE layers
    (parallel.tensor.moe_plan; a dense SwiGLU all-gathers its input and reduce-scatters its output
    forward, and the same backward). Without EP the MoE layer's output is reduce-scattered as a
    SwiGLU's; backward, where a SwiGLU reduce-scatters its input gradient once, the routed tokens'
    input gradient is all-reduced over TP, and the shared experts' twice (the hooks of their
    column-wise w1 and w3 each sum their own). Under EP over TP nothing is reduce-scattered: the
    forward's output is the shared experts' all-reduce (nothing without them), backward their two.
    Either way the combine weights' gradient (tokens x top_k, fp32) is all-reduced. The forward
    repeats under full AC (`full`). tests/test_moe.py counts these on the layer."""
    m = job.model
    if not m.n_moe_layers:
        return 0.0
    shared = 1 if m.n_shared_experts else 0
    weights = ar(act_elements / m.dim * m.top_k * 4)
    if job.parallelism.expert_parallel_degree > 1:
        forward = shared * ar(act_bytes) - rs(act_bytes)
        backward = 2 * shared * ar(act_bytes) + weights - rs(act_bytes)
    else:
        forward = 0.0
        backward = (1 + 2 * shared) * ar(act_bytes) + weights - rs(act_bytes)
    return m.n_moe_layers / m.n_layers * ((1 + full) * forward + backward)


def recomputed(ac: ActivationCheckpointConfig, fwd: float, per_op: float) -> float:
    """What activation checkpointing recomputes of a block whose forward takes `fwd`: all of it
    (full), `per_op` (per-op selective: what its policy does not save), or every n-th block's
    forward (selective_ac_option n), spread over the blocks; in `fwd`'s units."""
    if ac.mode == ACMode.full:
        return fwd
    if ac.mode == ACMode.selective:
        return per_op if ac.selective_ac_option == "op" else fwd / int(ac.selective_ac_option)
    return 0.0


def predict_step(job: JobConfig, profile: MachineProfile, *, cuda: bool | None = None,
                 elementwise: Elementwise = LLAMA, tp_overlap: str = "micro_pipeline",
                 float8_experts: bool = False, output_heads: int = 1, ep_overlap: bool = False) -> StepPrediction:
    """One training step of `job` on `profile`'s machine. A GPU block priced from its parts takes its
    memory-bound kernels as `elementwise` says (this toolkit's Llama; another model's for a
    published run of it), async TP as `tp_overlap` runs it (overlap.TP_OVERLAP: torch's
    micro-pipeline pass, this toolkit's; or another engine's), and an MoE's routed experts in
    float8 under a float8 recipe only if `float8_experts` (another engine's; this toolkit's stay
    in bf16), EP's all-to-alls beside another microbatch's compute only if `ep_overlap`
    (perf.overlap.ep_exposed: another engine's schedule; this toolkit's EP waits in full). The
    last stage runs the output head and its loss `output_heads` times a microbatch:
    once in this toolkit's models; a published model's multi-token prediction layers each run it
    once more (DeepSeek-V3's share the output head)."""
    if job.parallelism.data_parallel_shard_degree == -1:
        job = resolve(job)
    p, t, m = job.parallelism, job.training, job.model
    cuda = profile.key.get("device", "cpu") != "cpu" if cuda is None else cuda
    pp, rep, dps, cp, tp = (p.pipeline_parallel_degree, p.data_parallel_replicate_degree,
                            p.data_parallel_shard_degree, p.context_parallel_degree, p.tensor_parallel_degree)
    world = pp * rep * dps * cp * tp
    notes: list[str] = []
    local = t.local_batch_size
    accumulation = job.accumulation
    mb = p.pipeline_parallel_microbatch_size if pp > 1 else local
    n_mb = max(1, local // mb)
    seqs = mb / cp  # sequences of full length this rank's block work equals, per microbatch

    gpu = None
    gpu_kernels = profile.kernels if profile.kernels and profile.kernels.architecture != "cpu" else None
    # A GPU's block from its parts, at its kernels' rates (measured, or the spec sheet's). GPU
    # profiles calibrated before 2026-11-25 also hold blocks timed in fp32 without autocast, which
    # say nothing of bf16 or float8 kernels (the 1B's: 8x a bf16 block's share of an H200 step): unread.
    if gpu_kernels and cuda:
        gpu = block_times(job, tp, gpu_kernels, elementwise, float8_experts)
        notes += gpu.notes
        cost = BlockCost(Line(0.0, 0.0), Line(0.0, 0.0), Line(0.0, 0.0))  # nothing measured
        c = profile.corrections.compute
        fwd, block, head = gpu.fwd * c, (gpu.fwd + gpu.bwd) * c, gpu.head * c
        kept = fwd - gpu.selective_s * c  # what per-op selective AC saves rather than recomputes
    else:
        cost = profile.block(model_shape(job), tp)
        if cost is None:
            notes.append(f"block {model_shape(job)} at tp={tp} not calibrated: estimated from FLOPs "
                         f"(python -m titan_exp.perf.calibrate model={m.flavor} training.seq_len={t.seq_len})")
            cost = estimated_block(job, tp, profile)
        gemm32 = profile.gemm.get("float32")
        block_fwd_flops = 2 * m.block_matmul_params(tp, experts_whole=True) * mb * t.seq_len / cp  # as measured
        scale = dtype_factor(job, profile, 3 * block_fwd_flops, cost.fwd_bwd(seqs), notes) * profile.corrections.compute
        if job.compile.enable:
            if profile.compile_speedup:
                scale /= profile.compile_speedup
            else:
                notes.append("compile speed-up not calibrated (calibrate --compile): modelled as eager")
        scale *= m.measured_block_share(tp)  # measured with the routed experts whole on every TP rank
        block = cost.fwd_bwd(seqs) * scale
        fwd = cost.fwd(seqs) * scale
        head = cost.head(seqs) * scale
        kept = gemm32(block_fwd_flops) * scale if gemm32 else 0.6 * fwd  # the matmuls
    ac = job.activation_checkpoint
    recompute = recomputed(ac, fwd, max(0.0, fwd - kept))
    if ac.mode == ACMode.selective and ac.selective_ac_option == "op" and gpu is not None and not job.compile.enable:
        notes.append("selective AC without compile: its per-op policy runs in Python on every op, forward and "
                     "recompute, which this time leaves out; on one H200 the 1B's such step was bound by its host, "
                     "slower than full AC and 26-38 % slower than predicted (BENCHMARKS.md, the 1B's grid): "
                     "take it as optimistic, or compile")

    # Compute, the bubble, and the machine's ranks competing for its cores.
    loads = rank_loads(p, m.n_layers)
    per_mb = [r.blocks * (block + recompute) + r.last * output_heads * head for r in loads]
    v = loads[0].stages
    pr = job.precision
    param_bytes = 2 if pr.param_dtype == "bfloat16" else 4
    # Activations travel in the compute dtype: bf16 under bf16 mixed precision (FSDP casts the
    # parameters, so every block's output is bf16), else fp32.
    act_elements = mb * t.seq_len / cp * m.dim
    act_bytes = act_elements * (2 if pr.param_dtype == "bfloat16" or pr.full_bf16 else 4)
    ep = p.expert_parallel_degree
    routed = m.routed_params_per_block  # 0 for a dense model
    # Per-TP-rank parameter counts of the FSDP units over dp_shard x cp: the blocks (less their
    # routed experts under EP, which are a unit of their own), the embedding, the output.
    block_unit = (m.block_params - routed) / tp + (m.routed_params_on_tp_rank(tp, 1) if ep == 1 else 0)
    shard = dps * cp
    full = 1 if ac.mode == ACMode.full else 0
    spans = across_nodes(job)
    if spans and not profile.inter_node:
        notes.append("groups across nodes are costed as inside one: the profile has no inter-node "
                     "measurements (calibrate on the nodes: python -m titan_exp.perf.calibrate cluster.nnodes=N ...)")
    if p.expert_parallel_degree > 1 and gpu is not None:
        notes.append("expert parallel: its all-to-all is priced by its bytes and NCCL's latencies; Megatron-Bridge's "
                     "published MoE runs over NCCL's all-to-all ran slower than that prices them (BENCHMARKS.md, "
                     "Megatron's MoE engine beyond the parts), so take EP layouts' times as optimistic")

    priced_lines: dict[tuple, Line] = {}

    def line(op: str, group: int, dims: tuple[str, ...]) -> Line:
        """The profile's line for `op` on a group of `group` ranks over the mesh dims `dims`: across
        nodes if they span nodes, through as many NICs as the group has ranks in a node."""
        key = (op, group, dims)
        if key not in priced_lines:
            priced_lines[key] = profile.collective(op, group, bool(set(dims) & spans), node_ranks(job, dims))
        return priced_lines[key]

    # Seconds a microbatch waits for the collectives inside a rank's blocks: TP's and CP's per
    # block (TP's also at the embedding and the output: per end, and the loss's), EP's per MoE block.
    tp_block = tp_end = tp_loss = cp_block = ep_block = 0.0
    if tp > 1:
        ag, rs, ar = (line(op, tp, ("tp",)) for op in ("all_gather", "reduce_scatter", "all_reduce"))
        if cost.tp_comm is not None and "tp" not in spans:  # measured inside a node
            # Measured on a real TP block (a recomputed forward repeats a third of it); the
            # embedding's and output's collectives are in the measured rest of the model (head).
            tp_block = cost.tp_comm(seqs) * (1 + full / 3)
        else:
            # Forward (and its recompute): 2 all-gathers (in float8 where torchao's float8 TP
            # styles run, on NCCL) and 2 reduce-scatters; backward: 2 of each, in bf16/fp32.
            fwd_gather = act_elements if float8_collectives(job, cuda) else act_bytes  # float8: a byte each
            tp_block = (2 + 2 * full) * (ag(fwd_gather) + rs(act_bytes)) + 2 * (ag(act_bytes) + rs(act_bytes))
            if gpu is not None and p.enable_async_tensor_parallel:  # collectives beside their GEMMs
                partials = act_bytes * (1 + 1 / tp) / hbm(gpu_kernels) * c  # read every rank's, write the sum
                forward, backward = async_tp_exposed(ag(fwd_gather), ag(act_bytes), rs(act_bytes),
                                                     tuple(g * c for g in gpu.tp_groups), partials, tp_overlap)
                tp_block = (1 + full) * forward + backward
            tp_block += moe_tp_extra(job, rs, ar, act_elements, act_bytes, full)
            tp_end, tp_loss = ag(act_bytes) + rs(act_bytes), 3 * ar(8 * mb * t.seq_len / cp)
    if cp > 1:
        base = profile.block(model_shape(job), 1)
        if base is not None and cp in base.cp_extra:  # measured on a real CP block (at tp 1)
            cp_block = base.cp_extra[cp](mb) / tp * (1 + full / 3)
        else:
            ag, rs = line("all_gather", cp, ("cp",)), line("reduce_scatter", cp, ("cp",))
            # The whole sequence's K and V (MLA's: every head's, its values narrower than its keys)
            k_bytes, v_bytes = (act_bytes / m.dim * cp * m.kv_heads * width / tp
                                for width in (m.head_size, m.v_head_size))
            cp_block = (1 + full) * (ag(k_bytes) + ag(v_bytes)) + (rs(k_bytes) + rs(v_bytes))
    if ep > 1:
        a2a = profile.collective("all_to_all", ep, ep_spans_nodes(job), ep_node_ranks(job))
        routed_bytes = (mb * t.seq_len / cp / p.dispatch_split * m.top_k * m.dim
                        * (2 if job.precision.param_dtype == "bfloat16" else 4))
        ep_fwd = 2 * a2a(routed_bytes) + a2a(8 * m.n_experts)  # dispatch, combine, the token counts
        ep_bwd = 2 * a2a(routed_bytes) + full * ep_fwd  # and the recomputed forward's
        per_layer = ep_fwd + ep_bwd
        if ep_overlap and gpu is not None:  # beside another microbatch's compute (another engine's)
            per_layer = ep_exposed(ep_fwd, ep_bwd, fwd, block - fwd + recompute, accumulation * n_mb)
        ep_block = m.n_moe_layers / m.n_layers * per_layer

    def inline_comm(load: RankLoad) -> dict[str, float]:
        """A microbatch's seconds in the collectives inside the blocks of a rank holding `load`."""
        comm = {"tp": load.blocks * tp_block + (load.first + load.last) * tp_end + load.last * tp_loss,
                "cp": load.blocks * cp_block, "ep": load.blocks * ep_block}
        return {part: s for part, s in comm.items() if {"tp": tp, "cp": cp, "ep": ep}[part] > 1}

    # On a GPU priced from its parts these collectives lengthen each microbatch of a stage, so the
    # fill and drain of the pipeline too.
    comm_mb = [inline_comm(r) for r in loads]
    period = [compute + (sum(comm.values()) * profile.corrections.communication if gpu is not None else 0.0)
              for compute, comm in zip(per_mb, comm_mb)]
    slowest = max(range(len(loads)), key=lambda i: period[i])
    critical = (n_mb + (BUBBLE[p.pipeline_parallel_schedule] * (pp - 1) / v if pp > 1 else 0)) * period[slowest]
    # Costs were measured with all `world` ranks computing; fewer at a time run faster.
    active = world / pp * sum(n_mb * c for c in per_mb) / critical
    slowdown = max(1.0, active / profile.concurrency) / max(1.0, world / profile.concurrency)

    def rank_parts(rank: int) -> dict[str, float]:
        """Pipeline rank `rank`'s step by part: the schedule's critical path, of which its own
        blocks' compute and (GPU) the collectives inside them, the rest idle (bubble); then the
        rest of its communication and its optimizer."""
        load = loads[rank]
        busy = n_mb * per_mb[rank]
        share_recompute = load.blocks * recompute / per_mb[rank] if per_mb[rank] else 0.0
        parts = {
            "compute": accumulation * busy * (1 - share_recompute) * slowdown,
            "recompute": accumulation * busy * share_recompute * slowdown,
            "bubble": accumulation * (critical - n_mb * period[rank]) * slowdown,
        }
        units = [block_unit] * load.blocks + (
            [m.embedding_params / tp] if load.first else []) + ([m.output_params / tp] if load.last else [])
        compute_window = parts["compute"] + parts["recompute"]
        # A real FSDP block measured at this shard degree (tp 1, without EP, inside a node).
        measured_fsdp = (cost.fsdp_extra.get(shard) if shard > 1 and tp == 1 and ep == 1 and load.blocks
                         and not {"dp_shard", "cp"} & spans else None)

        if shard > 1:
            wide = bool({"dp_shard", "cp"} & spans)  # the flattened dp_shard x cp group spans nodes
            ag, rs = line("all_gather", shard, ("dp_shard", "cp")), line("reduce_scatter", shard, ("dp_shard", "cp"))
            rounds, gathers = fsdp_rounds(job, accumulation)
            # Bytes each unit gathers: the blocks' float8 linears a byte each under float8 all-gather,
            # after their amax (one all-reduce per weight unless precomputed once a step) and their
            # cast from the shard (fp32 read, a byte written; on a GPU priced at HBM speed).
            f8, f8_weights = float8_gathered(job)
            sent = [u * param_bytes - (f8 * (param_bytes - 1) if i < load.blocks else 0.0)
                    for i, u in enumerate(units)]
            block_ag = ag(sent[0]) if load.blocks else 0.0
            precomputed = pr.float8_precompute_dynamic_scale_for_fsdp
            amax = line("all_reduce", shard, ("dp_shard", "cp"))
            per_byte = 1 / hbm(gpu_kernels) if f8 and gpu_kernels and cuda else 0.0
            shard_f8 = f8 / shard  # elements of the block's float8 weights on this rank, fp32
            scales_s = 0.0  # once a step when precomputed: every block's amax (a read of its shard), one all-reduce
            if f8 and precomputed:
                scales_s = load.blocks * shard_f8 * 4 * per_byte + amax(4 * f8_weights * load.blocks)
            elif f8:  # per gather: the amax (a read of the shard) and one all-reduce a weight
                block_ag += shard_f8 * 4 * per_byte + f8_weights * amax(4)
            block_ag += shard_f8 * 5 * per_byte  # per gather: the cast, reading 4 bytes and writing 1
            gather_s = [block_ag if i < load.blocks else ag(b) for i, b in enumerate(sent)]
            comm = rounds * sum(gathers * g + rs(u * 4) for g, u in zip(gather_s, units))
            if measured_fsdp is not None:  # the blocks as a real FSDP block measured, for this round's gathers, dtype
                block_u = units[0]
                lines = gathers * block_ag + rs(block_u * 4)
                measured_lines = 2 * ag(block_u * 4) + rs(block_u * 4)
                comm += rounds * load.blocks * (measured_fsdp(seqs) * lines / measured_lines - lines)
            efsdp = shard * tp // ep
            if ep > 1 and efsdp > 1:  # each rank's 1/ep of the routed experts, over efsdp ranks
                eag = profile.collective("all_gather", efsdp, wide)
                ers = profile.collective("reduce_scatter", efsdp, wide)
                comm += rounds * load.blocks * (gathers * eag(routed / ep * param_bytes) + ers(routed / ep * 4))
            # HSDP: each unit's gradient shard all-reduced over the replicas, once a step
            ar = line("all_reduce", rep, ("dp_replicate",)) if rep > 1 else None
            reduced = [ar(u / shard * 4) for u in units] if ar else [0.0] * len(units)
            routed_ar = ar(routed / (shard * tp) * 4) if ar and ep > 1 else 0.0
            if gpu is not None:  # what the schedule hides: each gather behind the block before it (perf.gpu)
                per_round = accumulation * n_mb / rounds
                gather = block_ag
                reduce = rs(units[0] * 4) if load.blocks else 0.0
                if ep > 1 and efsdp > 1 and load.blocks:
                    gather, reduce = gather + eag(routed / ep * param_bytes), reduce + ers(routed / ep * 4)
                ends = sum(gathers * g + rs(u * 4) for g, u in list(zip(gather_s, units))[load.blocks:])
                hidden = (gathers, per_round * fwd, per_round * (block - fwd + recompute), load.blocks)
                parts["fsdp"] = rounds * fsdp_exposed(gather, reduce, *hidden, ends)
                if ar:  # a block's after its reduce-scatter, beside the last round's backward, as FSDP2 issues it
                    block_ar = (reduced[0] + routed_ar) if load.blocks else 0.0
                    ends_ar = ends + sum(reduced[load.blocks:])
                    parts["hsdp"] = (fsdp_exposed(gather, reduce + block_ar, *hidden, ends_ar)
                                     - fsdp_exposed(gather, reduce, *hidden, ends))
            else:
                parts["fsdp"] = comm - (profile.overlap * min(comm, compute_window) if cuda else 0.0)
                if ar:
                    parts["hsdp"] = sum(reduced) + load.blocks * routed_ar
            parts["fsdp"] += scales_s  # once a step, between the optimizer and the next forward: not hidden
        elif rep > 1:
            ar = line("all_reduce", rep, ("dp_replicate",))
            grad_bytes = sum(units) * 4
            buckets = math.ceil(grad_bytes / DDP_BUCKET_BYTES)
            comm = buckets * ar.latency_s + grad_bytes * ar.per_unit_s
            if gpu is not None:  # buckets reduce during backward; the last waits, and what backward cannot hide
                backward = n_mb * load.blocks * (block - fwd + recompute)
                parts["ddp"] = max(ar(min(grad_bytes, DDP_BUCKET_BYTES)), comm - backward)
            else:
                parts["ddp"] = comm - profile.overlap * min(comm, compute_window)
        for part in ("tp", "cp"):
            if part in comm_mb[rank]:
                parts[part] = accumulation * n_mb * comm_mb[rank][part]
        if p.enable_async_tensor_parallel and cuda and gpu is None and tp > 1:  # fused with the matmuls, as measured
            parts["tp"] -= profile.overlap * min(parts["tp"], compute_window)
        if pp > 1:
            sr = profile.collective("send_recv", 2, "pp" in spans)
            send, sends = sr(act_bytes / tp), n_mb * 2 * v
            parts["p2p"] = accumulation * (p2p_exposed(send, pp, sends, load.blocks * fwd / v) if gpu is not None
                                           else sends * send)
        if ep > 1:
            parts["ep"] = accumulation * n_mb * comm_mb[rank]["ep"]
        for part in COMM_PARTS:
            if part in parts:
                parts[part] = max(0.0, parts[part]) * profile.corrections.communication
        local_params = sum(units) / shard + (load.blocks * routed / (shard * tp) if ep > 1 else 0.0)
        if tp > 1 and cost.update is not None:  # a real TP model's, measured: its blocks and its rest
            rest = (load.first + load.last) / 2  # the embedding's and the output's halves of it
            parts["optimizer"] = cost.update.latency_s * rest + cost.update.per_unit_s * load.blocks
        else:
            parts["optimizer"] = local_params * profile.optimizer_s_per_param
        parts["optimizer"] *= profile.corrections.compute
        if not cuda and profile.fresh_memory_s_per_byte:
            blocks = 0 if measured_fsdp is not None else load.blocks  # measured FSDP blocks: in their cost
            from titan_exp.perf.memory_cpu import fresh_bytes  # only a CPU's terms read it

            parts["fresh_memory"] = (fresh_bytes(job, blocks, load.first, load.last, accumulation)
                                     * profile.fresh_memory_s_per_byte * profile.corrections.compute)
        parts["overhead"] = profile.step_overhead_s + profile.corrections.overhead_s
        return parts

    # The step ends with its slowest rank: the critical path is every rank's, the rest of its
    # communication and its optimizer its own (fewer blocks but more of those can end last).
    ranks = {r: i for i, r in enumerate(loads)}.values()  # one of each load
    parts = max((rank_parts(i) for i in ranks), key=lambda d: sum(d.values()))
    step = sum(parts.values())
    tokens = t.global_batch_size * t.seq_len
    return StepPrediction(step, tokens / step / world, parts, notes)


def gpu_work_by_kind(job: JobConfig, profile: MachineProfile, elementwise: Elementwise = LLAMA) -> dict[str, float]:
    """Seconds of one GPU's device work in a step of `job` (one replica: no PP, TP, CP or EP) by
    kind of kernel, as perf.trace.gpu_summary splits a traced step (busy_by_kind_ms): the blocks'
    and the head's GEMMs, attention and memory-bound kernels, recomputation included, at
    `profile`'s kernel rates and compute correction, and the optimizer phase. What a prediction
    says of each part, to set beside a trace of the step."""
    job = resolve(job) if job.parallelism.data_parallel_shard_degree == -1 else job
    p, m = job.parallelism, job.model
    if max(p.pipeline_parallel_degree, p.tensor_parallel_degree, p.context_parallel_degree,
           p.expert_parallel_degree) > 1:
        raise ValueError("gpu_work_by_kind prices one replica's blocks: a layout without PP, TP, CP or EP")
    if not profile.kernels or profile.kernels.architecture == "cpu":
        raise ValueError(f"profile {profile.name} has no GPU kernel rates: a GPU's calibrated or spec-sheet profile")
    times = block_times(job, 1, profile.kernels, elementwise)
    fwd = times.kinds["fwd"]
    recompute = {kind: recomputed(job.activation_checkpoint, fwd[kind], times.kinds["selective"][kind]) for kind in fwd}
    microbatches = job.accumulation
    c = profile.corrections.compute
    work = {kind: c * microbatches * (m.n_layers * (fwd[kind] + times.kinds["bwd"][kind] + recompute[kind])
                                      + times.kinds["head"][kind]) for kind in times.kinds["fwd"]}
    work["optimizer"] = predict_step(job, profile, cuda=True, elementwise=elementwise).parts["optimizer"]
    return work
