"""torch-only repro: a TP embedding whose output redistribute is asynchronous (torch's
RowwiseParallel) feeding compiled TP+SP blocks fails in backward on torch 2.13:

    AttributeError: 'Tensor' object has no attribute '_local_tensor'   (in Redistribute.backward)

The embedding's `to_local()` returns an AsyncCollectiveTensor, which enters the compiled block as a
graph input; in backward its gradient reaches the redistribute's backward as a plain tensor, and
`to_local`'s own backward (which would wrap it back into a DTensor) receives None. A synchronous
redistribute hands the block a plain tensor and trains. aot_eager is enough to show it (no inductor).

    python tests/repro_compile_tp.py async|sync    # prints "rank R: forward and backward ran" per rank

Success is what the ranks print, not the exit code: gloo processes sometimes abort at exit ("terminate
called without an active exception") after their work is done.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class SyncRowwise(RowwiseParallel):
    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


class FFN(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.ffn = nn.RMSNorm(d), FFN(d)

    def forward(self, x):
        return x + self.ffn(self.norm(x))


def worker(rank: int, world: int, mode: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    emb, blocks = nn.Embedding(64, 32), nn.ModuleList([Block(32), Block(32)])
    style = (SyncRowwise if mode == "sync" else RowwiseParallel)(input_layouts=Replicate(), output_layouts=Shard(1))
    parallelize_module(emb, mesh, style)
    for block in blocks:
        parallelize_module(block, mesh, {
            "norm": SequenceParallel(),
            "ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "ffn.w1": ColwiseParallel(),
            "ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
        block.compile(backend="aot_eager", fullgraph=True)
    h = emb(torch.randint(0, 64, (2, 8)))
    for block in blocks:
        h = block(h)
    h.sum().backward()  # raises the AttributeError above with mode=async
    sys.stdout.write(f"rank {rank}: forward and backward ran\n")  # one write: the ranks share the pipe
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, sys.argv[1], port), nprocs=2)
