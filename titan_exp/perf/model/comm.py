"""A training step's communication by part, for perf.model.step: what one rank of a layout waits for, from
the profile's measured latency + bytes / bandwidth of each collective at its group size.

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
         reduce-scatters of the activations in their dtype (the forward all-gathers in float8
         under float8 TP on a GPU); plus the embedding's and output's. What AC recomputes runs
         again: the forward's 2 all-gathers under per-op selective AC (its policy saves
         reduce-scatters and all-to-alls, parallel.activation_checkpoint), and under full AC the
         attention's reduce-scatter too (the block's last, the feed-forward's, only feeds the
         residual sum, which backward does not read; torch's recompute stops before it).
         Async TP hides them behind the matmuls they are fused with: on a GPU priced from its
         parts, those torch's pass fuses (overlap.async_tp_exposed); else by the measured overlap.
         An MoE layer's collectives differ from a dense SwiGLU's (moe_tp_extra), waited for in full.
  CP     per block and microbatch what a real CP block took beyond the plain one on 1/cp of the
         sequence (calibrated: the K/V all-gather, and its chunks' attention over the keys before them);
         else one all-gather of K and V together forward (again where AC recomputes the
         attention's input: full, and per-op selective), a reduce-scatter backward.
  PP     a send and a receive per stage and microbatch, forward and backward; on a GPU priced from
         its parts, only what the schedule cannot hide (overlap.p2p_exposed).
  Muon   (optimizer=muon) once a step, after backward (so not hidden): each block matrix's update
         all-gathered whole over FSDP's group and TP's, a routed experts' stack over the ranks that
         split it other than by experts (muon_gathers, train.muon.orthogonalised).
  EP     per MoE layer and microbatch, the tokens' trip to their experts and back, forward and
         backward (again under full AC; per-op selective saves them): four all-to-alls of tokens
         x top_k x dim over ep ranks (each TP rank's 1/tp of the tokens: EP spreads over TP,
         parallel.expert), and the token-count exchange before each forward one, over the
         network only where ep ranks outgrow a node (ep_spans_nodes), and then only the bytes for
         other nodes' ranks (ep_node_ranks: half of them over two nodes). The routed experts are
         gathered by FSDP over efsdp = dp_shard x cp x tp / ep ranks only, 1/ep of them per rank.
A group that spans nodes pays the profile's inter-node line, through as many NICs at once as it
has ranks in each node (node_ranks; MachineProfile.collective): FSDP over two full nodes of 8
GPUs moves its bytes 8 x faster than HSDP's replicas, one rank per node, do.

TP's, CP's and EP's collectives sit inside a rank's blocks, so on a GPU priced from its parts they
lengthen each microbatch (InlineComm, which perf.model.step puts on the pipeline's critical path); the
data-parallel ones, the pipeline's sends and async TP's overlap are per rank and step
(communication).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

from titan_exp.config import ACMode, JobConfig
from titan_exp.parallel.pipeline import RankLoad, rank_loads
from titan_exp.parallel.tensor import float8_collectives
from titan_exp.perf.model.block import BlockTimes
from titan_exp.perf.model.overlap import async_tp_exposed, ep_exposed, fsdp_exposed, p2p_exposed
from titan_exp.perf.model.placement import across_nodes, ep_node_ranks, ep_spans_nodes, node_ranks
from titan_exp.perf.model.shapes import float8_gathered, fsdp_rounds, muon_matrices
from titan_exp.perf.rates.kernels import hbm
from titan_exp.perf.rates.profile import BlockCost, Line, MachineProfile, model_shape
from titan_exp.train import muon

DDP_BUCKET_BYTES = 25 * 2**20
COMM_PARTS = ("fsdp", "hsdp", "ddp", "tp", "cp", "p2p", "ep")  # a step's exposed communication, by part


@dataclass(frozen=True)
class StepShape:
    """What every part of a step of `job` on `profile`'s machine reads: the layout's degrees, the
    microbatches, the bytes of an activation, the FSDP units, which mesh dims span nodes, and the
    profile's line for each collective (`line`). What it derives is computed once (every rank's
    units and collectives read it)."""

    job: JobConfig
    profile: MachineProfile
    cuda: bool
    pp: int
    rep: int
    dps: int
    cp: int
    tp: int
    ep: int
    mb: int  # sequences per microbatch
    n_mb: int  # microbatches per local batch
    accumulation: int  # local batches per step
    loads: list[RankLoad]  # each pipeline rank's blocks, first and last stage
    spans: frozenset[str]  # the mesh dims whose groups span nodes
    _lines: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, job: JobConfig, profile: MachineProfile, cuda: bool) -> StepShape:
        p, local = job.parallelism, job.training.local_batch_size
        pp = p.pipeline_parallel_degree
        mb = p.pipeline_parallel_microbatch_size if pp > 1 else local
        return cls(job, profile, cuda, pp, p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
                   p.context_parallel_degree, p.tensor_parallel_degree, p.expert_parallel_degree, mb,
                   max(1, local // mb), job.accumulation, rank_loads(p, job.model.n_layers),
                   frozenset(across_nodes(job)))

    @cached_property
    def world(self) -> int:
        return self.pp * self.rep * self.dps * self.cp * self.tp

    @cached_property
    def shard(self) -> int:
        """The FSDP group: dp_shard x cp."""
        return self.dps * self.cp

    @cached_property
    def seqs(self) -> float:
        """Sequences of full length this rank's block work equals, per microbatch."""
        return self.mb / self.cp

    @cached_property
    def full(self) -> float:
        """The share of blocks whose forward AC recomputes whole, its collectives too: 1 under full
        AC, 1/N where selective AC checkpoints every Nth block, else 0."""
        ac = self.job.activation_checkpoint
        if ac.mode == ACMode.full:
            return 1.0
        if ac.mode == ACMode.selective and ac.selective_ac_option != "op":
            return 1 / int(ac.selective_ac_option)
        return 0.0

    @cached_property
    def regathered(self) -> float:
        """The share of blocks whose forward all-gathers (TP's, CP's) run again in backward: those
        recomputed whole, and under per-op selective AC every block (its policy saves the
        reduce-scatters and all-to-alls, not the all-gathers, whose outputs the recomputed linears
        and attention read)."""
        ac = self.job.activation_checkpoint
        return 1.0 if ac.mode == ACMode.selective and ac.selective_ac_option == "op" else self.full

    @cached_property
    def param_bytes(self) -> int:
        return 2 if self.job.precision.param_dtype == "bfloat16" else 4

    @cached_property
    def act_elements(self) -> float:
        """Elements of one microbatch's activations between blocks, on this rank's 1/cp of it."""
        return self.mb * self.job.training.seq_len / self.cp * self.job.model.dim

    @cached_property
    def act_bytes(self) -> float:
        """Activations travel in the compute dtype: bf16 under bf16 mixed precision (FSDP casts the
        parameters, so every block's output is bf16), else fp32."""
        pr = self.job.precision
        return self.act_elements * (2 if pr.param_dtype == "bfloat16" or pr.full_bf16 else 4)

    @cached_property
    def routed(self) -> float:
        """A block's routed expert parameters (0 for a dense model)."""
        return self.job.model.routed_params_per_block

    @cached_property
    def _unit_params(self) -> tuple[float, float]:
        m = self.job.model
        block = ((m.block_params - self.routed) / self.tp
                 + (m.routed_params_on_tp_rank(self.tp, 1) if self.ep == 1 else 0))
        return block, m.embedding_params / self.tp

    def units(self, load: RankLoad) -> list[float]:
        """Per-TP-rank parameter counts of a rank's FSDP units over dp_shard x cp: its blocks (less
        their routed experts under EP, which are a unit of their own), the embedding, the output
        (a tied one a copy of the embedding on a rank without it)."""
        block, embedding = self._unit_params
        output = self.job.model.output_params_on(load.first) / self.tp
        return [block] * load.blocks + ([embedding] if load.first else []) + ([output] if load.last else [])

    def line(self, op: str, group: int, dims: tuple[str, ...]) -> Line:
        """The profile's line for `op` on a group of `group` ranks over the mesh dims `dims`: across
        nodes if they span nodes, through as many NICs as the group has ranks in a node."""
        key = (op, group, dims)
        if key not in self._lines:
            self._lines[key] = self.profile.collective(op, group, bool(set(dims) & self.spans),
                                                       node_ranks(self.job, dims))
        return self._lines[key]


@dataclass(frozen=True)
class BlockWork:
    """A block's compute on one rank, per microbatch (perf.model.step.block_work), which its collectives
    run beside: forward, forward + backward, the head's, what activation checkpointing recomputes;
    as calibrated (`cost`) or, on a GPU priced from its parts, `gpu` (else None). `embedding` is the
    share of `head` that runs on the first pipeline stage, not the last (the embedding's)."""

    fwd: float
    block: float
    head: float
    recompute: float
    cost: BlockCost
    gpu: BlockTimes | None
    embedding: float = 0.0

    @property
    def backward_window(self) -> float:
        """What runs after a block's forward: its backward and what it recomputes."""
        return self.block - self.fwd + self.recompute


def moe_tp_extra(job: JobConfig, rs: Line, ar: Line, act_elements: float, act_bytes: float) -> float:
    """The mean block's TP collectives per microbatch beyond a dense block's, from its MoE layers
    (parallel.tensor.moe_plan; a dense SwiGLU all-gathers its input and reduce-scatters its output
    forward, and the same backward). Without EP the MoE layer's output is reduce-scattered as a
    SwiGLU's; backward, where a SwiGLU reduce-scatters its input gradient once, the routed tokens'
    input gradient is all-reduced over TP, and the shared experts' twice (the hooks of their
    column-wise w1 and w3 each sum their own). Under EP over TP nothing is reduce-scattered: the
    forward's output is the shared experts' all-reduce (nothing without them), backward their two.
    Either way the combine weights' gradient (tokens x top_k, fp32) is all-reduced. Recomputing the
    block repeats none of them: the forward's differ from a dense block's in its last collective,
    which only the residual sum reads. tests/test_one_rank.py counts these on the layer, under each AC."""
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
    return m.n_moe_layers / m.n_layers * (forward + backward)


@dataclass(frozen=True)
class InlineComm:
    """Seconds a microbatch waits for the collectives inside a rank's blocks: TP's and CP's per
    block (TP's also at the embedding and the output: per end, and the loss's), EP's per block
    (its MoE layers' share)."""

    tp_block: float = 0.0
    tp_end: float = 0.0
    tp_loss: float = 0.0
    cp_block: float = 0.0
    ep_block: float = 0.0

    def of(self, s: StepShape, load: RankLoad) -> dict[str, float]:
        """A microbatch's seconds in these collectives on a rank holding `load`, by part."""
        comm = {"tp": load.blocks * self.tp_block + (load.first + load.last) * self.tp_end + load.last * self.tp_loss,
                "cp": load.blocks * self.cp_block, "ep": load.blocks * self.ep_block}
        return {part: t for part, t in comm.items() if {"tp": s.tp, "cp": s.cp, "ep": s.ep}[part] > 1}


def inline_comm(s: StepShape, work: BlockWork, tp_overlap: str, ep_overlap: bool) -> InlineComm:
    """The collectives inside the blocks, per microbatch: async TP as `tp_overlap` runs it, EP's
    all-to-alls beside another microbatch's compute if `ep_overlap` (perf.model.step.predict_step)."""
    job, m, t, gpu = s.job, s.job.model, s.job.training, work.gpu
    tp_block = tp_end = tp_loss = cp_block = ep_block = 0.0
    if s.tp > 1:
        ag, rs, ar = (s.line(op, s.tp, ("tp",)) for op in ("all_gather", "reduce_scatter", "all_reduce"))
        if work.cost.tp_comm is not None and "tp" not in s.spans:  # measured inside a node
            # Measured on a real TP block (a recomputed forward repeats a third of it: 2 all-gathers
            # and a reduce-scatter of its 8 collectives; the all-gathers alone, a quarter); the
            # embedding's and output's collectives are in the measured rest of the model (head).
            tp_block = work.cost.tp_comm(s.seqs) * (1 + s.full / 3 + (s.regathered - s.full) / 4)
        else:
            # Forward: 2 all-gathers (in float8 where torchao's float8 TP styles run, on NCCL) and
            # 2 reduce-scatters; backward: 2 of each, in bf16/fp32; the recompute's (StepShape).
            act = s.act_bytes
            fwd_gather = s.act_elements if float8_collectives(job, s.cuda) else act  # float8: a byte each
            tp_block = (2 * (1 + s.regathered) * ag(fwd_gather) + (2 + s.full) * rs(act)
                        + 2 * (ag(act) + rs(act)))
            if gpu is not None and job.parallelism.enable_async_tensor_parallel:  # collectives beside their GEMMs
                c = s.profile.corrections.compute
                partials = act * (1 + 1 / s.tp) / hbm(s.profile.kernels) * c  # read every rank's, write the sum
                groups = tuple(g * c for g in gpu.tp_groups)
                forward, backward = async_tp_exposed(ag(fwd_gather), ag(act), rs(act), groups, partials, tp_overlap)
                gathers = async_tp_exposed(ag(fwd_gather), ag(act), 0.0, groups, 0.0, tp_overlap)[0]
                # Recomputed: the all-gathers' exposed part, and under full AC one of the 2 reduce-scatters'.
                tp_block = forward + backward + s.regathered * gathers + s.full * (forward - gathers) / 2
            tp_block += moe_tp_extra(job, rs, ar, s.act_elements, act)
            tp_end, tp_loss = ag(act) + rs(act), 3 * ar(8 * s.mb * t.seq_len / s.cp)
    if s.cp > 1:
        base = s.profile.block(model_shape(job), 1)
        if base is not None and s.cp in base.cp_extra:  # measured on a real CP block (at tp 1)
            # A recomputed forward repeats a third of it (measured); where only its all-gather
            # reruns (per-op selective AC) the same third is assumed, not measured.
            cp_block = base.cp_extra[s.cp](s.mb) / s.tp * (1 + s.regathered / 3)
        else:
            ag, rs = s.line("all_gather", s.cp, ("cp",)), s.line("reduce_scatter", s.cp, ("cp",))
            # The whole sequence's K and V, in one collective (parallel.context; MLA's: every head's,
            # its values narrower than its keys)
            kv_bytes = s.act_bytes / m.dim * s.cp * m.kv_heads * (m.head_size + m.v_head_size) / s.tp
            cp_block = (1 + s.regathered) * ag(kv_bytes) + rs(kv_bytes)
    if s.ep > 1:
        a2a = s.profile.collective("all_to_all", s.ep, ep_spans_nodes(job), ep_node_ranks(job))
        routed_bytes = (s.mb * t.seq_len / s.cp / job.parallelism.dispatch_split * m.top_k * m.dim
                        * (2 if job.precision.param_dtype == "bfloat16" else 4))
        ep_fwd = 2 * a2a(routed_bytes) + a2a(8 * m.n_experts)  # dispatch, combine, the token counts
        ep_bwd = 2 * a2a(routed_bytes) + s.full * ep_fwd  # and a forward recomputed whole
        per_layer = ep_fwd + ep_bwd
        if ep_overlap and gpu is not None:  # beside another microbatch's compute (another engine's)
            per_layer = ep_exposed(ep_fwd, ep_bwd, work.fwd, work.backward_window, s.accumulation * s.n_mb)
        ep_block = m.n_moe_layers / m.n_layers * per_layer
    return InlineComm(tp_block, tp_end, tp_loss, cp_block, ep_block)


def measured_fsdp(s: StepShape, work: BlockWork, load: RankLoad) -> Line | None:
    """A real FSDP block's extra seconds, measured at this shard degree (tp 1, without EP, inside a
    node), if calibration has it and `load` holds blocks."""
    if s.shard > 1 and s.tp == 1 and s.ep == 1 and load.blocks and not {"dp_shard", "cp"} & s.spans:
        return work.cost.fsdp_extra.get(s.shard)
    return None


def data_parallel(s: StepShape, work: BlockWork, load: RankLoad, compute_window: float) -> dict[str, float]:
    """A rank's FSDP (and HSDP) or DDP seconds per step not hidden behind its compute: on a GPU
    priced from its parts, what the schedule leaves (overlap.fsdp_exposed); else the profile's
    measured overlap of the step's `compute_window` (GPU) or none (CPU)."""
    if s.shard > 1:
        return _fsdp(s, work, load, compute_window)
    if s.rep > 1:
        return {"ddp": _ddp(s, work, load, compute_window)}
    return {}


def _fsdp_gathers(s: StepShape, work: BlockWork, load: RankLoad) -> tuple[list[float], float, float]:
    """Seconds of each unit's all-gather (the blocks' first), and once a step the float8 scales'.
    Bytes each unit gathers: the blocks' float8 linears a byte each under float8 all-gather, after
    their amax (one all-reduce per weight unless precomputed once a step) and their cast from the
    shard (fp32 read, a byte written; on a GPU priced at HBM speed)."""
    job, units = s.job, s.units(load)
    ag = s.line("all_gather", s.shard, ("dp_shard", "cp"))
    f8, f8_weights = float8_gathered(job)
    sent = [u * s.param_bytes - (f8 * (s.param_bytes - 1) if i < load.blocks else 0.0) for i, u in enumerate(units)]
    block_ag = ag(sent[0]) if load.blocks else 0.0
    amax = s.line("all_reduce", s.shard, ("dp_shard", "cp"))
    per_byte = 1 / hbm(s.profile.kernels) if f8 and work.gpu is not None else 0.0
    shard_f8 = f8 / s.shard  # elements of the block's float8 weights on this rank, fp32
    scales_s = 0.0  # once a step when precomputed: every block's amax (a read of its shard), one all-reduce
    if f8 and job.precision.float8_precompute_dynamic_scale_for_fsdp:
        scales_s = load.blocks * shard_f8 * 4 * per_byte + amax(4 * f8_weights * load.blocks)
    elif f8:  # per gather: the amax (a read of the shard) and one all-reduce a weight
        block_ag += shard_f8 * 4 * per_byte + f8_weights * amax(4)
    block_ag += shard_f8 * 5 * per_byte  # per gather: the cast, reading 4 bytes and writing 1
    return [block_ag if i < load.blocks else ag(b) for i, b in enumerate(sent)], block_ag, scales_s


def _fsdp(s: StepShape, work: BlockWork, load: RankLoad, compute_window: float) -> dict[str, float]:
    """FSDP's (and HSDP's replicas') seconds per step not hidden: its gathers and reduce-scatters per
    round, the routed experts' over their own shard group under EP, the replicas' all-reduce."""
    units, routed = s.units(load), s.routed
    wide = bool({"dp_shard", "cp"} & s.spans)  # the flattened dp_shard x cp group spans nodes
    rs = s.line("reduce_scatter", s.shard, ("dp_shard", "cp"))
    rounds, gathers = fsdp_rounds(s.job, s.accumulation)
    gather_s, block_ag, scales_s = _fsdp_gathers(s, work, load)
    comm = rounds * sum(gathers * g + rs(u * 4) for g, u in zip(gather_s, units))
    measured = measured_fsdp(s, work, load)
    if measured is not None:  # the blocks as a real FSDP block measured, for this round's gathers, dtype
        ag, block_u = s.line("all_gather", s.shard, ("dp_shard", "cp")), units[0]
        lines = gathers * block_ag + rs(block_u * 4)
        measured_lines = 2 * ag(block_u * 4) + rs(block_u * 4)
        comm += rounds * load.blocks * (measured(s.seqs) * lines / measured_lines - lines)
    efsdp = s.shard * s.tp // s.ep
    if s.ep > 1 and efsdp > 1:  # each rank's 1/ep of the routed experts, over efsdp ranks
        eag = s.profile.collective("all_gather", efsdp, wide)
        ers = s.profile.collective("reduce_scatter", efsdp, wide)
        comm += rounds * load.blocks * (gathers * eag(routed / s.ep * s.param_bytes) + ers(routed / s.ep * 4))
    # HSDP: each unit's gradient shard all-reduced over the replicas, once a step
    ar = s.line("all_reduce", s.rep, ("dp_replicate",)) if s.rep > 1 else None
    reduced = [ar(u / s.shard * 4) for u in units] if ar else [0.0] * len(units)
    routed_ar = ar(routed / (s.shard * s.tp) * 4) if ar and s.ep > 1 else 0.0
    parts: dict[str, float] = {}
    if work.gpu is not None:  # what the schedule hides: each gather behind the block before it (perf.model.block)
        per_round = s.accumulation * s.n_mb / rounds
        gather = block_ag
        reduce = rs(units[0] * 4) if load.blocks else 0.0
        if s.ep > 1 and efsdp > 1 and load.blocks:
            gather, reduce = gather + eag(routed / s.ep * s.param_bytes), reduce + ers(routed / s.ep * 4)
        ends = sum(gathers * g + rs(u * 4) for g, u in list(zip(gather_s, units))[load.blocks:])
        hidden = (gathers, per_round * work.fwd, per_round * work.backward_window, load.blocks)
        parts["fsdp"] = rounds * fsdp_exposed(gather, reduce, *hidden, ends)
        if ar:  # a block's after its reduce-scatter, beside the last round's backward, as FSDP2 issues it
            block_ar = (reduced[0] + routed_ar) if load.blocks else 0.0
            ends_ar = ends + sum(reduced[load.blocks:])
            parts["hsdp"] = (fsdp_exposed(gather, reduce + block_ar, *hidden, ends_ar)
                             - fsdp_exposed(gather, reduce, *hidden, ends))
    else:
        parts["fsdp"] = comm - (s.profile.overlap * min(comm, compute_window) if s.cuda else 0.0)
        if ar:
            parts["hsdp"] = sum(reduced) + load.blocks * routed_ar
    parts["fsdp"] += scales_s  # once a step, between the optimizer and the next forward: not hidden
    return parts


def _ddp(s: StepShape, work: BlockWork, load: RankLoad, compute_window: float) -> float:
    """DDP's gradient all-reduce in buckets: on a GPU the buckets reduce during backward, the last
    waits, and what backward cannot hide; else the profile's overlap."""
    ar = s.line("all_reduce", s.rep, ("dp_replicate",))
    grad_bytes = sum(s.units(load)) * 4
    buckets = math.ceil(grad_bytes / DDP_BUCKET_BYTES)
    comm = buckets * ar.latency_s + grad_bytes * ar.per_unit_s
    if work.gpu is not None:
        backward = s.n_mb * load.blocks * work.backward_window
        return max(ar(min(grad_bytes, DDP_BUCKET_BYTES)), comm - backward)
    return comm - s.profile.overlap * min(comm, compute_window)


def communication(s: StepShape, work: BlockWork, per_mb: dict[str, float], load: RankLoad,
                  compute_window: float) -> dict[str, float]:
    """A rank's exposed communication per step by part (COMM_PARTS), after the profile's
    communication correction: data parallel's, the collectives inside its blocks (`per_mb`: a
    microbatch's, InlineComm.of) for every microbatch, and the pipeline's sends."""
    job, gpu = s.job, work.gpu
    parts = data_parallel(s, work, load, compute_window)
    for part in ("tp", "cp"):
        if part in per_mb:
            parts[part] = s.accumulation * s.n_mb * per_mb[part]
    if job.parallelism.enable_async_tensor_parallel and s.cuda and gpu is None and s.tp > 1:  # fused, as measured
        parts["tp"] -= s.profile.overlap * min(parts["tp"], compute_window)
    if s.pp > 1:
        sr = s.profile.collective("send_recv", 2, "pp" in s.spans)
        v = s.loads[0].stages
        send, sends = sr(s.act_bytes / s.tp), s.n_mb * 2 * v
        parts["p2p"] = s.accumulation * (p2p_exposed(send, s.pp, sends, load.blocks * work.fwd / v) if gpu is not None
                                         else sends * send)
    if s.ep > 1:
        parts["ep"] = s.accumulation * s.n_mb * per_mb["ep"]
    return {part: max(0.0, t) * s.profile.corrections.communication for part, t in parts.items()}


def muon_experts(s: StepShape) -> tuple[int, int]:
    """How optimizer=muon gets the routed experts' whole matrices (train.muon.orthogonalised keeps a
    stack's split along its experts, dim 0): (ranks splitting each stack by experts, each rank
    orthogonalising its own; ranks of the FSDP group splitting them by rows, which gather them).
    EP splits them by experts, and FSDP too where its ranks divide a rank's experts evenly, else
    by rows (parallel.fsdp.experts_placement)."""
    experts = s.job.model.n_experts
    if s.ep > 1:
        efsdp = s.shard * s.tp // s.ep
        return (s.ep * efsdp, 1) if (experts // s.ep) % efsdp == 0 else (s.ep, efsdp)
    return (s.shard, 1) if experts % s.shard == 0 else (1, s.shard)


def muon_gathers(s: StepShape, load: RankLoad) -> dict[str, float]:
    """optimizer=muon's all-gathers a step on a rank holding `load`, by part (train.muon.orthogonalised):
    each block matrix's update whole over FSDP's group ("fsdp") and TP's ("tp"); each routed experts'
    stack, this rank's experts of it, over the FSDP ranks splitting its rows and, without EP, over
    TP's (its width). HSDP's replicas and DDP's hold updates whole already; none in one process."""
    if not load.blocks or not muon.routes(s.job.optimizer._target_):
        return {}
    size = 2 if s.job.precision.full_bf16 else 4  # the gradient's dtype
    whole, routed = muon_matrices(s.job.model)
    split, rows = muon_experts(s)
    stack = s.job.model.n_experts / split * size  # bytes of this rank's experts' matrices, per element
    parts: dict[str, float] = {}
    if s.shard > 1:
        ag = s.line("all_gather", s.shard, ("dp_shard", "cp"))
        parts["fsdp"] = sum(c * ag(size * k * n / s.tp) for k, n, c in whole)
    if rows > 1:
        eag = (s.line("all_gather", s.shard, ("dp_shard", "cp")) if s.ep == 1 else
               s.profile.collective("all_gather", rows, bool({"dp_shard", "cp"} & s.spans)))
        width = s.tp if s.ep == 1 else 1
        parts["fsdp"] = parts.get("fsdp", 0.0) + sum(c * eag(stack * k * n / width) for k, n, c in routed)
    if s.tp > 1:
        ag = s.line("all_gather", s.tp, ("tp",))
        parts["tp"] = (sum(c * ag(size * k * n) for k, n, c in whole)
                       + (sum(c * ag(stack * k * n) for k, n, c in routed) if s.ep == 1 else 0.0))
    return {part: load.blocks * t * s.profile.corrections.communication for part, t in parts.items()}
