"""Where a layout's process groups sit among the nodes: how many of a group's ranks
share a node, and which mesh dims' groups span nodes, as the step's collectives are priced by
(MachineProfile.collective: a group spanning nodes sends through the NIC of each of its ranks
there)."""

from __future__ import annotations

import math

from titan_exp.config import MESH_DIMS, JobConfig


def node_ranks(job: JobConfig, dims: tuple[str, ...]) -> int:
    """How many ranks of one process group over the mesh dims `dims` (adjacent in the mesh, as
    the flattened dp_shard x cp group is) sit in the same node. Ranks are numbered node by node
    and the mesh is laid out pp, dp_replicate, dp_shard, cp, tp with tp innermost (TorchTitan's
    order, which keeps TP inside a node whenever it fits there), so a group's ranks are `stride`
    apart, stride being the product of the degrees inside it."""
    degrees = job.parallelism.degrees
    inner = max(MESH_DIMS.index(d) for d in dims)
    stride = math.prod(degrees[d] for d in MESH_DIMS[inner + 1:])
    return max(1, min(math.prod(degrees[d] for d in dims), _per_node(degrees, job.cluster.nnodes) // stride))


def ranks_in_a_node(job: JobConfig) -> int:
    """The job's ranks on one node (all of them where the nodes do not divide the world)."""
    return _per_node(job.parallelism.degrees, job.cluster.nnodes)


def _per_node(degrees: dict[str, int], nnodes: int) -> int:
    world, nodes = math.prod(degrees.values()), max(1, nnodes)
    return world // nodes if world % nodes == 0 else world


def ep_node_ranks(job: JobConfig) -> int:
    """How many ranks of an expert-parallel group sit in one node: its ranks are the innermost of
    the dp_shard x cp x tp group (parallel/dims.py: dp_shard_in_ep x cp x tp), so it leaves a node
    only when ep ranks do not fit in one, however far data-parallel sharding reaches."""
    return min(job.parallelism.expert_parallel_degree, node_ranks(job, ("dp_shard", "cp", "tp")))


def ep_spans_nodes(job: JobConfig) -> bool:
    """Whether an expert-parallel group spans nodes (ep_node_ranks)."""
    return ep_node_ranks(job) < job.parallelism.expert_parallel_degree


def across_nodes(job: JobConfig) -> set[str]:
    """The mesh dims whose process groups span nodes (fewer of a group's ranks share a node,
    node_ranks, than the group has), and "ep" where expert parallel's do (ep_spans_nodes)."""
    degrees = job.parallelism.degrees
    return ({d for d in MESH_DIMS if degrees[d] > 1 and node_ranks(job, (d,)) < degrees[d]}
            | ({"ep"} if ep_spans_nodes(job) else set()))
