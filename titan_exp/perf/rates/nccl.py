"""A collective's latency as NCCL's own tuner models it, for GPUs priced from a spec sheet [tune].

NCCL times every (algorithm, protocol) it could run a collective with as latency + bytes /
bandwidth and runs the fastest. Latency, in its model:
  ring  base + (steps - inter) x intra + inter x net, where steps is n - 1 for an all-gather or
        a reduce-scatter of n ranks, 2 (n - 1) for an all-reduce, and inter those of them that
        cross between N nodes (N - 1; 2N for an all-reduce);
  tree  (all-reduce across nodes) base + 2 ((n/N - 1) x intra + floor(log2 N) x net);
with a base and a per-step latency for each protocol, NVLink's or the network's (a ring over
several nodes pays at least NCCL's per-step network overhead on its NVLink steps). Simple moves
bytes at the links' bus bandwidth; LL (small messages) at a quarter of it, 8-byte flags with
every 4 bytes of data, at most llMaxBw; LL128 at 0.92 of it (0.7 with one rank a node). A tree
moves twice the buffer at 0.92 of the bus bandwidth (LL: a 3.8th of it; LL128: 120/128).

Sends are peer-to-peer: one step, Simple's or, small, LL's (NCCL's sends take LL below
NCCL_P2P_LL_THRESHOLD). An all-to-all, which NCCL's tuner does not model (grouped sends and
receives, as torch runs it), is taken as one such step a peer, as a ring's steps (NCCL's
channels serve several peers at once: an upper bound).

Where this model is in a profile (`MachineProfile.nccl`: spec sheets), a collective costs the
lowest of its lines at each size (`lines`); the bandwidth term, Simple's, stays perf.rates.devices'
(the links' rate times NCCL's efficiency on them).

Not modelled: NVLink SHARP (NVLS) and CollNet, which need switches that reduce in the network;
the tuner's per-size corrections for trees; the number of channels (LL128's and trees' caps).

Source (checked 2026-11):
  [tune] NVIDIA/nccl src/graph/tuning.cc at b6475625 (ncclTopoTuneModel, ncclTopoGetAlgoTime):
         baseLat, hwLat (NVLink and network rows), llMaxBws (Hopper; Blackwell, which that
         version's table lacks, taken as Hopper), the per-step network overhead (1 us on an x86
         host, x 3 for Simple) and the bus bandwidths' protocol factors.
"""

from __future__ import annotations

from dataclasses import dataclass

LL, LL128, SIMPLE = 0, 1, 2  # NCCL's protocols, the index of each in the tables below
BASE_S = {"ring": (6.6e-6, 14.0e-6, 8.4e-6), "tree": (6.8e-6, 14.0e-6, 0.0)}  # baseLat
NVLINK_STEP_S = {"ring": (0.6e-6, 1.9e-6, 3.4e-6), "tree": (0.6e-6, 1.25e-6, 28e-6)}  # hwLat[NVLINK]
NET_STEP_S = {"ring": (2.7e-6, 4.0e-6, 14.0e-6), "tree": (5.0e-6, 8.5e-6, 28e-6)}  # hwLat[NET]
NET_OVERHEAD_S = 1e-6  # per step of a ring over several nodes (x 3 for Simple)
LL_MAX_BUS = (87.7e9, 39.0e9, 20.4e9)  # LL's bus bandwidth cap: one node, two nodes, more
LL_SHARE, LL_SHARE_IN_NODE = 1 / 4, 1 / 3  # LL's bus bandwidth, of Simple's (in a node: all-gather, reduce-scatter)
LL128_SHARE, LL128_SHARE_ONE_A_NODE = 0.92, 0.7  # LL128's ring, of Simple's (one rank a node: its NIC both ways)
TREE_SHARE = 0.92  # a tree's bus bandwidth, of Simple's; LL's a 3.8th of it, LL128's 120/128
TREE_LL, TREE_LL128 = 1 / 3.8, 120 / 128


@dataclass(frozen=True)
class NcclModel:
    """NCCL's latencies, with Simple's per-step ones those of the machine (perf.rates.devices'
    Efficiency: NCCL's unless a hardware file gave others); LL's and LL128's stay NCCL's."""

    nvlink_step_s: float = NVLINK_STEP_S["ring"][SIMPLE]
    net_step_s: float = NET_STEP_S["ring"][SIMPLE]

    def _step(self, algo: str, proto: int, net: bool) -> float:
        if (algo, proto) == ("ring", SIMPLE):
            return self.net_step_s if net else self.nvlink_step_s
        return (NET_STEP_S if net else NVLINK_STEP_S)[algo][proto]

    def lines(self, op: str, ranks: int, nodes: int, per_unit_s: float) -> list[tuple[float, float]]:
        """(latency s, seconds per byte) of each way NCCL could run `op` over `ranks` ranks on
        `nodes` nodes, Simple's ring first; `per_unit_s` is Simple's seconds per byte of the
        collective's buffer (its bus bandwidth and the ring's share of the buffer)."""
        if op in ("send_recv", "all_to_all"):  # peer to peer: a step a peer, Simple's, or LL's when small
            if op == "send_recv":
                near, far = (0, 1) if nodes > 1 else (1, 0)
            else:
                near, far = ranks // nodes - 1, ranks - ranks // nodes
            return [(BASE_S["ring"][proto] + near * self._step("ring", proto, False)
                     + far * self._step("ring", proto, True), per_unit_s / (LL_SHARE if proto == LL else 1))
                    for proto in (SIMPLE, LL)]
        reduce_all = op == "all_reduce"
        steps = 2 * (ranks - 1) if reduce_all else ranks - 1
        inter = (2 * nodes if nodes > 1 else 0) if reduce_all else nodes - 1
        share = steps / ranks  # of the buffer each rank's link carries, per byte of it
        ll_cap = LL_MAX_BUS[min(nodes, 3) - 1]
        out = []
        for proto in (SIMPLE, LL, LL128):  # Simple first: the line a caller reads terms of
            intra = self._step("ring", proto, False)
            if nodes > 1:
                intra = max(intra, NET_OVERHEAD_S * (3 if proto == SIMPLE else 1))
            latency = BASE_S["ring"][proto] + (steps - inter) * intra + inter * self._step("ring", proto, True)
            if proto == LL:
                ll = LL_SHARE if nodes > 1 or reduce_all else LL_SHARE_IN_NODE
                out.append((latency, max(per_unit_s / ll, share / ll_cap)))
            elif proto == LL128:
                out.append((latency, per_unit_s / (LL128_SHARE if ranks >= 2 * nodes else LL128_SHARE_ONE_A_NODE)))
            else:
                out.append((latency, per_unit_s))
        if reduce_all and nodes > 1:  # a tree: log latency; twice the buffer at the tree's bandwidth
            per_rank, tree_s = ranks // nodes, 2 * per_unit_s / share / TREE_SHARE
            for proto, per_byte in ((SIMPLE, tree_s), (LL, max(tree_s / TREE_LL, 2 / ll_cap)),
                                    (LL128, tree_s / TREE_LL128)):
                latency = BASE_S["tree"][proto] + 2 * ((per_rank - 1) * self._step("tree", proto, False)
                                                       + (nodes.bit_length() - 1) * self._step("tree", proto, True))
                out.append((latency, per_byte))
        return out
