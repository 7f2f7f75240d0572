"""What differs between training engines, as the cost model prices it: one typed object that
`predict_step` and `predict_memory` take, this toolkit's by default (TITAN_EXP). Describing another
engine (Megatron's, an older TorchTitan's) is how a published measurement of it is predicted."""

from __future__ import annotations

from dataclasses import dataclass

from titan_exp.perf.rates.model_ops import LLAMA, Elementwise


@dataclass(frozen=True)
class Engine:
    """How an engine runs a step where engines differ."""

    elementwise: Elementwise = LLAMA  # its model's memory-bound kernels and host ops, eager and compiled
    tp_overlap: str = "micro_pipeline"  # how async TP hides its collectives (model.overlap.TP_OVERLAP)
    float8_experts: bool = False  # an MoE's routed experts take the float8 recipe (this toolkit's stay bf16)
    output_heads: int = 1  # output head and loss runs per microbatch (multi-token prediction adds one each)
    ep_overlap: bool = False  # EP's all-to-alls beside another microbatch's compute (model.overlap.ep_exposed)
    loss_compiled: bool | None = None  # the loss under compile: None, as this toolkit's trainer runs it


TITAN_EXP = Engine()
