"""Every gradient of a model under tensor parallel, against one process's: two gloo ranks apply
titan_exp's TP plan (parallel/tensor.py: sequence parallel; under multi-head latent attention the
latents' projections whole on every rank; an MoE layer's experts split by width) to a 2-block
model, run one forward and backward on the same tokens, and compare each parameter's full
gradient with the unsplit model's. A training run's losses and gradient norm barely see a wrong
gradient of a small parameter (AdamW normalizes its steps; the norm sums every parameter); this
sees it.

    python tests/tp_grads.py model=deepseek_v3_debug   # one JSON object: {parameter: max |difference| / max |gradient|}
"""

import json
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def grads(model, tokens) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    logits = model(tokens)
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}


def rank(r: int, store_path: str, overrides: list[str]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from titan_exp.config import compose_job
    from titan_exp.models.llama import Transformer
    from titan_exp.parallel.tensor import apply_tp

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=r, world_size=2)
    job = compose_job([*overrides, "model.n_layers=2"])
    tokens = torch.randint(0, job.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    whole = Transformer(job.model)
    whole.init_weights(seed=1)
    want = grads(whole, tokens)
    split = Transformer(job.model)
    apply_tp(split, init_device_mesh("cpu", (2,)), loss_parallel=False)
    split.init_weights(seed=1)
    got = grads(split, tokens)
    if r == 0:
        print(json.dumps({n: float((got[n] - g).abs().max() / g.abs().max()) for n, g in want.items()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.NamedTemporaryFile() as store:
        mp.spawn(rank, args=(store.name, sys.argv[1:]), nprocs=2)
