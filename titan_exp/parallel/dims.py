"""Parallel degrees and the named DeviceMesh they span (TorchTitan's ParallelDims, trimmed)."""

from __future__ import annotations

from dataclasses import dataclass

from titan_exp.config import ParallelismConfig

# Outermost to innermost: TP is innermost so its collectives stay on the fastest links.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Flattened views: 'dp' loads data, 'dp_shard_cp' shards parameters (FSDP), 'dp_cp' averages the loss.
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int

    @classmethod
    def from_config(cls, p: ParallelismConfig, world_size: int) -> "ParallelDims":
        """Resolve dp_shard=-1 to 'the rest of the world'; callers validate the product first."""
        known = p.pipeline_parallel_degree * p.data_parallel_replicate_degree
        known *= p.context_parallel_degree * p.tensor_parallel_degree
        shard = p.data_parallel_shard_degree
        if shard == -1:
            shard = max(1, world_size // known)
        return cls(
            pp=p.pipeline_parallel_degree,
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=shard,
            cp=p.context_parallel_degree,
            tp=p.tensor_parallel_degree,
        )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        # CP ranks shard parameters too (TorchTitan's dp_shard_cp), so FSDP is on if either is > 1.
        return self.dp_shard * self.cp > 1

    @property
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}

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
        return mesh

    def first_replica_ranks(self, mesh) -> list[int] | None:
        """Global ranks of the first data-parallel replica (dp_replicate index 0), which together
        hold every shard of every parameter; None when there is one replica."""
        if self.dp_replicate == 1:
            return None
        dim = mesh.mesh_dim_names.index("dp_replicate")
        return mesh.mesh.select(dim, 0).flatten().tolist()

    def submesh(self, mesh, name: str):
        """A named (possibly flattened) dimension of `mesh`, or None when its degree is 1."""
        present = [n for n in FLATTENED.get(name, (name,)) if self.degrees[n] > 1]
        if not present:
            return None
        return mesh[present[0]] if len(present) == 1 else mesh[name]
