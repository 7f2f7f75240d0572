"""What a CPU rank's memory costs beyond its tensors: glibc's allocator. Only plans for CPU ranks
read this module (the memory model's CPU allocator slack, the step model's fresh pages).

glibc serves an allocation at or over its mmap threshold (cluster.cpu_malloc_mmap_threshold_mib,
or its own, rising to 32 MiB) with pages fresh from the OS, unmapped again when freed: a rank
pays their page faults every step (fresh_bytes). Smaller ones come from the heap, which keeps
what the step frees in holes that later allocations split (heap_slack, sp_heap_slack): the
resident set a CPU's peak memory is measured by counts them. The counts were fitted on a 2-core
x86_64 machine's runs (benchmarks/data/perf_model_cpu.csv, tp_heap_dry_runs.csv).
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_exp.config import JobConfig
from titan_exp.perf.model.shapes import Sizes, block_tensors, fsdp_rounds

SP_HEAP_PER_BLOCK = 4  # sequence-sharded reduce-scatter outputs per block the CPU heap holds (sp_heap_slack)


def mmap_threshold(job: JobConfig) -> float:
    """Bytes from which glibc serves a CPU rank's allocation with fresh pages from the OS (and
    unmaps them when freed): cluster.cpu_malloc_mmap_threshold_mib, or with none set glibc's own,
    which rises to at most 32 MiB. Smaller ones come from the heap."""
    mib = job.cluster.cpu_malloc_mmap_threshold_mib
    return (32 if mib is None else mib) * 2**20


@dataclass(frozen=True)
class FsdpBuffers:
    """What FSDP allocates anew for a unit's all-gather and reduce-scatter, as (bytes, how many);
    all are freed again within the step."""

    weights: Sizes  # each gathered weight (all-gather), and as many unsharded gradients (reduce-scatter)
    gather_flat: Sizes  # the all-gather's flat output
    reduce_flat: Sizes  # the reduce-scatter's flat fp32 input and the shard it returns

    @property
    def gather(self) -> Sizes:
        """Per all-gather: its flat output and the weights viewed out of it."""
        return [*self.gather_flat, *self.weights]

    @property
    def reduce(self) -> Sizes:
        """Per reduce-scatter: the unsharded gradients, the flat input and the shard."""
        return [*self.weights, *self.reduce_flat]


def fsdp_buffers(job: JobConfig, tensors: Sizes) -> FsdpBuffers:
    """FSDP's buffers for a unit of these weights (block_tensors' form)."""
    shard = job.parallelism.data_parallel_shard_degree * job.parallelism.context_parallel_degree
    param_bytes = 2 if job.precision.param_dtype == "bfloat16" else 4
    flat = sum(n * k for n, k in tensors)
    return FsdpBuffers([(n * param_bytes, k) for n, k in tensors], [(flat * param_bytes, 1.0)],
                       [(flat * 4, 1.0), (flat * 4 / shard, 1.0)])


def heap_slack(job: JobConfig, blocks: int) -> float:
    """Bytes glibc's heap holds beyond the live tensors on a CPU rank whose `blocks` FSDP blocks
    are gathered one at a time: the buffers under the mmap threshold (fsdp_buffers), which
    the heap serves. A block's flat buffers, freed, leave holes that the activations allocated
    meanwhile split, so the next block's do not fit there: every block's stay. Its gathered
    weights and gradients, smaller, are mostly reused: one block's worth stays. The two counts
    (every block, one block) are a least-squares fit rounded to whole blocks: on the FSDP rows of
    benchmarks/data/perf_model_cpu.csv (48 rows, seven shapes) it gives 0.96 and 1.10."""
    threshold = mmap_threshold(job)
    bufs = fsdp_buffers(job, block_tensors(job))

    def under(sizes: Sizes) -> float:
        return sum(b * k for b, k in sizes if b < threshold)

    return blocks * under(bufs.gather_flat + bufs.reduce_flat) + 2 * under(bufs.weights)  # weights and gradients


def sp_heap_slack(job: JobConfig, blocks: int, tokens: float, act_bytes: int) -> float:
    """Bytes glibc's heap holds beyond the live tensors on a CPU rank under TP (which always runs
    with sequence parallel): each block's four sequence-sharded outputs of its reduce-scatters
    (attention's and the feed-forward's, forward and backward; tokens / tp x dim each), when
    under the mmap threshold. Each is freed right after the residual add that consumes it, between
    tensors the block keeps, so its hole stays. The count is a least-squares fit, rounded: on the
    TP-only layouts of six shapes at tp 2 and 4 (dry runs at 16 MiB,
    benchmarks/data/tp_heap_dry_runs.csv) it gives 4.25."""
    tp = job.parallelism.tensor_parallel_degree
    sharded = tokens / tp * job.model.dim * act_bytes
    return SP_HEAP_PER_BLOCK * blocks * sharded if tp > 1 and sharded < mmap_threshold(job) else 0.0


def fresh_bytes(job: JobConfig, blocks: int, first: bool, last: bool, accumulation: int) -> float:
    """Bytes a CPU rank's step takes fresh from the OS: each tensor at or over glibc's mmap
    threshold (mmap_threshold) that is allocated anew every step. Every layout: each
    weight's gradient (zero_grad sets them to None). FSDP, per unit and round, what
    fsdp_buffers lists (per all-gather, and per reduce-scatter). Those under the
    threshold come from the heap instead: the memory model's CPU allocator slack (heap_slack)."""
    p, m = job.parallelism, job.model
    threshold = mmap_threshold(job)
    tp = p.tensor_parallel_degree
    param_bytes = 2 if job.precision.param_dtype == "bfloat16" else 4

    def over(buffers: Sizes) -> float:
        return sum(k * b for b, k in buffers if b >= threshold)

    # The rank's units: its blocks (the mean block's tensors), the embedding, the output.
    units = [(block_tensors(job), blocks)] + [([(m.embedding_params / tp, 1.0)], 1)] * first + (
        [([(m.vocab_size * m.dim / tp, 1.0)], 1)] if last and not (m.tie_word_embeddings and first) else [])
    shard = p.data_parallel_shard_degree * p.context_parallel_degree
    rounds, gathers = fsdp_rounds(job, accumulation)
    total = 0.0
    for tensors, count in units:
        if shard == 1:  # the gradients, each weight's its own tensor
            total += count * over([(n * param_bytes, k) for n, k in tensors])
            continue
        bufs = fsdp_buffers(job, tensors)
        total += count * rounds * (gathers * over(bufs.gather) + over(bufs.reduce))
    return total
