"""Parallel degrees and the DeviceMesh they span (TorchTitan's ParallelDims, trimmed).

`ParallelDims` is the one owner of the meshes: `build_mesh` makes the world mesh once, and every
technique asks it for the mesh of its purpose (`dims.mesh("tp")`, `dims.mesh("fsdp")`, ...)
instead of slicing the world mesh itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_exp.config import DEGREE_FIELDS, MESH_DIMS, JobConfig, ParallelismConfig, layout_label, problem

# Flattened views: 'dp' loads data, 'dp_shard_cp' shards parameters (FSDP), 'dp_cp' averages the loss.
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
# What each technique asks for -> the (possibly flattened) mesh dimension that serves it.
PURPOSES = {
    "pp": "pp",  # pipeline stages
    "tp": "tp",  # tensor + sequence parallel
    "cp": "cp",  # context parallel
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
    world_mesh: object = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_config(cls, p: ParallelismConfig, world_size: int) -> "ParallelDims":
        """Resolve dp_shard=-1 to 'the rest of the world'; callers validate the product first."""
        shard = p.data_parallel_shard_degree
        if shard == -1:
            shard = max(1, world_size // p.known_degree)
        return cls(**{**p.degrees, "dp_shard": shard})

    @property
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def label(self) -> str:
        return layout_label(self.degrees)

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        # CP ranks shard parameters too (TorchTitan's dp_shard_cp), so FSDP is on if either is > 1.
        return self.dp_shard * self.cp > 1

    def build_mesh(self, device_type: str):
        """The world mesh over every dimension of degree > 1, plus the flattened views in FLATTENED."""
        from torch.distributed.device_mesh import init_device_mesh

        names = [n for n in MESH_DIMS if self.degrees[n] > 1] or ["dp_shard"]
        shape = tuple(self.degrees[n] for n in names)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=tuple(names))
        for flat, parts in FLATTENED.items():
            present = tuple(n for n in parts if n in names and self.degrees[n] > 1)
            if len(present) > 1:
                mesh[present]._flatten(flat)
        self.world_mesh = mesh
        return mesh

    def _dim(self, name: str):
        present = [n for n in FLATTENED.get(name, (name,)) if self.degrees[n] > 1]
        if not present:
            return None
        return self.world_mesh[present[0]] if len(present) == 1 else self.world_mesh[name]

    def mesh(self, purpose: str):
        """The mesh that serves `purpose` (a PURPOSES key, or "fsdp"), or None when its degree is 1.
        "fsdp" is the shard dimension (dp_shard, cp or both flattened), 2-D with dp_replicate
        outside it under HSDP."""
        assert self.world_mesh is not None, "build_mesh first"
        if purpose != "fsdp":
            return self._dim(PURPOSES[purpose])
        if not self.fsdp_enabled:
            return None
        shard = "dp_shard_cp" if self.cp > 1 and self.dp_shard > 1 else ("cp" if self.dp_shard == 1 else "dp_shard")
        return self.world_mesh[("dp_replicate", shard)] if self.dp_replicate > 1 else self.world_mesh[shard]

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
    when they do not fit) and the errors, which name the degree fields the user set."""
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
