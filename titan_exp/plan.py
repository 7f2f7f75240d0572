"""The layout planner: every valid layout of a model on N devices, with predicted memory per
device and a relative throughput estimate, ranked; optionally written out as a sweep preset.

    python -m titan_exp.plan model=llama3_8b --world 64 --device-memory-gib 80 --top 8
    python -m titan_exp.plan model=llama3_100m --world 4 --write-sweep plan_100m_4

Positional arguments are the same Hydra overrides `launch.py` takes (model, batch, AC, ...).
"Valid" is decided by titan_exp.validation, the same check the launcher runs, so a planned
layout never fails at launch.

Memory model (bytes per device, on the most loaded rank):
  * states: parameters, gradients and AdamW's two moments (fp32, 16 bytes per parameter; the
    param/grad share is smaller under bf16 params) of the rank's pipeline stages, divided by the
    shard degree (dp_shard x cp, times tp);
  * FSDP working set: the all-gathered parameters and unreduced gradients of about two blocks
    (all of the stage's parameters when they stay gathered: reshard_after_forward=never, or
    default under PP); DDP's gradient buckets, a second copy of the gradients;
  * activations: what each block keeps for backward (ACT_PER_TOKEN_D x dim + ACT_PER_TOKEN_H x
    the SwiGLU width, per token) for the blocks and microbatches alive at once: every block (AC
    none), block inputs plus one block (full), or between (selective); pipeline schedules keep
    several microbatches in flight; TP with sequence parallel divides it by tp;
  * logits and their gradient on the last stage (divided by tp under loss parallel);
  * a fixed runtime overhead per process (RUNTIME_GIB: the interpreter, torch, gloo, the data
    pipeline), which on a CPU is most of a small model's footprint. On CUDA it is 0, because
    peak memory there is torch's allocator peak.
The constants were fitted once on this project's CPU machine (BENCHMARKS.md records predicted
vs measured peak memory per layout).

Throughput model (relative, one unit = the ideal): compute time per device (6 x params x
tokens, plus a recompute share under AC) over (compute + the pipeline bubble + exposed
communication: FSDP gathers and reductions, TP/SP and CP collectives, DDP all-reduce) at
`--bandwidth-gbs`. It ranks layouts; it does not predict tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from titan_exp.config import CONF, DEGREE_FIELDS, MESH_DIMS, SWEEPS, ACMode, JobConfig, layout_label
from titan_exp.parallel.pipeline import SINGLE_STAGE, layer_split, stage_ids, stages_per_rank
from titan_exp.validation import resolve, validate

# Fitted on the project's CPU machine (torch 2.13, gloo); see the module doc.
RUNTIME_GIB_CPU = 0.50
ACT_PER_TOKEN_D = 12  # floats per token per block, in units of dim
ACT_PER_TOKEN_H = 4  # ... in units of the SwiGLU hidden width
SELECTIVE_SHARE = 0.55  # the share of a block's activations per-op selective AC keeps
RECOMPUTE = {ACMode.none: 0.0, ACMode.full: 1 / 3, ACMode.selective: 0.1}  # extra compute, share of fwd+bwd


def degrees_of(job: JobConfig) -> dict[str, int]:
    return job.parallelism.degrees


def layout_overrides(job: JobConfig) -> list[str]:
    """The overrides that give another job this job's layout and local batch."""
    return [f"parallelism.{DEGREE_FIELDS[dim]}={d}" for dim, d in degrees_of(job).items()] + [
        f"training.local_batch_size={job.training.local_batch_size}"]


@dataclass
class Plan:
    degrees: dict[str, int]
    local_batch_size: int
    overrides: list[str]
    memory_gib: float
    parts_gib: dict[str, float]
    throughput: float  # relative, 1.0 = no bubble, no exposed communication, no recompute
    fits: bool = True

    @property
    def name(self) -> str:
        return layout_label(self.degrees)


def with_layout(job: JobConfig, degrees: dict[str, int], global_batch: int) -> JobConfig:
    """`job` with these degrees, `global_batch` sequences per step, and the largest local batch
    (at most the configured one) that divides it."""
    p = dataclasses.replace(job.parallelism, **{DEGREE_FIELDS[dim]: d for dim, d in degrees.items()})
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    local = min(job.training.local_batch_size, max(1, global_batch // dp))
    while local > 1 and global_batch % (local * dp):
        local -= 1
    world = math.prod(degrees.values())
    return dataclasses.replace(
        job, parallelism=p,
        training=dataclasses.replace(job.training, local_batch_size=local, global_batch_size=global_batch),
        cluster=dataclasses.replace(job.cluster, nnodes=1, nproc_per_node=world),
    )


def factorizations(world: int) -> list[dict[str, int]]:
    """Every assignment of degrees to the five mesh dims whose product is `world`."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    out = []
    for pp, rep, shard, cp in itertools.product(divisors, repeat=4):
        rest = pp * rep * shard * cp
        if world % rest == 0:
            out.append(dict(zip(MESH_DIMS, (pp, rep, shard, cp, world // rest))))
    return out


def valid_layouts(job: JobConfig, world: int, *, cuda: bool = False) -> list[JobConfig]:
    gb = job.training.global_batch_size
    global_batch = gb if gb > 0 else job.training.local_batch_size * world
    jobs = (with_layout(job, degrees, global_batch) for degrees in factorizations(world))
    return [resolve(j) for j in jobs if not validate(j, cuda=cuda)]


def predict_memory(job: JobConfig, *, cuda: bool = False) -> dict[str, float]:
    """Predicted peak memory (GiB) of the most loaded rank, by part."""
    if job.parallelism.data_parallel_shard_degree == -1:
        job = resolve(job)
    p, t, m = job.parallelism, job.training, job.model
    pp, dps, cp, tp = (p.pipeline_parallel_degree, p.data_parallel_shard_degree, p.context_parallel_degree,
                       p.tensor_parallel_degree)
    block, embedding, output = m.block_params, m.embedding_params, m.output_params
    # Blocks per rank: the most loaded pipeline rank, and which ends of the model it holds.
    per_rank = stages_per_rank(p, m.n_layers) if pp > 1 else 1
    n_stages = pp * per_rank
    split = layer_split(m.n_layers, n_stages)
    worst = {"blocks": 0, "params": 0, "first": False, "last": False}
    for r in range(pp):
        ids = stage_ids(p.pipeline_parallel_schedule, r, pp, per_rank) if pp > 1 else [0]
        blocks = sum(len(split[s]) for s in ids)
        first, last = 0 in ids, n_stages - 1 in ids
        params = blocks * block + first * embedding + last * output
        if params > worst["params"]:
            worst = {"blocks": blocks, "params": params, "first": first, "last": last}
    shard = dps * cp * tp
    bytes_param = 2 if job.precision.full_bf16 else 4
    states = worst["params"] / shard * (2 * bytes_param + 8)
    fsdp = dps * cp > 1
    keeps_gathered = p.fsdp_reshard_after_forward == "never" or (p.fsdp_reshard_after_forward == "default" and pp > 1)
    if fsdp and keeps_gathered:  # the stage's parameters stay gathered from forward to backward
        working = (worst["params"] + block) / tp * 4
    elif fsdp:
        working = 3 * block / tp * 4
    elif p.data_parallel_replicate_degree > 1:  # DDP's gradient buckets: a second copy of the grads
        working = worst["params"] / tp * 4
    else:
        working = 0.0
    # Activations of one microbatch per block, and how many (block, microbatch) pairs live at once.
    microbatch = p.pipeline_parallel_microbatch_size if pp > 1 else t.local_batch_size
    tokens = microbatch * t.seq_len / cp
    per_block = tokens * (ACT_PER_TOKEN_D * m.dim + ACT_PER_TOKEN_H * m.ffn_hidden_dim) * 4 / tp
    inputs = tokens * m.dim * 4 / tp
    mode = job.activation_checkpoint.mode
    blocks = worst["blocks"]
    if mode == ACMode.none:
        activations = blocks * per_block
    elif mode == ACMode.full:
        activations = blocks * inputs + per_block
    elif job.activation_checkpoint.selective_ac_option == "op":
        activations = blocks * per_block * SELECTIVE_SHARE
    else:
        every = int(job.activation_checkpoint.selective_ac_option)
        kept = blocks // every
        activations = (blocks - kept) * per_block + kept * inputs + per_block
    if pp > 1:
        n_mb = t.local_batch_size // microbatch
        in_flight = n_mb if p.pipeline_parallel_schedule == "GPipe" else min(n_mb, pp * per_rank)
        activations *= in_flight / per_rank if per_rank > 1 else in_flight
    logits = tokens * m.vocab_size * 4 * 3 / tp if worst["last"] else 0.0
    gib = 2**30
    parts = {
        "states": states / gib,
        "fsdp_working_set": working / gib,
        "activations": activations / gib,
        "logits": logits / gib,
        "runtime": 0.0 if cuda else RUNTIME_GIB_CPU,
    }
    parts["total"] = sum(parts.values())
    return parts


def predict_throughput(job: JobConfig, *, bandwidth_gbs: float, peak_tflops: float, latency_us: float) -> float:
    """Compute time over compute + bubble + exposed communication, per step and device. Each
    collective costs `latency_us` plus its bytes over `bandwidth_gbs`."""
    p, t, m = job.parallelism, job.training, job.model
    pp, rep, dps, cp, tp = (p.pipeline_parallel_degree, p.data_parallel_replicate_degree,
                            p.data_parallel_shard_degree, p.context_parallel_degree, p.tensor_parallel_degree)
    world = pp * rep * dps * cp * tp
    params = m.num_params
    tokens = t.global_batch_size * t.seq_len
    compute = 6 * params * tokens / world / (peak_tflops * 1e12)
    compute *= 1 + RECOMPUTE[job.activation_checkpoint.mode]
    bubble = 0.0
    if pp > 1:
        per_rank = stages_per_rank(p, m.n_layers)
        n_mb = t.local_batch_size // p.pipeline_parallel_microbatch_size
        bubble = (pp - 1) / (n_mb * (per_rank if p.pipeline_parallel_schedule not in SINGLE_STAGE else 1) + pp - 1)
    bw, latency = bandwidth_gbs * 1e9, latency_us * 1e-6
    blocks = m.n_layers / pp
    n_mb = t.local_batch_size // (p.pipeline_parallel_microbatch_size if pp > 1 else t.local_batch_size)
    stage_params = params / pp
    comm = 0.0
    if dps * cp > 1:  # all-gather forward and backward, reduce-scatter gradients, per block
        s = dps * cp
        comm += 3 * stage_params / tp * 4 * (s - 1) / s / bw + 3 * blocks * latency
    if rep > 1:  # all-reduce of the gradient shards between replicas
        comm += 2 * stage_params / (tp * dps * cp) * 4 * (rep - 1) / rep / bw + blocks * latency
    local_tokens = tokens / (rep * dps * pp) / cp
    if tp > 1:  # SP: all-gather + reduce-scatter of activations, twice per block, forward and backward
        comm += blocks * 8 * (local_tokens * m.dim * 4 * (tp - 1) / tp / bw / n_mb + latency) * n_mb
    if cp > 1:  # all-gather of K and V per block, forward and backward
        comm += blocks * 4 * (local_tokens * m.dim * 4 * (cp - 1) / bw / n_mb + latency) * n_mb
    return (compute / (1 + RECOMPUTE[job.activation_checkpoint.mode])) / (compute / (1 - bubble) + comm)


def plan(job: JobConfig, world: int, *, device_memory_gib: float, cuda: bool = False,
         bandwidth_gbs: float = 2.0, peak_tflops: float = 0.3, latency_us: float = 300.0) -> list[Plan]:
    """Every valid layout, fastest first among those that fit, then those that do not."""
    plans = []
    for candidate in valid_layouts(job, world, cuda=cuda):
        parts = predict_memory(candidate, cuda=cuda)
        plans.append(Plan(degrees_of(candidate), candidate.training.local_batch_size, layout_overrides(candidate),
                          parts["total"],
                          {k: v for k, v in parts.items() if k != "total"},
                          predict_throughput(candidate, bandwidth_gbs=bandwidth_gbs, peak_tflops=peak_tflops,
                                             latency_us=latency_us),
                          fits=parts["total"] <= device_memory_gib))
    return sorted(plans, key=lambda pl: (not pl.fits, -pl.throughput))


def to_markdown(plans: list[Plan], world: int, device_memory_gib: float) -> str:
    lines = [f"{len(plans)} valid layouts on {world} devices ({device_memory_gib:g} GiB each), fastest first:", "",
             "| rank | layout | local batch | predicted GiB/device | states | activations | rel. throughput | fits |",
             "|---|---|---|---|---|---|---|---|"]
    for i, pl in enumerate(plans, 1):
        lines.append(f"| {i} | {pl.name} | {pl.local_batch_size} | {pl.memory_gib:.2f} | {pl.parts_gib['states']:.2f} "
                     f"| {pl.parts_gib['activations']:.2f} | {pl.throughput:.3f} | {'yes' if pl.fits else 'NO'} |")
    return "\n".join(lines) + "\n"


def write_sweep(plans: list[Plan], name: str, top: int, base_overrides: list[str], folder: Path = SWEEPS) -> Path:
    """The top-k layouts that fit, as a sweep preset: `python launch.py -m +sweep=NAME`. Each
    layout is one value of a `+layout` choice, so the sweep runs exactly those layouts."""
    chosen = [pl for pl in plans if pl.fits][:top]
    layouts = {f"{name}_{i}": pl.overrides for i, pl in enumerate(chosen)}
    preset = {
        "hydra": {"sweeper": {"params": {"+plan_layout": ",".join(layouts)}}},
    }
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{name}.yaml"
    header = (f"# Written by python -m titan_exp.plan {' '.join(base_overrides)}\n"
              f"# The {len(chosen)} fastest predicted layouts that fit; run: python launch.py -m +sweep={name} "
              f"{' '.join(base_overrides)}\n")
    out.write_text(header + yaml.safe_dump(preset, sort_keys=False))
    layout_dir = folder / "plan_layout"
    layout_dir.mkdir(exist_ok=True)
    for (key, overrides), pl in zip(layouts.items(), chosen):
        node: dict = {}
        for o in overrides:
            path, value = o.split("=")
            group, field = path.split(".")
            node.setdefault(group, {})[field] = int(value)
        node.setdefault("cluster", {})["nproc_per_node"] = math.prod(pl.degrees.values())
        (layout_dir / f"{key}.yaml").write_text(yaml.safe_dump(node, sort_keys=False))
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    from titan_exp.config import register_configs, to_job_config

    parser = argparse.ArgumentParser(prog="python -m titan_exp.plan", description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for launch.py (model=..., training....)")
    parser.add_argument("--world", type=int, required=True, help="devices (ranks) to plan for")
    parser.add_argument("--device-memory-gib", type=float, default=None,
                        help="memory per device; default: this GPU's, or this machine's RAM / world")
    parser.add_argument("--bandwidth-gbs", type=float, default=None, help="collective bandwidth (GB/s)")
    parser.add_argument("--cuda", action="store_true", default=torch.cuda.is_available(),
                        help="plan for GPUs (default: whether this machine has one)")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--write-sweep", metavar="NAME", help="write the top layouts as sweeps/NAME.yaml")
    args = parser.parse_args(argv)
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        job = to_job_config(compose(config_name="config", overrides=args.overrides))
    memory = args.device_memory_gib
    if memory is None:
        if args.cuda and torch.cuda.is_available():
            memory = torch.cuda.get_device_properties(0).total_memory / 2**30
        else:
            import os

            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / args.world
    # Defaults: NVLink-class GPUs, or gloo over loopback on a CPU (about what this machine measures).
    bandwidth = args.bandwidth_gbs or (200.0 if args.cuda else 2.0)
    peak, latency = (400.0, 20.0) if args.cuda else (0.3, 300.0)
    plans = plan(job, args.world, device_memory_gib=memory, cuda=args.cuda, bandwidth_gbs=bandwidth,
                 peak_tflops=peak, latency_us=latency)
    print(to_markdown(plans[: args.top] if args.top else plans, args.world, memory))
    if args.write_sweep:
        out = write_sweep(plans, args.write_sweep, args.top, args.overrides)
        print(f"wrote {out}: python launch.py -m +sweep={args.write_sweep} {' '.join(args.overrides)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
