"""Parallel degrees and the DeviceMesh they span (TorchTitan's ParallelDims, trimmed).

`ParallelDims` is the one owner of the meshes: `build_mesh` makes the world mesh once, and every
technique asks it for the mesh of its purpose (`dims.mesh("tp")`, `dims.mesh("fsdp")`, ...)
instead of slicing the world mesh itself.

Expert parallel is not a dimension of its own: as in TorchTitan (expert_tensor_parallel_degree
1), its ranks are carved out of dp_shard x cp x tp. With ep > 1, dp_shard is split into
dp_shard_mod_ep (outer) x dp_shard_in_ep, and the experts are split over
ep = dp_shard_in_ep x cp x tp and sharded by FSDP over the rest (dp_shard_mod_ep, with
dp_replicate outside it): "efsdp".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_exp.config import DEGREE_FIELDS, MESH_DIMS, JobConfig, ParallelismConfig, layout_label, problem

# Views over several mesh dims: 'dp' loads data, 'dp_shard_cp' shards parameters (FSDP), 'dp_cp'
# averages the loss, 'ep' splits the experts; 'dp_shard' is itself a view once ep splits it.
# 'dp_shard_cp_tp' spans every rank a parameter's gradient is split over (FSDP's and TP's, and the
# experts' efsdp x ep): DTensor reduces the gradient norm over it in one all-reduce, where without
# it it takes one per dimension (and torch says so, a warning per rank).
FLATTENED = {
    "dp_shard": ("dp_shard_mod_ep", "dp_shard_in_ep"),
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "ep": ("dp_shard_in_ep", "cp", "tp"),
    "dp_shard_cp_tp": ("dp_shard", "cp", "tp"),
}
# What each technique asks for -> the (possibly flattened) mesh dimension that serves it.
PURPOSES = {
    "pp": "pp",  # pipeline stages
    "tp": "tp",  # tensor + sequence parallel
    "cp": "cp",  # context parallel
    "ep": "ep",  # expert parallel
    "batch": "dp",  # ranks that read different rows of the global batch
    "loss": "dp_cp",  # ranks whose losses are averaged
    "replicate": "dp_replicate",  # DDP
}


@dataclass
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int = 1
    world_mesh: object = field(default=None, init=False, repr=False, compare=False)
    # The FLATTENED views build_mesh made, by name: kept here, since slicing one out of the world
    # mesh again is deprecated (torch warns, once per slice and rank).
    flattened: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_config(cls, p: ParallelismConfig, world_size: int) -> "ParallelDims":
        """Resolve dp_shard=-1 to 'the rest of the world'; callers validate the product first."""
        return cls(**{**p.degrees, "dp_shard": p.dp_shard_at(world_size)}, ep=p.expert_parallel_degree)

    @property
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def label(self) -> str:
        return layout_label(self.degrees | ({"ep": self.ep} if self.ep > 1 else {}))

    @property
    def leaves(self) -> dict[str, int]:
        """The world mesh's dimensions, outermost first, and their degrees: MESH_DIMS, with
        dp_shard split in two under expert parallel (dp_shard_mod_ep is kept even at degree 1:
        it is the experts' FSDP mesh)."""
        if self.ep == 1:
            return self.degrees
        in_ep = self.ep // (self.cp * self.tp)
        split = {"dp_shard_mod_ep": self.dp_shard // in_ep, "dp_shard_in_ep": in_ep}
        out = {}
        for name, d in self.degrees.items():
            out |= split if name == "dp_shard" else {name: d}
        return out

    def _parts(self, name: str) -> list[str]:
        """The mesh dims of degree > 1 a (possibly flattened) name spans."""
        return [leaf for leaf in self._leaves(name) if self.leaves[leaf] > 1]

    def _leaves(self, name: str) -> list[str]:
        """The leaf dims a (possibly flattened) name spans, whatever their degree."""
        return ([name] if name in self.leaves
                else [leaf for part in FLATTENED.get(name, ()) for leaf in self._leaves(part)])

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        # CP ranks shard parameters too (TorchTitan's dp_shard_cp), so FSDP is on if either is > 1.
        return self.dp_shard * self.cp > 1

    def build_mesh(self, device_type: str):
        """The world mesh over every dimension of degree > 1 (and dp_shard_mod_ep under EP), plus
        the flattened views in FLATTENED that span more than one of its dims."""
        from torch.distributed.device_mesh import init_device_mesh

        leaves = self.leaves
        names = [n for n, d in leaves.items() if d > 1 or n == "dp_shard_mod_ep"] or ["dp_shard"]
        mesh = init_device_mesh(device_type, tuple(leaves[n] for n in names), mesh_dim_names=tuple(names))
        for flat in FLATTENED:
            # The world mesh's dims the view spans: dp_shard_mod_ep's too at degree 1, so that the
            # experts' gradient norm over it and dp_shard_in_ep finds its flattened view.
            spans = [leaf for leaf in self._leaves(flat) if leaf in names]
            if len(spans) > 1:
                self.flattened[flat] = mesh[tuple(spans)]._flatten(flat)
        self.world_mesh = mesh
        return mesh

    def _dim(self, name: str):
        parts = self._parts(name)
        if not parts:
            return None
        return self.world_mesh[parts[0]] if len(parts) == 1 else self.flattened[name]

    def mesh(self, purpose: str):
        """The mesh that serves `purpose` (a PURPOSES key, "fsdp" or "efsdp"), or None when its
        degree is 1. "fsdp" is the shard dimension (dp_shard, cp or both flattened), 2-D with
        dp_replicate outside it under HSDP; "efsdp" is the routed experts' FSDP mesh under EP."""
        assert self.world_mesh is not None, "build_mesh first"
        if purpose == "efsdp":
            shard = "dp_shard_mod_ep"
        elif purpose == "fsdp":
            if not self.fsdp_enabled:
                return None
            shard = "dp_shard_cp" if len(self._parts("dp_shard_cp")) > 1 else self._parts("dp_shard_cp")[0]
        else:
            return self._dim(PURPOSES[purpose])
        if self.dp_replicate > 1:
            return self.world_mesh[("dp_replicate", shard)]
        return self.flattened[shard] if shard in self.flattened else self.world_mesh[shard]

    def local_rank(self, purpose: str) -> int:
        """This rank's index in the mesh of `purpose` (0 when that degree is 1)."""
        mesh = self.mesh(purpose)
        return mesh.get_local_rank() if mesh is not None else 0

    def group(self, purpose: str):
        """The process group of `purpose`'s mesh, or None when its degree is 1."""
        mesh = self.mesh(purpose)
        return mesh.get_group() if mesh is not None else None

    def first_replica_ranks(self) -> list[int] | None:
        """Global ranks of the first data-parallel replica (dp_replicate index 0), which together
        hold every shard of every parameter; None when there is one replica."""
        if self.dp_replicate == 1:
            return None
        dim = self.world_mesh.mesh_dim_names.index("dp_replicate")
        return self.world_mesh.mesh.select(dim, 0).flatten().tolist()


def _set_degrees(p: ParallelismConfig) -> str:
    """The degree fields that were set (not 1), as `field = value, ...`: a message's head."""
    chosen = [DEGREE_FIELDS[dim] for dim, d in p.degrees.items() if d not in (1, -1)] or ["data_parallel_shard_degree"]
    return ", ".join(f"parallelism.{name} = {getattr(p, name)!r}" for name in chosen)


def check(job: JobConfig) -> tuple[ParallelDims | None, list[str]]:
    """The layout: the degrees must multiply to the world size. Returns the resolved dims (None
    when they do not fit) and the errors, which name the degree fields the user set. (A run
    resumed from its checkpoint on another world size meets them too; the launcher's preflight
    then adds that cluster.elastic re-plans it: titan_exp.cluster.elastic.hinted.)"""
    p, c = job.parallelism, job.cluster
    world = job.world_size
    other = p.known_degree
    shard = p.data_parallel_shard_degree
    where = (f"cluster.nnodes={c.nnodes} x cluster.nproc_per_node={c.nproc_per_node}" if c.nproc_per_node is not None
             else "cluster.nproc_per_node is unset")
    fields = _set_degrees(p)
    if shard == -1 and world % other:
        return None, [f"{fields}: pp x dp_replicate x cp x tp = {other} does not divide the world size {world} "
                      f"({where}); change the degrees or cluster.nproc_per_node"]
    if shard != -1 and shard < 1:
        return None, [problem("parallelism.data_parallel_shard_degree", shard,
                              "must be >= 1, or -1 for the rest of the world")]
    if shard != -1 and other * shard != world:
        return None, [f"{fields}: the product of the degrees is {other * shard} but the world size is {world} "
                      f"({where}); make them equal or set data_parallel_shard_degree=-1"]
    dims = ParallelDims.from_config(p, world)
    return dims, []
