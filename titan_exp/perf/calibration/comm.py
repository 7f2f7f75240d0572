"""What calibration measures of communication (titan_exp.perf.calibration.measure): every collective over
every group size, inside a node and across nodes, send/recv, and how much hides behind compute."""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan_exp.perf.calibration.timing import Options, timed, together
from titan_exp.perf.rates.profile import Line


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
    nodes pays, which the model uses for those dims (perf.model.placement.across_nodes)."""
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
            peer = rank + per_node if node % 2 == 0 else rank - per_node
            inter["send_recv"] = {2: _send_recv_line(peer, opts, device)}
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
