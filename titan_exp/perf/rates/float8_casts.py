"""A float8 linear's casts on a GPU: the HBM bytes and host time of scaling and casting
its tensors to float8, as they run (CASTS): fused by torch.compile, torchao's eager kernels, or
Transformer Engine's; and the rate those bytes run at (the memory rate, or torchao's casts as
calibration measured them on the machine: cast_rate). perf.model.block prices each float8 linear of a
block with them.

Compiled (torchao under Inductor): each tensor's amax read folded into the kernel that produces
it, and one cast reading bf16 and writing a byte; for the backward GEMMs each again transposed,
from the float8 copy (tensorwise: read and write a byte) or from bf16 along the other axis
(rowwise, MXFP8). Its kernels' launches are the compiled block's (perf.model.block's host).

Rowwise scaling also rescales its backward GEMMs' outputs (the input's and the weight's gradients;
rowwise_with_gw_hp: the input's): torchao runs those GEMMs with tensorwise cuBLAS and multiplies
their output by the outer product of the two scales after (torchao.float8.float8_ops.
addmm_float8_unwrapped, without fast accumulation): eager, the fp32 product written, then read
with the bf16 output and the output written, 12 bytes an output element (counted, [torchao-eager]);
compiled, one fused pass reading and writing the output, 4 (an assumption: Inductor's fusion).

Transformer Engine's (another engine's rows, say LLM Foundry's FP8): an amax read and a cast, 5
bytes an element, transposed as compiled, 6 host ops a linear's forward (an assumption: its
kernels are not counted here).

Sources (checked 2026-11):
  [torchao-eager] torchao's float8 training (Float8Linear, torchao 0.17-0.18) without compile, its
         ops counted on CPU (tests/test_gpu_model_float8.py runs its cast code): each cast of a bf16
         tensor is 11 kernels under tensorwise scaling (abs, max, five on the scalar scale, the fp32
         upcast, the multiply, the clamp, the float8 cast) and 14 under rowwise (its power-of-two
         scales: log2, floor, exp2), moving 33 bytes an element (abs 4, max 2, upcast 6, multiply
         8, clamp 8, cast 5). The forward casts the input and the weight; the backward the output
         gradient twice, the weight and the input again (rowwise_with_gw_hp: the output gradient
         and the weight). The Python around them, HOST_FLOAT8_S a linear's forward (twice that
         backward), 0.69 ms, was fitted on an H200's rows (benchmarks/data/gpu_h200_suite.json):
         the 1B's two eager float8 steps (tensorwise, rowwise; fused AdamW), 2.0-2.1x its bf16
         eager step. Those steps are host-bound: the 3B's (foreach AdamW) took 27-28 ms a block
         against the 1B's 22-23, its bf16 eager blocks 13 against 9. calibrate measures this
         Python on the GPU's host (calibration.kernels.host_float8_s); on a 2-core x86_64 CPU it
         measured 0.35-0.47 ms (torchao 0.18, its float8 matmul emulated there).
"""

from __future__ import annotations

from titan_exp.config import JobConfig
from titan_exp.perf.rates.profile import Kernels

CASTS = ("compiled", "torchao", "transformer_engine")
EAGER_CAST_KERNELS = {"tensorwise": 11, "rowwise": 14, "rowwise_with_gw_hp": 14}  # [torchao-eager]
EAGER_CAST_BYTES = 33  # [torchao-eager]
HOST_FLOAT8_S = 0.69e-3  # [torchao-eager], fitted
ENGINE_CAST_OPS = 6  # Transformer Engine's host ops a linear's forward: an assumption
RESCALE_BYTES = {"torchao": 12, "compiled": 4}  # a rowwise backward GEMM's output element (above)


def recipe_of(job: JobConfig) -> str | None:
    """The float8 recipe a job's linears run (torchao's name; "mxfp8"), or None."""
    pr = job.precision
    return pr.float8_recipe if pr.converter == "float8" else ("mxfp8" if pr.converter == "mxfp8" else None)


def torchao_eager(recipe: str | None, casts: str) -> bool:
    """Whether these casts are torchao's eager ones, which [torchao-eager] counts."""
    if casts not in CASTS:
        raise ValueError(f"casts {casts!r}: choose from {', '.join(CASTS)}")
    return casts == "torchao" and recipe in EAGER_CAST_KERNELS


def cast_bytes(x: float, w: float, grad: float, recipe: str | None, casts: str, weight_cast: bool = True) -> float:
    """HBM bytes of one linear's casts, of x input, w weight and grad output-gradient elements, as
    `casts` runs them: each tensor scaled and cast, the weight only if `weight_cast` (else FSDP
    gathered it in float8); for the backward each again, transposed (rowwise_with_gw_hp: the
    weight alone, its weight gradient in bf16); under rowwise scaling, the backward GEMMs'
    outputs rescaled (of x and w elements; rowwise_with_gw_hp: x)."""
    eager = torchao_eager(recipe, casts)
    scale_and_cast = EAGER_CAST_BYTES if eager else 3 if casts == "compiled" else 5
    transposed = 2 if recipe == "tensorwise" and not eager else scale_and_cast
    again = w if recipe == "rowwise_with_gw_hp" else x + w + grad
    rescaled = {"rowwise": x + w, "rowwise_with_gw_hp": x}.get(recipe or "", 0.0)
    return ((x + (w if weight_cast else 0.0) + grad) * scale_and_cast + again * transposed
            + rescaled * RESCALE_BYTES.get(casts, 0))


def cast_rate(kern: Kernels, recipe: str | None, casts: str) -> float:
    """Bytes per second of a float8 linear's casts: as calibration measured torchao's run on the
    machine (Kernels.float8_cast_tb_s; rowwise_with_gw_hp's as rowwise's), else the memory rate."""
    measured = kern.float8_cast_tb_s.get(f"{'rowwise' if recipe == 'rowwise_with_gw_hp' else recipe}/{casts}")
    return (measured or kern.memory_tb_s) * 1e12


def cast_host_s(kern: Kernels, recipe: str | None, casts: str, weight_gathered: bool = False) -> float:
    """Host seconds of one linear's casts in a block's forward (its backward: twice, as the
    block's): none compiled (the compiled block's kernels); torchao's eager casts of its input and
    weight (the input's alone where FSDP gathered the weight in float8) and its Python
    [torchao-eager]; Transformer Engine's ops (and MXFP8's, whose eager casts are not counted)."""
    if casts == "compiled":
        return 0.0
    if not torchao_eager(recipe, casts):
        return (ENGINE_CAST_OPS - (2 if weight_gathered else 0)) * kern.host_eager_s
    python_s = HOST_FLOAT8_S if kern.host_float8_s is None else kern.host_float8_s
    return (1 if weight_gathered else 2) * EAGER_CAST_KERNELS[recipe] * kern.host_eager_s + python_s
