"""The machine profile: what `python -m titan_exp.perf.calibrate` measured on the target devices, as
the performance model (perf.model.step) reads it. Compute costs are measured with every rank computing
at once (as in a data-parallel step); `concurrency` says how that compares with fewer.

One JSON file per (host kind, device, backend, world size, torch version, threads per rank), in
`<cache>/perf/`. Every cost is a `Line`, latency + size x per-unit cost, fitted to a few
measured sizes, so the model can ask for sizes that were not measured:

    gemm[dtype]                 seconds of one matmul  by FLOPs    (the model's own GEMM shapes)
    blocks[shape][tp].fwd       seconds of one transformer block's forward, by sequences
    blocks[shape][tp].fwd_bwd   ... forward + backward, its compute (in the real model)
    blocks[shape][tp].head      the rest of the model per microbatch: embedding, final norm,
                                output projection, loss, forward + backward
    blocks[shape][tp].tp_comm   what a real TP + SP block adds to the plain sharded one (tp > 1)
    blocks[shape][1].cp_extra   what a real context-parallel block adds, by cp degree
    blocks[shape][1].fsdp_extra what a real FSDP block (resharded after forward, fp32) adds, by
                                shard degree: collectives, copies, fresh buffers, waits
    blocks[shape][tp].update    a real TP model's optimizer phase by blocks (tp > 1): DTensor's
                                dispatch per parameter, the gradient norm's all-reduces, AdamW
    collectives[op][group size] seconds by bytes, every group of that size running at once
                                (groups of consecutive ranks: inside a node when they fit)
    inter_node[op][group size]  the same over groups of one rank per node (a profile of more
                                than one node): what a mesh dim that spans nodes pays
    concurrency                 how many ranks compute at full speed at the same time (2 on a
                                2-core CPU at 1 thread per rank; the world size on GPUs)
    overlap                     the share of a collective that hides behind concurrent compute
    optimizer_s_per_param       AdamW step, per local parameter (plain tensors, the model's size)
    fresh_memory_s_per_byte     CPU: what touching memory just mapped from the OS costs (page
                                faults), per byte: glibc maps every allocation over its mmap
                                threshold afresh, so a step pays it for each large buffer
    step_overhead_s             the fixed cost of a step (Python, data, logging): not measured by
                                calibration; refit from real runs (autotune)
    kernels                     what each kind of kernel achieves (best-shaped GEMMs by dtype, flash
                                attention by sequence, memory-bound kernels, host time per op and
                                per compiled kernel): the rates perf.model.block prices a block from its
                                parts at, where no block of the model was measured

`corrections` are scale factors fitted to measured runs (`refit`): the next plan on the same
machine applies them. A profile made without measuring anything (`defaults`) says so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from titan_exp.cache import cache_dir
from titan_exp.config import JobConfig
from titan_exp.files import atomic_write
from titan_exp.perf.rates.nccl import NcclModel

FORMAT = 1
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")


@dataclass
class Line:
    """seconds = latency_s + size x per_unit_s."""

    latency_s: float
    per_unit_s: float

    def __call__(self, size: float) -> float:
        return self.latency_s + size * self.per_unit_s

    @classmethod
    def fit(cls, sizes: Sequence[float], seconds: Sequence[float]) -> "Line":
        """Least squares, with neither term negative (a negative latency is noise at small sizes:
        then the line goes through the origin)."""
        n = len(sizes)
        if n == 1 or len(set(sizes)) == 1:
            return cls(0.0, statistics.fmean(seconds) / max(sizes[0], 1e-30))
        mx, my = statistics.fmean(sizes), statistics.fmean(seconds)
        sxx = sum((x - mx) ** 2 for x in sizes)
        slope = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds)) / sxx
        latency = my - slope * mx
        if slope <= 0:
            return cls(max(my, 0.0), 0.0)
        if latency < 0:
            return cls(0.0, sum(x * y for x, y in zip(sizes, seconds)) / sum(x * x for x in sizes))
        return cls(latency, slope)

    def to_list(self) -> list[float]:
        return [self.latency_s, self.per_unit_s]

    @classmethod
    def of(cls, value: Sequence[float]) -> "Line":
        return cls(float(value[0]), float(value[1]))


@dataclass
class Envelope(Line):
    """The lowest of several lines at each size (the protocols NCCL chooses among: perf.rates.nccl); its
    own terms, which a reader of latency_s or per_unit_s gets, are the first line's."""

    others: tuple[Line, ...] = ()

    def __call__(self, size: float) -> float:
        least = self.latency_s + size * self.per_unit_s  # a loop, not min() over a list: the planner's hot path
        for line in self.others:
            least = min(least, line.latency_s + size * line.per_unit_s)
        return least


@dataclass
class BlockCost:
    """One transformer block and the model's head at one TP degree, by sequences of seq_len."""

    fwd: Line
    fwd_bwd: Line
    head: Line  # the rest of the model: embedding, final norm, output projection and loss
    # tp > 1: a real TP + SP block (DTensor, its all-gathers and reduce-scatters) minus its
    # compute, forward + backward: what tensor parallel adds per block, measured.
    tp_comm: Optional[Line] = None
    # tp = 1, by cp degree: a real context-parallel block (its K/V all-gather, its chunks' attention
    # over the keys before them) minus the plain block on 1/cp of the sequence: what CP adds per block.
    cp_extra: dict[int, Line] = field(default_factory=dict)
    # tp = 1, by shard degree: a real FSDP block (two all-gathers, a reduce-scatter, their copies
    # and fresh buffers, the waits for other ranks) minus the plain block: what FSDP adds per block.
    fsdp_extra: dict[int, Line] = field(default_factory=dict)
    # tp > 1: a real TP model's optimizer phase (gradient norm, clipping, AdamW's step), seconds
    # by blocks: its latency is the rest of the model's, its per-unit cost a block's.
    update: Optional[Line] = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"fwd": self.fwd.to_list(), "fwd_bwd": self.fwd_bwd.to_list(),
                               "head": self.head.to_list()}
        if self.tp_comm:
            out["tp_comm"] = self.tp_comm.to_list()
        if self.cp_extra:
            out["cp_extra"] = {str(cp): line.to_list() for cp, line in self.cp_extra.items()}
        if self.fsdp_extra:
            out["fsdp_extra"] = {str(s): line.to_list() for s, line in self.fsdp_extra.items()}
        if self.update:
            out["update"] = self.update.to_list()
        return out

    @classmethod
    def of(cls, d: dict[str, Any]) -> "BlockCost":
        return cls(Line.of(d["fwd"]), Line.of(d["fwd_bwd"]), Line.of(d["head"]),
                   Line.of(d["tp_comm"]) if "tp_comm" in d else None,
                   {int(cp): Line.of(v) for cp, v in d.get("cp_extra", {}).items()},
                   {int(s): Line.of(v) for s, v in d.get("fsdp_extra", {}).items()},
                   Line.of(d["update"]) if "update" in d else None)


@dataclass(frozen=True)
class Kernels:
    """What each kind of kernel of a training step achieves on one GPU: the rates perf.model.block prices a
    block's parts at. From the spec sheet and published microbenchmarks (perf.rates.kernels.spec_kernels,
    source "spec"), or measured on the device by `python -m titan_exp.perf.calibrate`
    (perf.calibration.kernels, source "calibrated"; `measured` names what was, the rest is perf.model.block's
    stated assumption)."""

    # the best-shaped GEMM's TFLOP/s over full waves, by dtype (float8: calibration.kernels.FLOAT8_GEMMS)
    matmul_tflops: dict[str, float]
    attention_fwd: tuple[tuple[int, float], ...]  # causal flash attention: (sequence, TFLOP/s), forward
    attention_bwd: tuple[tuple[int, float], ...]  # ... backward (its FLOPs counted as 2.5 x the forward's)
    memory_tb_s: float  # what memory-bound kernels (elementwise, norms, casts) move per second
    host_eager_s: float  # host time per eager op (Python, dispatch, autograd's record, the launch)
    host_compiled_s: float  # host time per kernel of a compiled graph
    sms: int  # streaming multiprocessors: a GEMM's waves
    architecture: str = "hopper"
    head_dim: int = 128  # the attention curves' head dim
    attention_kernel: str = "flash"  # whose curves they are: perf.rates.kernels.ATTENTION's name, or what SDPA ran
    source: str = "spec"
    measured: tuple[str, ...] = ()
    # A grouped GEMM's rate (an MoE's routed experts: torch._grouped_mm) over a dense GEMM's of the
    # same rows and tiles; 1.0 unless measured (perf.model.block's [grouped]).
    grouped_gemm_share: float = 1.0
    # Host seconds of torchao's Python around an eager float8 linear's forward (its tensor
    # subclass and autograd functions), beyond its kernels; None: perf.rates.float8_casts.HOST_FLOAT8_S.
    host_float8_s: Optional[float] = None
    # The rate (TB/s of perf.rates.float8_casts' bytes) at which torchao's float8 linear casts its
    # tensors here, by "<recipe>/<casts>" (casts: torchao, eager; compiled): a float8 linear's
    # forward and backward as a step runs it, less its GEMMs at matmul_tflops' rates. Where absent,
    # memory_tb_s (perf.model.block's assumption: the casts stream at the memory rate).
    float8_cast_tb_s: dict[str, float] = field(default_factory=dict)
    # The rate (TB/s of the bytes perf.rates.model_ops counts for this toolkit's block) at which the
    # block's own memory-bound ops (its norms, RoPE, GQA's repeat, SwiGLU's product, residual
    # adds) run here, forward and backward, by "eager" and "compiled". Where absent, memory_tb_s
    # (perf.rates.kernels' [hbm]: the model's kernels stream as a contiguous add does; an assumption).
    elementwise_tb_s: dict[str, float] = field(default_factory=dict)

    def elementwise_rate(self, compiled: bool) -> float:
        """Bytes per second of the model's memory-bound kernels (the bytes perf.rates.model_ops counts),
        eager or compiled: the block's measured rate, else the memory rate."""
        measured = self.elementwise_tb_s.get("compiled" if compiled else "eager")
        return (measured or self.memory_tb_s) * 1e12

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["attention_fwd"] = [list(x) for x in self.attention_fwd]
        d["attention_bwd"] = [list(x) for x in self.attention_bwd]
        d["measured"] = list(self.measured)
        return d

    @classmethod
    def of(cls, d: dict[str, Any]) -> "Kernels":
        curve = lambda rows: tuple((int(s), float(t)) for s, t in rows)  # noqa: E731
        return cls(**{**d, "attention_fwd": curve(d["attention_fwd"]), "attention_bwd": curve(d["attention_bwd"]),
                      "measured": tuple(d.get("measured", ()))})


@dataclass
class Corrections:
    """Scale factors fitted to measured runs: step = compute x compute + communication x comm
    + overhead_s (seconds added to every step)."""

    compute: float = 1.0
    communication: float = 1.0
    overhead_s: float = 0.0
    measurements: int = 0
    median_error_before: Optional[float] = None  # |predicted / measured - 1| of the runs fitted to
    median_error_after: Optional[float] = None


def shape_key(dim: int, n_heads: int, n_kv_heads: int, ffn_hidden: int, vocab: int, seq_len: int) -> str:
    """Block measurements are per model shape and sequence length."""
    return f"dim{dim}-h{n_heads}-kv{n_kv_heads}-ffn{ffn_hidden}-v{vocab}-seq{seq_len}"


def model_shape(job: JobConfig) -> str:
    """The block a calibration measures: for an MoE model, one of its MoE blocks."""
    m = job.model
    key = shape_key(m.dim, m.n_heads, m.kv_heads, m.ffn_hidden_dim, m.vocab_size, job.training.seq_len)
    if m.mla:  # multi-head latent attention's latents and head widths
        key += f"-mla{m.kv_lora_rank}q{m.q_lora_rank}n{m.qk_nope_head_dim}r{m.qk_rope_head_dim}v{m.v_head_dim}"
    if m.is_moe:
        key += f"-moe{m.n_experts}k{m.top_k}h{m.expert_hidden_dim}s{m.n_shared_experts}"
    return key


def machine_key(device: str, backend: str, world: int, threads_per_rank: int, nodes: int = 1) -> dict[str, Any]:
    import torch

    return {"host": f"{platform.machine()}-{os.cpu_count()}cpu", "device": device, "backend": backend,
            "world": world, "threads_per_rank": threads_per_rank, "torch": torch.__version__.split("+")[0],
            **({"nodes": nodes} if nodes > 1 else {})}


@dataclass
class MachineProfile:
    key: dict[str, Any]
    source: str = "calibrated"  # or "defaults": nothing was measured
    created: str = ""
    calibration_s: float = 0.0
    concurrency: float = 1.0
    overlap: float = 0.0
    gemm: dict[str, Line] = field(default_factory=dict)  # dtype -> seconds by FLOPs
    gemm_shapes: dict[str, list[list[float]]] = field(default_factory=dict)  # dtype -> [m, k, n, seconds]
    blocks: dict[str, dict[int, BlockCost]] = field(default_factory=dict)  # shape key -> tp -> costs
    collectives: dict[str, dict[int, Line]] = field(default_factory=dict)  # op -> group size -> by bytes
    inter_node: dict[str, dict[int, Line]] = field(default_factory=dict)  # the same, one rank per node
    optimizer_s_per_param: float = 0.0
    fresh_memory_s_per_byte: float = 0.0  # CPU page faults (0: not measured, or a GPU)
    step_overhead_s: float = 0.0
    compile_speedup: Optional[float] = None  # eager / compiled block time, when calibrated with --compile
    corrections: Corrections = field(default_factory=Corrections)
    notes: list[str] = field(default_factory=list)
    # What a GPU's kernels achieve, which perf.model.block prices unmeasured blocks at: a spec sheet's
    # (perf.rates.devices.spec_profile) or measured on it (perf.calibration.kernels).
    kernels: Optional[Kernels] = None
    # A spec sheet's collectives: NCCL's latencies over the tables' bandwidths (perf.rates.nccl; not
    # kept in the file, whose tables hold Simple's ring lines).
    nccl: Optional[NcclModel] = None
    # collective()'s lines by its arguments and the tables they come from: the planner asks for the same
    # few lines of every layout it prices
    _lines: dict[tuple, Line] = field(default_factory=dict, init=False, repr=False, compare=False)

    # -- the file -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "key": self.key, "source": self.source, "created": self.created,
            "calibration_s": self.calibration_s, "concurrency": self.concurrency, "overlap": self.overlap,
            "gemm": {k: v.to_list() for k, v in self.gemm.items()}, "gemm_shapes": self.gemm_shapes,
            "blocks": {s: {str(tp): c.to_dict() for tp, c in by_tp.items()} for s, by_tp in self.blocks.items()},
            "collectives": {op: {str(g): line.to_list() for g, line in by_g.items()}
                            for op, by_g in self.collectives.items()},
            "inter_node": {op: {str(g): line.to_list() for g, line in by_g.items()}
                           for op, by_g in self.inter_node.items()},
            "optimizer_s_per_param": self.optimizer_s_per_param, "step_overhead_s": self.step_overhead_s,
            "fresh_memory_s_per_byte": self.fresh_memory_s_per_byte,
            "compile_speedup": self.compile_speedup, "corrections": dataclasses.asdict(self.corrections),
            "notes": self.notes,
            **({"kernels": self.kernels.to_dict()} if self.kernels else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MachineProfile":
        if d.get("format") != FORMAT:
            raise ValueError(f"machine profile format {d.get('format')!r}, expected {FORMAT}: "
                             "recalibrate with python -m titan_exp.perf.calibrate --refresh")
        return cls(
            key=d["key"], source=d["source"], created=d["created"], calibration_s=d["calibration_s"],
            concurrency=d["concurrency"], overlap=d["overlap"],
            gemm={k: Line.of(v) for k, v in d["gemm"].items()}, gemm_shapes=d["gemm_shapes"],
            blocks={s: {int(tp): BlockCost.of(c) for tp, c in by_tp.items()} for s, by_tp in d["blocks"].items()},
            collectives={op: {int(g): Line.of(v) for g, v in by_g.items()} for op, by_g in d["collectives"].items()},
            inter_node={op: {int(g): Line.of(v) for g, v in by_g.items()}
                        for op, by_g in d.get("inter_node", {}).items()},
            optimizer_s_per_param=d["optimizer_s_per_param"], step_overhead_s=d["step_overhead_s"],
            fresh_memory_s_per_byte=d.get("fresh_memory_s_per_byte", 0.0),  # absent from older profiles
            compile_speedup=d.get("compile_speedup"), corrections=Corrections(**d["corrections"]),
            notes=d.get("notes", []),
            kernels=Kernels.of(d["kernels"]) if "kernels" in d else None,
        )

    @property
    def name(self) -> str:
        k = self.key
        device = "".join(c if c.isalnum() else "_" for c in k["device"]).strip("_")
        nodes = f"-n{k['nodes']}" if k.get("nodes", 1) > 1 else ""
        return f"{k['host']}-{device}-{k['backend']}-w{k['world']}{nodes}-t{k['threads_per_rank']}-torch{k['torch']}"

    def path(self, folder: Path | None = None) -> Path:
        return (folder or profiles_dir()) / f"{self.name}.json"

    def save(self, folder: Path | None = None) -> Path:
        out = self.path(folder)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, json.dumps(self.to_dict(), indent=1))
        return out

    # -- what the model asks ---------------------------------------------------------------
    def block(self, shape: str, tp: int) -> BlockCost | None:
        return self.blocks.get(shape, {}).get(tp)

    def missing(self, job: JobConfig, tps: Iterable[int], *, compile: bool) -> list[str]:
        """What the performance model would estimate from FLOPs rather than read here, for `job`'s
        block at these TP degrees (and its compiled speed-up, when `compile`): what a calibration
        of this machine measures. On a GPU whose kernels were measured, only the compiled kernels'
        host cost, when `compile`, torchao's eager float8 host cost, for an eager float8 job, its
        float8 casts' rate and its forward GEMMs', for a float8 job, and the rate of the block's
        memory-bound kernels as the job runs them (eager, or compiled when `compile`): its blocks
        are priced from their parts (perf.model.block). A spec sheet's profile lacks nothing one could
        measure here."""
        if self.source == "spec":
            return []
        if self.source == "defaults":
            return [f"this machine at world {self.key['world']} (no profile)"]
        shape = model_shape(job)
        out = []
        if self.kernels is not None and self.kernels.architecture != "cpu":
            # A GPU's block is priced from its parts at these kernels' rates, whatever the model.
            if compile and "host_compiled_s" not in self.kernels.measured:
                out.append("the host's cost of a compiled kernel")
            float8 = job.precision.converter == "float8" and "float8" in self.kernels.matmul_tflops  # FP8 tensor cores
            if float8 and not compile and "host_float8_s" not in self.kernels.measured:
                out.append("the host's cost of an eager float8 linear")
            if float8 and "float8_cast_tb_s" not in self.kernels.measured:
                out.append("the rate of torchao's float8 casts")
            if float8 and "float8_fast" not in self.kernels.matmul_tflops:
                out.append("the rate of torchao's forward float8 GEMMs (fast accumulation)")
            if ("compiled" if compile else "eager") not in self.kernels.elementwise_tb_s:
                out.append(f"the rate of the block's {'compiled ' if compile else ''}memory-bound kernels")
        else:
            absent = sorted(tp for tp in set(tps) if self.block(shape, tp) is None)
            if absent:
                out.append(f"the block {shape} at tp {', '.join(map(str, absent))}")
            if compile and self.compile_speedup is None:
                out.append("the compiled block's speed-up")
        if self.key["world"] > 1 and not self.collectives:
            out.append(f"the collectives at world {self.key['world']}")
        return out

    def collective(self, op: str, group: int, across_nodes: bool = False, ranks_per_node: int = 1) -> Line:
        """`op` on groups of `group` ranks (`ranks_per_node` of them in each node when
        `across_nodes`): the table's line (`table_line`), or where the profile has NCCL's latency
        model (a spec sheet's), the lowest of NCCL's lines for it, over the table's bandwidth."""
        key = (op, group, across_nodes, ranks_per_node, id(self.collectives), id(self.inter_node), id(self.nccl))
        if key not in self._lines:
            self._lines[key] = self._collective(op, group, across_nodes, ranks_per_node)
        return self._lines[key]

    def _collective(self, op: str, group: int, across_nodes: bool, ranks_per_node: int) -> Line:
        line = self.table_line(op, group, across_nodes, ranks_per_node)
        if self.nccl is None:
            return line
        nodes = -(-group // ranks_per_node) if across_nodes and self.inter_node else 1
        (latency, per_unit), *others = self.nccl.lines(op, group, nodes, line.per_unit_s)
        return Envelope(latency, per_unit, tuple(Line(a, b) for a, b in others))

    def table_line(self, op: str, group: int, across_nodes: bool = False, ranks_per_node: int = 1) -> Line:
        """The measured line for `op` on groups of `group` ranks (`across_nodes`: a group that
        spans nodes, where the profile measured them); a group size that was not measured takes
        the nearest measured one, scaled by the ring factor (g-1)/g.

        Across nodes the profile measured groups of one rank per node, each node's traffic through
        one NIC. A group with `ranks_per_node` > 1 ranks in each node sends its node's traffic
        through as many NICs at once (NCCL's rings enter and leave a node through each of its
        GPUs' NICs, one GPU one NIC): its bytes take 1/ranks_per_node of the time, but no less
        than the same group inside a node (NVLink) takes. An all-to-all sends each rank's bytes for
        other nodes through its own NIC: of a group of `group` ranks over n = group / ranks_per_node
        nodes, (n - 1) / n of them, as the measured group of n ranks one to a node sends, while the
        bytes for its node's other ranks go over NVLink at the same time."""
        ring = op in ("all_gather", "reduce_scatter", "all_reduce")
        if across_nodes and self.inter_node and ranks_per_node > 1 and ring:
            line, inside = self.table_line(op, group, True), self.table_line(op, group, False)
            return Line(line.latency_s, max(line.per_unit_s / ranks_per_node, inside.per_unit_s))
        if across_nodes and self.inter_node and 1 < ranks_per_node < group and op == "all_to_all":
            nodes = -(-group // ranks_per_node)
            line, inside = self.table_line(op, nodes, True), self.table_line(op, ranks_per_node, False)
            return Line(max(line.latency_s, inside.latency_s), max(line.per_unit_s, inside.per_unit_s / nodes))
        table = self.inter_node if across_nodes and self.inter_node else self.collectives
        by_g = table.get(op) or table.get("all_reduce") or {}
        if not by_g:
            return DEFAULT_COLLECTIVE
        if group in by_g:
            return by_g[group]
        near = min(by_g, key=lambda g: abs(math.log(g / group)))
        scale = ((group - 1) / group) / ((near - 1) / near)
        return Line(by_g[near].latency_s * math.log2(group) / max(math.log2(near), 1), by_g[near].per_unit_s * scale)


DEFAULT_COLLECTIVE = Line(300e-6, 1 / 2e9)


def profiles_dir() -> Path:
    return cache_dir() / "perf"


def find(device: str, backend: str, world: int, threads_per_rank: int, folder: Path | None = None,
         nodes: int = 1) -> MachineProfile | None:
    """The calibrated profile of this machine kind at this world size (over `nodes` nodes), if
    one was made."""
    probe = MachineProfile(key=machine_key(device, backend, world, threads_per_rank, nodes))
    path = probe.path(folder)
    if not path.exists():
        return None
    try:
        return MachineProfile.from_dict(json.loads(path.read_text()))
    except (ValueError, KeyError, json.JSONDecodeError):
        return None  # an old or broken file: as if never calibrated (calibrate --refresh rewrites it)


def defaults(device: str, backend: str, world: int, threads_per_rank: int) -> MachineProfile:
    """What the model assumes with nothing measured: a round-number GPU (bf16 400 TFLOP/s, 200 GB/s
    collectives) or a CPU core (80 GFLOP/s fp32 per thread, gloo over loopback at 2 GB/s).
    Blocks are then estimated from their FLOPs (perf.model.step)."""
    cuda = device != "cpu"
    cores = os.cpu_count() or 1
    if cuda:
        gemm = {"float32": Line(10e-6, 1 / 60e12), "bfloat16": Line(10e-6, 1 / 400e12),
                "float8": Line(10e-6, 1 / 700e12)}
        coll = Line(20e-6, 1 / 200e9)
    else:
        rate = 80e9 * threads_per_rank
        gemm = {"float32": Line(20e-6, 1 / rate), "bfloat16": Line(20e-6, 1 / (rate * 0.8))}
        coll = DEFAULT_COLLECTIVE
    return MachineProfile(
        key=machine_key(device, backend, world, threads_per_rank), source="defaults",
        created=time.strftime("%Y-%m-%dT%H:%M:%S"),
        concurrency=float(world) if cuda else max(1.0, min(world, cores / threads_per_rank)),
        overlap=0.8 if cuda else 0.0, gemm=gemm,
        collectives={op: {world: coll} for op in COLLECTIVES},
        optimizer_s_per_param=1e-10 if cuda else 5e-9, step_overhead_s=1e-3 if cuda else 5e-3,
    )


def rank_key(cuda: bool, world: int) -> tuple[str, int]:
    """(backend, threads per rank) a profile is filed under: one rank a GPU over NCCL (whatever
    else its process group holds, and however many cores its host has), or gloo ranks sharing a
    CPU's cores (titan_exp.config.cluster.threads_per_rank). Calibration writes and
    this_machine reads by it."""
    if cuda:
        return "nccl", 1
    from titan_exp.config.cluster import threads_per_rank

    return "gloo", threads_per_rank(world)


def this_machine(world: int, *, cuda: bool | None = None, threads_per_rank: int | None = None,
                 folder: Path | None = None, nodes: int = 1) -> MachineProfile:
    """The calibrated profile for `world` ranks on this machine (or `nodes` of its kind), else
    the defaults."""
    import torch

    cuda = torch.cuda.is_available() if cuda is None else cuda
    device = torch.cuda.get_device_name(0) if cuda and torch.cuda.is_available() else ("cuda" if cuda else "cpu")
    backend, threads = rank_key(cuda, world)
    threads_per_rank = threads if threads_per_rank is None else threads_per_rank
    return (find(device, backend, world, threads_per_rank, folder, nodes)
            or defaults(device, backend, world, threads_per_rank))


