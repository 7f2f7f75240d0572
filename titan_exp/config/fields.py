"""How a config field is declared: the Choice enums its values come from, `doc` (a default, a
one-line description that `python launch.py --help` prints, for counts a lower bound and, for a
float that takes +inf, what it means),
`target` (a node's `_target_`), `problem` (a validation message naming the field, the value and
the fix) and the names of the device mesh's dimensions. The config groups themselves are in
model.py (ModelConfig) and schema.py (the rest, and JobConfig)."""

from __future__ import annotations

import enum
import math
from dataclasses import field
from typing import Any, Mapping


class Choice(str, enum.Enum):
    """A config choice: a string enum whose members are spelled as the user types them, so the
    value compares, hashes, formats and serialises as that string."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


def choices(name: str, values: str) -> Any:
    """A Choice enum whose member names are its values (they may be keywords or start with a
    digit, like `async` or `1F1B`, which a class body cannot spell)."""
    return Choice(name, [(v, v) for v in values.split()], module=__name__, qualname=name)


ModelFamily = choices("ModelFamily", "llama3 qwen3")
OptimizerImpl = choices("OptimizerImpl", "auto fused foreach for-loop")
# Muon's learning-rate adjustment by matrix shape: torch.optim.Muon's adjust_lr_fn values.
MuonAdjustLR = choices("MuonAdjustLR", "original match_rms_adamw")
PipelineSchedule = choices(
    "PipelineSchedule", "GPipe 1F1B Interleaved1F1B LoopedBFS InterleavedZeroBubble ZBVZeroBubble DualPipeV")
DType = choices("DType", "float32 bfloat16")
Converter = choices("Converter", "none float8 mxfp8")
Float8Recipe = choices("Float8Recipe", "tensorwise rowwise rowwise_with_gw_hp")
# torchao's MXFP8TrainingRecipe values, listed here so composing a config need not import torchao
# (~4 s); a test keeps the two in step.
MXRecipe = choices("MXRecipe", "mxfp8_rceil mxfp8_rceil_wgrad_with_hp mxfp8_emulated_rceil")
CompileBackend = choices("CompileBackend", "inductor aot_eager eager")
AuxLoss = choices("AuxLoss", "sequence switch")
ACMode = choices("ACMode", "none full selective")
AsyncMode = choices("AsyncMode", "disabled async async_with_pinned_mem")
CheckpointPart = choices("CheckpointPart", "model optimizer lr_scheduler dataloader train_state rng")
ExportDType = choices("ExportDType", "float32 bfloat16 float16")
ExportFormat = choices("ExportFormat", "safetensors pt")
SaveReplicas = choices("SaveReplicas", "all first")
Executor = choices("Executor", "local slurm debug")
OnNonfinite = choices("OnNonfinite", "stop skip")
DecayType = choices("DecayType", "linear sqrt cosine")
WandbMode = choices("WandbMode", "online offline disabled")
ScoreFunc = choices("ScoreFunc", "softmax sigmoid")
AutotuneAxis = choices("AutotuneAxis", "layout activation_checkpoint compile precision float8_filter local_batch_size "
                                       "microbatch_size")

# The mesh dimensions, outermost to innermost (TP innermost keeps its collectives on the fastest
# links), and the ParallelismConfig field that sets each one's degree.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DEGREE_FIELDS = {"pp": "pipeline_parallel_degree", "dp_replicate": "data_parallel_replicate_degree",
                 "dp_shard": "data_parallel_shard_degree", "cp": "context_parallel_degree",
                 "tp": "tensor_parallel_degree"}
# ... and of a layout, which adds expert parallel (carved out of dp_shard x cp x tp: not a mesh dim).
LAYOUT_FIELDS = DEGREE_FIELDS | {"ep": "expert_parallel_degree"}


def world_of(layout: Mapping[str, int]) -> int:
    """The ranks a layout takes: the product of its mesh degrees (ep is not one)."""
    return math.prod(d for dim, d in layout.items() if dim in DEGREE_FIELDS)


def doc(default: Any, text: str, *, min: int | None = None, inf: str | None = None) -> Any:  # noqa: A002
    """A dataclass field with a default, a one-line description and, for counts, a lower bound
    (`min`). A float field holds finite numbers only (titan_exp.config.values refuses NaN and
    +/-inf in every one); `inf` names what +inf means in a field that takes it (e.g. no limit),
    which its doc then says."""
    text = f"{text}; inf = {inf}" if inf is not None else text
    meta = {"doc": text, **({"min": min} if min is not None else {}), **({"inf": inf} if inf is not None else {})}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def target(default: str, called_with: str) -> Any:
    """A node's `_target_` (what titan_exp.targets builds from it) and its `kwargs`, as two fields."""
    return doc(default, f"class or function built by hydra.utils.instantiate; called with {called_with}")


def target_kwargs() -> Any:
    return doc({}, "extra keyword arguments for _target_, e.g. +optimizer.kwargs.momentum=0.9")


def problem(field_name: str, value: Any, text: str) -> str:
    """One validation message: `field = value: what is wrong; how to fix it`."""
    if isinstance(value, Choice):
        value = value.value
    return f"{field_name} = {value!r}: {text}"


def layout_label(degrees: Mapping[str, int] | None) -> str:
    """'pp2 x dp_shard2 x tp2', 'single' for one rank ('' when unknown): in logs, reports and plans."""
    if not degrees:
        return ""
    return " x ".join(f"{name}{d}" for name, d in degrees.items() if d > 1) or "single"


def refusal(error: str) -> str:
    """A validation message as the launcher reports it: one line, saying that nothing started."""
    return "refused, nothing was started: " + " ".join(error.split())
