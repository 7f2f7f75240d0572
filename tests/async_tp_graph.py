"""What torch's async TP pass sees in titan_exp's TP block, for the GPU model's pricing of it
(titan_exp/perf/model/overlap.py, async_tp_exposed).

A block of the debug model is parallelized as titan_exp does (parallel/tensor.py: TP 2, sequence
parallel) over torch's fake process group in this one process, compiled, and run forward and
backward. AOTAutograd's forward and backward graphs are kept, and torch's own pattern matcher
(torch/_inductor/fx_passes/micro_pipeline_tp.py, find_reduce_scatter_patterns) finds the
reduce-scatters in them. For each one this prints what it reduces. The pass fuses a
reduce-scatter with a matmul only when its input is that matmul, seen through views. In the
backward, the input is a sum of matmuls (q/k/v's or w1/w3's input gradients), so the pass leaves
it unfused.

    python tests/async_tp_graph.py    # prints one JSON object: {"forward": [...], "backward": [...]}
"""

import json

import torch
import torch.distributed as dist
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_module_simplified
from torch._inductor.fx_passes.micro_pipeline_tp import find_reduce_scatter_patterns
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_exp.config import compose_job
from titan_exp.models.llama import Transformer, rope_tables
from titan_exp.parallel.tensor import apply_tp

VIEWS = {"view", "_unsafe_view", "reshape"}


def reduced(node: torch.fx.Node) -> str:
    """The op a reduce-scatter's input comes from, seen through views."""
    while node.op == "call_function" and node.target.__name__.split(".")[0] in VIEWS:
        node = node.args[0]
    return node.target.__name__.split(".")[0] if node.op == "call_function" else node.op


def main() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    job = compose_job(["model=debugmodel"])
    model = Transformer(job.model)
    apply_tp(model, mesh, loss_parallel=False)
    graphs: dict[str, torch.fx.GraphModule] = {}

    def keep(name):
        def compiler(gm, _inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    def backend(gm, inputs):
        return aot_module_simplified(gm, inputs, fw_compiler=keep("forward"), bw_compiler=keep("backward"))

    block = torch.compile(model.layers["0"], backend=backend, fullgraph=True)
    cos, sin = rope_tables(job.model.head_size, 64, job.model.rope_theta)
    x = torch.randn(2, 32, job.model.dim, requires_grad=True)  # this rank's half of a 64-token sequence
    block(x, cos, sin).sum().backward()
    print(json.dumps({name: [reduced(rs.input_node) for rs in find_reduce_scatter_patterns(gm.graph)]
                      for name, gm in graphs.items()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
