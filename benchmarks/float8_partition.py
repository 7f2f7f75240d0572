"""What a compiled float8 block keeps for its backward and what the backward casts again, on CPU:

    python -m benchmarks.float8_partition [--recipe tensorwise|rowwise] [--dim 256] [--tokens 256]

One of this toolkit's Llama blocks (titan_exp.models.llama.TransformerBlock) in bf16, its linears
converted by titan_exp.precision.apply_converter (torchao; emulated here), split into forward and
backward by the partitioner Inductor uses (min-cut rematerialization, compiler "inductor"), which
decides the same on every device. Printed: the tensors the forward saves, and each float8 cast in
the backward by the saved tensors it is computed from. Where those are the block's input and the
norm's rsqrt, the backward recomputes a norm's output and casts it again for a weight gradient (a
GPU writes that cast transposed, fused with the norm's backward: BENCHMARKS.md, GPU: Llama 3 1B and
3B on one NVIDIA H200). On a GPU the graph also holds the transposes torch._scaled_mm needs, which
emulation does not.
"""

from __future__ import annotations

import argparse
import functools

import torch

from titan_exp.config import compose_job
from titan_exp.models.layers import rope_tables
from titan_exp.models.llama import TransformerBlock
from titan_exp.precision import apply_converter

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def backward_graph(recipe: str, dim: int, tokens: int) -> torch.fx.Graph:
    """The backward Inductor's partitioner splits off one float8 block, `tokens` tokens of width `dim`."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    job = compose_job(["precision=float8" if recipe == "tensorwise" else "precision=float8_rowwise",
                      f"model.dim={dim}", "model.n_heads=4", "model.n_kv_heads=2", "precision.filter_fqns=[]"])
    block = TransformerBlock(job.model).to(torch.bfloat16)
    apply_converter(block, job.precision)
    graphs: list[torch.fx.GraphModule] = []

    def keep_backward(gm: torch.fx.GraphModule, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=lambda gm, _inputs: make_boxed_func(gm), bw_compiler=keep_backward,
                           partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))
    cos, sin = rope_tables(job.model.rope_dim, tokens, job.model.rope_theta)
    x = torch.randn(1, tokens, dim, dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    torch.compile(block, backend=backend, fullgraph=True)(x, cos, sin).sum().backward()
    return graphs[0].graph


def sources(node: torch.fx.Node) -> set[str]:
    """The backward's inputs (saved tensors, gradients) that `node` is computed from."""
    seen, todo, found = set(), [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            found.add(n.name)
        todo += n.all_input_nodes
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args(argv)
    backward = backward_graph(args.recipe, args.dim, args.tokens)
    inputs = {n.name: n.meta["val"] for n in backward.nodes if n.op == "placeholder"}
    # The forward's own inputs (primals: parameters, the block's input, RoPE's tables) and the
    # output's gradient (tangents) are not what the partitioner chose to keep.
    kept = {name: v for name, v in inputs.items() if not name.startswith(("primals", "tangents"))}
    print(f"float8 {args.recipe}, one block (dim {args.dim}, {args.tokens} tokens, bf16), Inductor's partitioner")
    print("the forward saves, beyond its inputs: " + ", ".join(f"{name} {list(v.shape)} {v.dtype}"
                                                              for name, v in kept.items()))
    casts = [n for n in backward.nodes if n.op == "call_function" and n.target == torch.ops.aten._to_copy.default
             and n.kwargs.get("dtype") in FLOAT8]
    gradients = 0
    for n in casts:
        read = sources(n)
        if any(name.startswith("tangents") for name in read):
            gradients += 1
            continue
        what = ("an activation recomputed from saved ones" if any(kept[r].dim() for r in read if r in kept)
                else "a weight, at its saved amax")
        print(f"the backward casts {list(n.meta['val'].shape)} to {n.kwargs['dtype']}: {what} "
              f"({', '.join(f'{r} {list(inputs[r].shape)}' for r in sorted(read))})")
    print(f"the backward casts {gradients} gradients")


if __name__ == "__main__":
    main()
