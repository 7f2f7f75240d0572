"""What of a GPU step's communication its compute hides, from the schedule: an FSDP
all-gather behind the block before it and a reduce-scatter behind the block's backward
(fsdp_exposed); async TP's collectives behind the GEMMs they are fused with, where torch's pass
fuses one, or as Transformer Engine's userbuffers overlap them (async_tp_exposed); a pipeline's
sends behind the compute of the stages' chunks (p2p_exposed); expert parallelism's all-to-alls
behind another microbatch's compute, where an engine pairs them (ep_exposed). perf.model.step applies
them to the blocks perf.model.block prices."""

from __future__ import annotations


def fsdp_exposed(gather_s: float, reduce_s: float, gathers: int, fwd_s: float, bwd_s: float, blocks: int,
                 ends_s: float) -> float:
    """FSDP's exposed seconds per round: the first unit's gather and the embedding's and output's
    collectives (`ends_s`) wait in full; each later block's all-gather runs during the block
    before it (prefetch), each backward's re-gather and reduce-scatter during the block's
    backward; what does not fit waits."""
    if blocks == 0:
        return ends_s
    forward = gather_s + (blocks - 1) * max(0.0, gather_s - fwd_s)
    backward = blocks * max(0.0, (gather_s if gathers == 2 else 0.0) + reduce_s - bwd_s)
    return ends_s + forward + backward


def p2p_exposed(send_s: float, pp: int, sends: int, chunk_fwd_s: float) -> float:
    """Pipeline parallelism's exposed seconds per round of `sends` activations and gradients (each
    `send_s`) between pp stages. Sends and receives run asynchronously beside the compute
    (torch.distributed.pipelining's schedules batch them with batch_isend_irecv and wait on a
    receive only before the action that reads it; Megatron's overlap_p2p_comm likewise): in the
    steady state a send waits only where it outlasts the forward of a stage's chunk; the fill and
    the drain wait for each of their pp - 1 crossings, forward and backward."""
    return 2 * (pp - 1) * send_s + sends * max(0.0, send_s - chunk_fwd_s)


TP_OVERLAP = ("micro_pipeline", "userbuffers")


def async_tp_exposed(gather_fwd_s: float, gather_s: float, scatter_s: float, groups: tuple[float, ...],
                     partials_s: float, overlap: str = "micro_pipeline") -> tuple[float, float]:
    """The TP collectives' exposed seconds for one block's forward and its backward, the GEMMs
    (`groups`: q/k/v, o, w1/w3, w2) overlapping them.

    "micro_pipeline" is torch's async TP, this toolkit's (torch/_inductor/fx_passes/
    micro_pipeline_tp.py and torch/distributed/_symmetric_memory, torch 2.5-2.13). Forward: each
    all-gather runs with the GEMMs that consume it (q/k/v, w1/w3), each reduce-scatter with the
    GEMM that produces it (o, w2), and what outlasts them waits; a fused reduce-scatter collects
    every rank's unreduced partials and sums them after its pipeline, one memory-bound kernel
    nothing hides (`partials_s`). Backward: the output gradient's all-gathers fuse with o's and
    w2's input-gradient GEMMs (forward's shapes); the reduce-scatters of q/k/v's and w1/w3's input
    gradient take a sum of GEMMs, which the pass does not fuse (_find_producer_matmul matches one
    matmul), so they wait in full. tests/async_tp_graph.py finds both in this toolkit's TP block
    as torch traces it.

    "userbuffers" is Transformer Engine's TP overlap (tp_comm_overlap): every collective beside
    the GEMMs next to it, forward and backward (the input gradients' reduce-scatters beside the
    weight-gradient GEMMs), its partials reduced within the pipeline."""
    if overlap not in TP_OVERLAP:
        raise ValueError(f"overlap {overlap!r}: choose from {', '.join(TP_OVERLAP)}")
    def beside(comm_s):  # each collective with the GEMM group in its place; what outlasts it waits
        return sum(max(0.0, c - g) for c, g in zip(comm_s, groups))

    forward = beside([gather_fwd_s, scatter_s] * 2)
    if overlap == "userbuffers":
        return forward, beside([gather_s, scatter_s] * 2)
    return forward + 2 * partials_s, beside([0.0, gather_s] * 2) + 2 * scatter_s


def ep_exposed(forward_s: float, backward_s: float, fwd_compute_s: float, bwd_compute_s: float,
               microbatches: int) -> float:
    """Expert parallelism's exposed seconds per microbatch of one MoE block, its forward's
    all-to-alls (`forward_s`: dispatch, combine, the token counts) and its backward's
    (`backward_s`), where the engine overlaps them with another microbatch's compute, as
    Megatron-Core's overlap_moe_expert_parallel_comm does (its combined 1F1B schedule: microbatch
    i + 1's forward beside microbatch i's backward, layer by layer, each one's all-to-alls on a
    communication stream beside the other's compute; Megatron-Bridge's docs/training/
    communication-overlap.md). In the steady state a forward's all-to-alls wait only where they
    outlast the paired backward's compute, and a backward's where they outlast the forward's; a
    step's first forward and last backward have no partner and wait in full. (A pipeline's warm-up
    forwards and cool-down backwards go unpaired too; left out here: under interleaved 1F1B with
    hundreds of microbatch chunks a step, as the published rows run, they are a few per cent of
    them.) This toolkit's trainer pairs none: its EP waits in full (perf.model.step)."""
    if microbatches < 1:
        raise ValueError(f"microbatches = {microbatches}: at least 1")
    steady = max(0.0, forward_s - bwd_compute_s) + max(0.0, backward_s - fwd_compute_s)
    return ((microbatches - 1) * steady + forward_s + backward_s) / microbatches
