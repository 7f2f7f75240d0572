"""Numeric formats: mixed precision and torchao's low-precision linears (float8, MXFP8).

Where the arithmetic happens:
- FSDP/HSDP: FSDP's MixedPrecisionPolicy casts parameters to `param_dtype` for compute and
  reduces gradients in `reduce_dtype` (see parallel/fsdp.py).
- No FSDP: torch.autocast to `param_dtype`, except under MXFP8, whose linears take their own
  inputs and compute in MX formats; autocast would hand them mismatched dtypes.
- full_bf16: the parameters (and so optimizer state) themselves are bf16; nothing casts.
- float8 / mxfp8: nn.Linear modules are swapped on the meta device, before parallelization,
  for torchao's training linears. Without hardware support (float8 needs CUDA compute
  capability >= 8.9, MX >= 10.0) torchao emulates them, which is said once in the log; it never
  quietly trains in bf16 instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

import torch
from torch import nn

from titan_exp.config import (
    AUTO_FILTER,
    Converter,
    DType,
    Float8Recipe,
    JobConfig,
    ModelConfig,
    PrecisionConfig,
    problem,
)

logger = logging.getLogger("titan_exp")

DTYPES = {DType.float32: torch.float32, DType.bfloat16: torch.bfloat16}
# Shapes the low-precision kernels need: float8 matmuls want multiples of 16, MX blocks are 32.
ALIGNMENT = {Converter.float8: 16, Converter.mxfp8: 32}


def check(job: JobConfig, cuda: bool) -> list[str]:
    """bf16 storage needs bf16 compute; low-precision matmuls need aligned shapes per TP rank;
    float8 all-gather needs the tensorwise recipe."""
    e: list[str] = []
    pr, m = job.precision, job.model
    if pr.full_bf16 and pr.param_dtype != DType.bfloat16:
        e.append(problem("precision.full_bf16", True,
                         "stores parameters in bf16, so precision.param_dtype must be bfloat16"))
    if pr.converter != Converter.none:
        align = ALIGNMENT[pr.converter]
        tp = max(1, job.parallelism.tensor_parallel_degree)
        for field, width, split in linear_widths(m):
            per = align * (tp if split else 1)
            if width % per:
                e.append(problem("precision.converter", pr.converter,
                                 f"{field} = {width} is not divisible by "
                                 f"{align}{f' x tp = {per}' if per > align else ''}; "
                                 f"{pr.converter} matmuls need multiples of {align} per rank (or use precision=bf16)"))
                break
    if (pr.converter == Converter.float8 and pr.float8_enable_fsdp_all_gather
            and pr.float8_recipe != Float8Recipe.tensorwise):
        e.append(problem("precision.float8_enable_fsdp_all_gather", True,
                         f"works with the tensorwise recipe only, not {pr.float8_recipe}; "
                         "turn it off or use tensorwise"))
    if AUTO_FILTER in pr.filter_fqns and pr.converter == Converter.mxfp8:
        e.append(problem("precision.filter_fqns", list(pr.filter_fqns),
                         f"'{AUTO_FILTER}' is torchao's float8 shape filter; MXFP8 has none: remove it, or use float8"))
    if AUTO_FILTER in pr.filter_fqns and pr.converter == Converter.float8 and not pr.shape_filterable:
        e.append(problem("precision.filter_fqns", list(pr.filter_fqns),
                         f"torchao's '{AUTO_FILTER}' has no thresholds for the rowwise_with_gw_hp recipe: remove it, "
                         "or use precision.float8_recipe=tensorwise or rowwise"))
    if pr.float8_precompute_dynamic_scale_for_fsdp and not (
            pr.converter == Converter.float8 and pr.float8_enable_fsdp_all_gather):
        e.append(problem("precision.float8_precompute_dynamic_scale_for_fsdp", True,
                         "precomputes scales for float8 all-gather; "
                         "needs converter=float8 and float8_enable_fsdp_all_gather=true"))
    return e


def linear_widths(m: ModelConfig) -> list[tuple[str, int, bool]]:
    """The widths of a block's linears: (what they are, width, whether TP splits it). Under
    multi-head latent attention the latents' are whole on every TP rank (parallel.tensor)."""
    if m.mla:
        h, latent = m.n_heads, m.kv_lora_rank
        attention = [("n_heads x (qk_nope_head_dim + qk_rope_head_dim)", h * m.head_size, True),
                     ("n_heads x (qk_nope_head_dim + v_head_dim)", h * (m.qk_nope_head_dim + m.v_head_size), True),
                     ("n_heads x v_head_dim", h * m.v_head_size, True), ("model.kv_lora_rank", latent, False),
                     ("model.kv_lora_rank + qk_rope_head_dim", latent + m.rope_dim, False),
                     *([("model.q_lora_rank", m.q_lora_rank, False)] if m.q_lora_rank else [])]
    else:
        attention = [("n_heads x head_dim", m.n_heads * m.head_size, True),
                     ("n_kv_heads x head_dim", m.kv_heads * m.head_size, True)]
    return [("model.dim", m.dim, True), ("the ffn hidden size", m.ffn_hidden_dim, True), *attention]


def hardware_support(converter: Converter) -> bool:
    if not torch.cuda.is_available():
        return False
    need = (8, 9) if converter == Converter.float8 else (10, 0)
    return torch.cuda.get_device_capability() >= need


def emulated(p: PrecisionConfig) -> bool:
    return p.emulate if p.emulate is not None else not hardware_support(p.converter)


@contextlib.contextmanager
def torchao_imports():
    """Import torchao's modules inside (or run what imports them: transformers does), without
    the import-time warnings a run's log has no use for: on a machine without CUDA, that its CUDA
    kernels' libraries fail to load and that Triton is missing (torchao 0.18 logs both on every
    rank; a CPU run uses neither), and, anywhere, torch 2.13's deprecation of the way torchao
    registers its enums with torch's pytree (torchao's to change). Those records are dropped; on
    a GPU torchao's own warnings stay, as they matter there."""
    quiet = ["torch.utils._pytree"] + ([] if torch.cuda.is_available() else ["torchao"])
    levels = {name: logging.getLogger(name).level for name in quiet}
    for name in quiet:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


@functools.lru_cache(maxsize=None)
def _shape_filter(recipe: str):
    with torchao_imports():
        from torchao.float8 import _auto_filter_for_recipe

    return _auto_filter_for_recipe(recipe, filter_fqns=[])


def converts(p: PrecisionConfig, fqn: str, in_features: int, out_features: int) -> bool:
    """Whether the converter swaps the linear `fqn` (in_features -> out_features, the whole layer:
    the converter runs before parallelization) for a low-precision one. Named layers (the output by
    default), an MoE router (its scores decide the routing; TorchTitan keeps it high precision too)
    and linears whose shapes the low-precision kernels cannot take stay in high precision, and,
    with AUTO_FILTER among the names, those torchao's float8 shape filter keeps. (Routed experts
    are not linears: they stay in the parameters' dtype.) The planner asks it too (perf.model.shapes)."""
    if p.converter == Converter.none:
        return False
    align = ALIGNMENT[p.converter]
    if in_features % align or out_features % align or fqn.endswith("router.gate"):
        return False
    if any(name in fqn for name in p.filter_fqns if name != AUTO_FILTER):
        return False
    if AUTO_FILTER in p.filter_fqns and p.converter == Converter.float8:
        return _shape_filter(str(p.float8_recipe))(nn.Linear(in_features, out_features, bias=False, device="meta"), fqn)
    return True


def apply_converter(model: nn.Module, p: PrecisionConfig) -> None:
    """Swap the model's linears for torchao's float8 or MXFP8 training linears (in place)."""
    if p.converter == Converter.none:
        return

    def convert(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and converts(p, fqn, module.in_features, module.out_features)

    emulate = emulated(p)
    if p.converter == Converter.float8:
        with torchao_imports():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(p.float8_recipe.value),
            emulate=emulate,
            enable_fsdp_float8_all_gather=p.float8_enable_fsdp_all_gather,
        )
        convert_to_float8_training(model, config=config, module_filter_fn=convert)
    else:
        with torchao_imports():
            from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
            from torchao.quantization import quantize_

        recipe = MXFP8TrainingRecipe(p.mx_recipe.value)
        if emulate and "emulated" not in p.mx_recipe:
            recipe = MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL
        quantize_(model, MXFP8TrainingOpConfig.from_recipe(recipe), filter_fn=convert)
    converted = sum(1 for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and convert(m, fqn))
    logger.info(
        "%s: %d linears converted%s", p.converter if p.converter == Converter.mxfp8 else f"float8 {p.float8_recipe}",
        converted,
        " (emulated: this device has no such matmuls; numerics as on hardware, speed not)" if emulate else "",
    )


def compile_rounds_as_eager(p: PrecisionConfig) -> bool:
    """Whether compiled blocks must round every intermediate to its dtype as eager PyTorch does
    (Inductor's `emulate_precision_casts`). Inductor keeps a fused kernel's intermediates in fp32
    where eager rounds them, so what a block computes depends on how it was fused, which activation
    checkpointing changes, and its recompute need not match its forward. Under float8 with rowwise
    scales (each from its row's amax) losses went non-finite that way (pytorch/pytorch#150859, for which
    TorchTitan sets it under rowwise), as Llama 3.1 8B's width with selective AC did at its
    second step on an H200. Rounded as eager,
    selective AC gives the losses of no AC to the bit (tests/test_precision.py)."""
    rowwise = (Float8Recipe.rowwise, Float8Recipe.rowwise_with_gw_hp)
    return p.converter == Converter.float8 and p.float8_recipe in rowwise


def autocast_dtype(p: PrecisionConfig, fsdp: bool) -> torch.dtype | None:
    """The dtype to autocast the forward to, or None where something else already casts."""
    if fsdp or p.full_bf16 or p.converter == Converter.mxfp8 or p.param_dtype == DType.float32:
        return None
    return DTYPES[p.param_dtype]


def fsdp_param_dtype(p: PrecisionConfig) -> torch.dtype | None:
    """FSDP's compute dtype for parameters; None when they are already stored in it."""
    return None if p.full_bf16 else DTYPES[p.param_dtype]


def precompute_float8_scales(p: PrecisionConfig, model_parts: list[nn.Module]) -> None:
    """After the optimizer step: one all-reduce for all float8 weight scales, instead of one per
    weight during the next forward's all-gather."""
    if p.converter == Converter.float8 and p.float8_precompute_dynamic_scale_for_fsdp:
        with torchao_imports():
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)
