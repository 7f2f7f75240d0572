"""What calibration measures of a device's kernels (titan_exp.perf.calibration.measure): the rates perf.model.block
prices a block's parts at (profile.Kernels), so that the same per-op model that plans a GPU from
its spec sheet runs on the GPU's own measured constants. Every rank measures
at once, as it would compute in a step; each rate is the slowest rank's.

- matmul, by dtype (fp32 as training runs it: torch's default, no TF32; bf16; float8 through
  torch._scaled_mm where the GPU has FP8 tensor cores as torchao runs it (FLOAT8_GEMMS): with one
  scale a tensor, without fast accumulation (its backward GEMMs) and, as `float8_fast`, with it
  (its tensorwise forward), and, as `float8_rowwise`, a scale a row of each operand and fast
  accumulation (its rowwise recipe's forward, which runs other kernels)): the best of a few large shapes, each
  divided by its wave utilization (perf.model.block.wave_utilization), since the model applies a GEMM's
  waves itself: the measured counterpart of [mamf]'s best-shape share;
- attention: causal SDPA at the model's heads and head dim in the training dtype, by sequence
  length (the same tokens at each), forward, and backward as forward + backward less forward; its
  FLOPs counted as perf.model.block counts them (forward 2 x s^2 x heads x head_dim, backward 2.5 x that):
  the measured counterpart of [fa3]'s curve; and which kernel SDPA ran (flash, cudnn, ...);
- grouped GEMM: torch._grouped_mm over 8 experts at the smallest GEMM side, in the training dtype,
  against a dense GEMM of the same rows and tiles: its share of the dense rate, [grouped];
- memory-bound kernels: an elementwise add of two large tensors into a third (three streams): [hbm];
  and this toolkit's block's own (its two RMSNorms, RoPE on q and k, GQA's repeat of k and v, the
  SwiGLU's SiLU and product, the residual adds) forward and backward on a sequence of the model's
  shape (on a GPU, ELEMENTWISE_SEQUENCES of them), eager, and compiled with `--compile`, called
  back to back: the rate the bytes perf.rates.model_ops counts for them move at
  (Kernels.elementwise_tb_s), for perf.model.block to price the model's memory-bound kernels at;
- host time: a chain of tiny ops that autograd records, with no wait in between, per op; and, with
  `--compile`, a compiled chain of tiny matmuls (one kernel each), per kernel: [host]; and where
  torchao's float8 runs on the device, a tiny eager float8 linear's forward (tensorwise) against a
  tiny bf16 one's, less its casts' kernels at the op's host time: torchao's Python around it
  (perf.rates.float8_casts' [torchao-eager]);
- float8 casts: where the device has FP8 tensor cores, a Float8Linear of the model's widest shape
  forward and backward (tensorwise and rowwise; eager, and compiled with `--compile`) less its
  GEMMs at the rates above: the rate its casts' bytes run at, for perf.model.block to price them at
  (the memory rate, 3.7 TB/s on an H200, was 2-2.2x too fast for torchao's casts there).

On a CPU these are measured too and kept in the profile, but a CPU's plan reads its measured
blocks instead (perf.model.step).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import statistics
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from titan_exp.config import ModelConfig
from titan_exp.perf.calibration.timing import Options, in_rounds, together
from titan_exp.perf.model.block import elementwise_bytes, linear_s, wave_utilization
from titan_exp.perf.rates.float8_casts import EAGER_CAST_KERNELS
from titan_exp.perf.rates.kernels import HOST_COMPILED_S, hbm
from titan_exp.perf.rates.model_ops import LLAMA
from titan_exp.perf.rates.profile import Kernels
from titan_exp.precision import torchao_imports

logger = logging.getLogger("titan_exp")

HOST_OPS = 200  # tiny ops per timed chain
COMPILED_KERNELS = 32  # tiny matmuls per compiled chain
GROUPS = 8  # experts of the timed grouped GEMM
# Sequences of the block's memory-bound ops timed at once, their calls queued back to back
# (timing.queued): on the H200, one sequence of the 1B's, compiled, timed a call at a time, took
# 1.29 ms, 0.48 of the contiguous add's rate, where the compiled model's own kernels ran at
# 0.77-0.79 of it in the 3B's traces (benchmarks/data/gpu_h200_trace_*): its ~0.8 ms of device work
# waited, it seems, on the host's launching of a compiled forward and backward. Four sequences
# queued make the device's work the longer (an assumption until a GPU calibrates with it).
ELEMENTWISE_SEQUENCES = 4
FLOAT8_LINEARS = 20  # tiny float8 linears' forwards per timed chain
FLOAT8_CAST_RECIPES = ("tensorwise", "rowwise")  # torchao's recipes whose casts' rate is measured


def sizes(opts: Options, device: torch.device) -> tuple[list[int], list[int], int, int]:
    """What is measured at: GEMM sides, attention's sequence lengths and its tokens at each, a
    memory-bound kernel's elements."""
    if device.type == "cuda":
        return [4096, 8192, 16384], [512, 1024, 2048, 4096, 8192], 16384, 1 << 26
    if opts.tiny:
        return [128, 256], [64, 128], 256, 1 << 20
    return [256, 512], [256, 512, 1024], 2048, 1 << 23


def architecture(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    major = torch.cuda.get_device_capability(device)[0]
    return {8: "ampere", 9: "hopper"}.get(major, "blackwell" if major >= 10 else "older")


def matmul_dtypes(device: torch.device) -> list[torch.dtype]:
    """fp32 and bf16; float8 where the GPU has FP8 tensor cores (compute capability 8.9 and up)."""
    dtypes = [torch.float32, torch.bfloat16]
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        dtypes.append(torch.float8_e4m3fn)
    return dtypes


def matmul(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
           rowwise: bool = False, fast_accum: bool = False) -> Callable[[], torch.Tensor]:
    """One (m x k) @ (k x n) GEMM to time; float8 through torch._scaled_mm (unit scales, one a
    tensor, or with `rowwise` one a row of a and a column of b; bf16 out; `fast_accum`: cuBLAS's
    fast accumulation, which torchao's forward GEMMs ask for and its backward ones do not)."""
    if dtype == torch.float8_e4m3fn:
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(n, k, device=device).to(dtype).t()  # _scaled_mm wants its second operand column-major
        scale_a, scale_b = ((torch.ones(m, 1, device=device), torch.ones(1, n, device=device)) if rowwise
                            else (torch.ones((), device=device),) * 2)
        return lambda: torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast_accum)
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    return lambda: a @ b


# torchao's float8 GEMMs as calibration times them: perf.model.block's dtype -> (rowwise scales, fast
# accumulation). Its backward GEMMs (tensorwise cuBLAS, no fast accumulation): float8; its
# tensorwise forward: float8_fast; its rowwise forward: float8_rowwise
# (Float8LinearConfig.from_recipe_name: gemm_config_output use_fast_accum=True, the gradients' False).
FLOAT8_GEMMS = {"float8": (False, False), "float8_fast": (False, True), "float8_rowwise": (True, True)}


def matmul_tflops(sides: list[int], sms: int, opts: Options, device: torch.device) -> dict[str, float]:
    out = {}
    for dtype in matmul_dtypes(device):
        name = str(dtype).removeprefix("torch.")
        kinds = FLOAT8_GEMMS if dtype == torch.float8_e4m3fn else {name: (False, False)}
        for key, (rowwise, fast) in kinds.items():
            best = 0.0
            try:
                for n in sides:
                    seconds = together(matmul(n, n, n, dtype, device, rowwise, fast), opts.reps, device)
                    best = max(best, 2 * n**3 / seconds / wave_utilization(n, n, sms) / 1e12)
            except (RuntimeError, NotImplementedError) as exc:
                if key in (name, "float8"):  # a dtype's own GEMM: nothing else to price it by
                    raise
                logger.warning("calibration: %s GEMMs did not run here; the plan prices them at float8's rate: %s",
                               key, exc)
                continue
            out[key] = best
    return out


def grouped_gemm_share(side: int, groups: int, dtype: torch.dtype, opts: Options, device: torch.device) -> float | None:
    """torch._grouped_mm over `groups` experts of side x side weights with `side` rows each, timed
    against one dense GEMM of the same rows, width and tiles: the dense's seconds over the grouped
    one's. None where torch has no grouped GEMM for the device."""
    x = torch.randn(groups * side, side, device=device, dtype=dtype)
    w = torch.randn(groups, side, side, device=device, dtype=dtype)
    offsets = torch.arange(1, groups + 1, device=device, dtype=torch.int32) * side
    try:
        torch._grouped_mm(x, w, offs=offsets)
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    dense = together(lambda: x @ w[0], opts.reps, device)
    return dense / together(lambda: torch._grouped_mm(x, w, offs=offsets), opts.reps, device)


def attention_curves(m: ModelConfig, seqs: list[int], tokens: int, dtype: torch.dtype, opts: Options,
                     device: torch.device) -> tuple[tuple[tuple[int, float], ...], tuple[tuple[int, float], ...]]:
    """(forward, backward) TFLOP/s of causal SDPA by sequence length."""
    fwd_curve, bwd_curve = [], []
    for seq in seqs:
        batch = max(1, tokens // seq)
        q, k, v = (torch.randn(batch, m.n_heads, seq, width, device=device, dtype=dtype, requires_grad=True)
                   for width in (m.head_size, m.head_size, m.v_head_size))  # MLA's values are narrower
        grad = torch.randn(batch, m.n_heads, seq, m.v_head_size, device=device, dtype=dtype)

        @torch.no_grad()
        def fwd(q=q, k=k, v=v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd(q=q, k=k, v=v, grad=grad):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        flops = batch * seq * seq * m.n_heads * (m.head_size + m.v_head_size)  # causal: half of 2 s^2 h (d_qk + d_v)
        fwd_s = together(fwd, opts.reps, device)
        bwd_s = max(together(fwd_bwd, opts.reps, device) - fwd_s, 1e-9)
        fwd_curve.append((seq, flops / fwd_s / 1e12))
        bwd_curve.append((seq, 2.5 * flops / bwd_s / 1e12))
        del q, k, v, grad
    return tuple(fwd_curve), tuple(bwd_curve)


def sdpa_kernel(m: ModelConfig, seq: int, dtype: torch.dtype, device: torch.device) -> str:
    """The kernel PyTorch's SDPA picks for causal attention at this shape: flash, cudnn, efficient
    or math (its own choice, `torch._fused_sdp_choice`)."""
    q = torch.empty(1, m.n_heads, seq, m.head_size, device=device, dtype=dtype)
    v = torch.empty(1, m.n_heads, seq, m.v_head_size, device=device, dtype=dtype)
    names = {int(b): k for k, b in SDPBackend.__members__.items()}
    name = names.get(int(torch._fused_sdp_choice(q, q, v, is_causal=True)), "unknown")
    known = {"FLASH_ATTENTION": "flash", "CUDNN_ATTENTION": "cudnn", "EFFICIENT_ATTENTION": "efficient"}
    return known.get(name, name.lower())


def memory_tb_s(elements: int, dtype: torch.dtype, opts: Options, device: torch.device) -> float:
    a, b, c = (torch.randn(elements, device=device).to(dtype) for _ in range(3))
    seconds = together(lambda: torch.add(a, b, out=c), opts.reps, device)
    return 3 * elements * a.element_size() / seconds / 1e12


@dataclasses.dataclass
class ElementwiseBlock:
    """This toolkit's block's memory-bound ops on `tokens` tokens of a model's shape, fed from leaf
    tensors in place of the GEMMs and attention between them (`leaves`, the norms' weights among
    them): `forward()` runs them as the block does (titan_exp.models.llama's RMSNorm, QK-norm and
    apply_rope, GQA's repeat as causal_attention runs it), returning what the next GEMM or
    attention would read; `norms` and the RoPE `tables` as the block holds them."""

    forward: Callable[[], list[torch.Tensor]]
    leaves: tuple[torch.Tensor, ...]
    norms: tuple[torch.nn.Module, ...]
    tables: tuple[torch.Tensor, torch.Tensor]


def elementwise_block(m: ModelConfig, tokens: int, dtype: torch.dtype, device: torch.device) -> ElementwiseBlock:
    from titan_exp.models.llama import apply_rope, rope_tables

    if m.mla:
        return latent_elementwise_block(m, tokens, dtype, device)
    d, hd, heads, kv, f = m.dim, m.head_size, m.n_heads, m.kv_heads, m.ffn_hidden_dim
    norms = tuple(torch.nn.RMSNorm(n, eps=m.norm_eps, device=device, dtype=dtype)
                  for n in (d, d, *((hd, hd) if m.qk_norm else ())))  # QK-norm's: the queries', the keys'
    cos, sin = (t.to(device) for t in rope_tables(hd, tokens, m.rope_theta))

    def leaf(*shape):
        return torch.randn(1, tokens, *shape, device=device, dtype=dtype, requires_grad=True)

    x, attn, ffn_out = leaf(d), leaf(d), leaf(d)
    q, k, v, gate, up = leaf(heads, hd), leaf(kv, hd), leaf(kv, hd), leaf(f), leaf(f)

    def forward():
        h = x + attn
        normed, ffn_in = norms[0](x), norms[1](h)
        qn, kn = (norms[2](q), norms[3](k)) if m.qk_norm else (q, k)
        outs = [apply_rope(qn, cos, sin), apply_rope(kn, cos, sin), v, torch.nn.functional.silu(gate) * up, h + ffn_out]
        if kv < heads:  # causal_attention's repeat of K and V to every query head
            outs[1], outs[2] = outs[1].repeat_interleave(heads // kv, dim=2), v.repeat_interleave(heads // kv, dim=2)
        # each norm's output as the GEMMs that read it (wq, wk, wv; w1, w3): backward sums their gradients
        return [*outs, normed, normed, normed, ffn_in, ffn_in]

    weights = tuple(w for n in norms for w in n.parameters())
    return ElementwiseBlock(forward, (x, attn, ffn_out, q, k, v, gate, up, *weights), norms, (cos, sin))


def latent_elementwise_block(m: ModelConfig, tokens: int, dtype: torch.dtype, device: torch.device) -> ElementwiseBlock:
    """elementwise_block for a model with multi-head latent attention: its memory-bound ops as
    titan_exp.models.mla runs them (its latents' norms, the key's shared rotated part joined to
    every head, RoPE on each head's last qk_rope_head_dim), with Llama's norms, residual adds and
    SwiGLU product around them."""
    from titan_exp.models.llama import rope_tables
    from titan_exp.models.mla import rope_tail

    d, f, heads, nope, rope = m.dim, m.ffn_hidden_dim, m.n_heads, m.head_size - m.rope_dim, m.rope_dim
    latents = [n for n in (m.q_lora_rank, m.kv_lora_rank) if n]
    norms = tuple(torch.nn.RMSNorm(n, eps=m.norm_eps, device=device, dtype=dtype) for n in (d, d, *latents))
    cos, sin = (t.to(device) for t in rope_tables(rope, tokens, m.rope_theta))

    def leaf(*shape):
        return torch.randn(1, tokens, *shape, device=device, dtype=dtype, requires_grad=True)

    # the outputs of wq (or wq_b), wkv_a, wkv_b and of wq_a if queries have a latent
    x, attn, ffn_out, gate, up = leaf(d), leaf(d), leaf(d), leaf(f), leaf(f)
    q, kv_a, kv_b = leaf(heads, m.head_size), leaf(m.kv_lora_rank + rope), leaf(heads, nope + m.v_head_size)
    q_a = (leaf(m.q_lora_rank),) if m.q_lora_rank else ()

    def forward():
        h = x + attn
        normed, ffn_in = norms[0](x), norms[1](h)
        latent, k_rope = kv_a.split([m.kv_lora_rank, rope], dim=-1)
        k_nope, v = kv_b.split([nope, m.v_head_size], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, heads, -1)], dim=-1)
        rotate = rope_tail(nope)
        outs = [rotate(q, cos, sin), rotate(k, cos, sin), v, torch.nn.functional.silu(gate) * up, h + ffn_out]
        outs += [norm(t) for norm, t in zip(norms[2:], (*q_a, latent))]  # to wq_b and wkv_b
        # the attention norm's output to wq (or wq_a) and wkv_a; the FFN norm's to w1 and w3
        return [*outs, normed, normed, ffn_in, ffn_in]

    weights = tuple(w for n in norms for w in n.parameters())
    return ElementwiseBlock(forward, (x, attn, ffn_out, gate, up, q, kv_a, kv_b, *q_a, *weights), norms, (cos, sin))


def elementwise_tb_s(m: ModelConfig, tokens: int, dtype: torch.dtype, opts: Options, device: torch.device,
                     compiled: bool) -> float:
    """The rate (TB/s) at which this toolkit's block runs its memory-bound ops (elementwise_block),
    forward and backward, on `tokens` tokens of the model's shape, compiled as one graph with
    `compiled`: their seconds against the bytes perf.rates.model_ops.LLAMA counts for them, as
    perf.model.block.block_times prices them (the forward's, twice that backward; with multi-head latent
    attention, perf.rates.model_ops' mla_* terms for its attention's)."""
    block = elementwise_block(m, tokens, dtype, device)
    run = torch.compile(block.forward) if compiled else block.forward
    grads = [torch.randn_like(o) for o in block.forward()]

    def step():
        torch.autograd.grad(run(), block.leaves, grads)

    step()  # compiles, warms up
    seconds = together(step, opts.reps, device, back_to_back=True)
    act = torch.empty((), dtype=dtype).element_size()
    forward = elementwise_bytes(m, 1, LLAMA, compiled, tokens, act, m.ffn_hidden_dim)  # as block_times counts them
    return 3 * forward / seconds / 1e12


def host_chain(device: torch.device) -> Callable[[], object]:
    """HOST_OPS tiny ops one after another: their time is the host's, an op at a time."""
    x = torch.ones(1, device=device, requires_grad=True)

    def chain():
        y = x
        for _ in range(HOST_OPS):
            y = y * 1.0001
        return y

    return chain


def host_op_s(opts: Options, device: torch.device) -> float:
    return together(host_chain(device), opts.reps, device) / HOST_OPS


def host_float8_s(opts: Options, device: torch.device) -> float | None:
    """Host seconds of torchao's Python around an eager float8 linear's forward, beyond its
    kernels: a tiny Float8Linear's forward (tensorwise) less a tiny bf16 linear's and less its two
    casts' kernels at a tiny op's host time each (perf.rates.float8_casts' [torchao-eager]), the three
    timed side by side in each round (timing.in_rounds: a slow spell of a shared host spoils a
    round, not the difference), the median over the rounds. None where torchao's float8 does not
    run."""
    try:
        with torchao_imports():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    side = 32  # float8 matmuls take multiples of 16
    plain = torch.nn.Sequential(torch.nn.Linear(side, side, bias=False)).to(device, torch.bfloat16)
    float8 = convert_to_float8_training(copy.deepcopy(plain), config=Float8LinearConfig.from_recipe_name("tensorwise"))
    x = torch.randn(side, side, device=device, dtype=torch.bfloat16, requires_grad=True)
    try:
        float8(x)
    except (RuntimeError, NotImplementedError, AssertionError):
        return None

    def chain(linear):
        return lambda: [linear(x) for _ in range(FLOAT8_LINEARS)]

    casts = 2 * EAGER_CAST_KERNELS["tensorwise"]
    extra = [(f8 - bf16) / FLOAT8_LINEARS - casts * op / HOST_OPS
             for f8, bf16, op in in_rounds([chain(float8), chain(plain), host_chain(device)], opts, device)]
    return max(0.0, statistics.median(extra))


def float8_cast_tb_s(kern: Kernels, m: ModelConfig, rows: int, opts: Options, device: torch.device,
                     modes: tuple[str, ...]) -> dict[str, float]:
    """The rate at which torchao's float8 linear casts its tensors here, by "<recipe>/<casts>"
    (Kernels.float8_cast_tb_s): a Float8Linear of the model's widest shape (dim -> the SwiGLU's
    width) on `rows` rows, with an fp32 weight under bf16 autocast as a replica runs it, forward
    and backward, eager (`torchao`) and `compiled` as `modes` name; less its three GEMMs at
    `kern`'s rates and the weight gradient's fp32 cast (model_ops.Elementwise's, priced apart);
    what is left runs perf.rates.float8_casts' bytes of that linear. Empty where torchao is missing or
    the device has no FP8 tensor cores (`kern` measured no float8 rate); a mode whose remainder is
    not positive (its GEMMs ran faster than `kern` says by more than its casts took) is left out."""
    try:
        with torchao_imports():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return {}
    if "float8" not in kern.matmul_tflops:
        return {}
    k, n, out = m.dim, m.ffn_hidden_dim, {}
    for recipe in FLOAT8_CAST_RECIPES:
        for casts in modes:
            plain = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(device)
            linear = convert_to_float8_training(plain, config=Float8LinearConfig.from_recipe_name(recipe))
            run = torch.compile(linear) if casts == "compiled" else linear
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16, requires_grad=True)
            grad = torch.randn(rows, n, device=device, dtype=torch.bfloat16)

            def step(run=run, linear=linear, x=x, grad=grad):
                linear[0].weight.grad, x.grad = None, None  # as after zero_grad: assigned, not added to
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    y = run(x)
                y.backward(grad)

            try:
                step()
                seconds = together(step, opts.reps, device)
            except Exception as exc:  # noqa: BLE001 - a rate not measured is priced at the memory rate
                logger.warning("calibration: torchao's %s float8 linear (%s) did not run here, its casts are "
                               "priced at the memory rate: %s: %s", recipe, casts, type(exc).__name__, exc)
                continue
            fwd, bwd, moved = linear_s(kern, rows, k, n, "float8", "bfloat16", recipe, casts)
            rest = seconds - fwd - bwd - k * n * LLAMA.autocast_weight_bytes[1] / hbm(kern)
            if rest > 0:
                out[f"{recipe}/{casts}"] = moved / rest / 1e12
    return out


def host_compiled_s(opts: Options, device: torch.device) -> float:
    w, x = torch.randn(16, 16, device=device), torch.randn(16, 16, device=device)

    @torch.compile
    def chain(x):
        for _ in range(COMPILED_KERNELS):
            x = torch.mm(x, w)  # a matmul is not fused: one kernel each
        return x

    chain(x)  # compiles
    return together(lambda: chain(x), opts.reps, device) / COMPILED_KERNELS


def measure_kernels(m: ModelConfig, opts: Options, device: torch.device) -> Kernels:
    sides, seqs, tokens, elements = sizes(opts, device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # what each trains its activations in
    fwd, bwd = attention_curves(m, seqs, tokens, dtype, opts, device)
    measured = ["matmul_tflops", "attention_fwd", "attention_bwd", "memory_tb_s", "host_eager_s"]
    compiled = host_compiled_s(opts, device) if opts.compile else HOST_COMPILED_S
    if opts.compile:
        measured.append("host_compiled_s")
    grouped = grouped_gemm_share(sides[0], GROUPS, dtype, opts, device)
    block_tokens = (ELEMENTWISE_SEQUENCES if device.type == "cuda" else 1) * seqs[-1]  # a CPU plan reads blocks
    elementwise = {"eager": elementwise_tb_s(m, block_tokens, dtype, opts, device, compiled=False)}
    if opts.compile:
        try:
            elementwise["compiled"] = elementwise_tb_s(m, block_tokens, dtype, opts, device, compiled=True)
        except Exception as exc:  # noqa: BLE001 - unmeasured, it is priced at the memory rate
            logger.warning("calibration: the block's compiled memory-bound ops did not run here; the plan prices "
                           "them at the memory rate: %s: %s", type(exc).__name__, exc)
    measured.append("elementwise_tb_s")
    if grouped is not None:
        measured.append("grouped_gemm_share")
    host_op = host_op_s(opts, device)
    float8 = host_float8_s(opts, device)
    if float8 is not None:
        measured.append("host_float8_s")
    kern = Kernels(matmul_tflops=matmul_tflops(sides, sms, opts, device), attention_fwd=fwd, attention_bwd=bwd,
                   memory_tb_s=memory_tb_s(elements, dtype, opts, device), host_eager_s=host_op, host_float8_s=float8,
                   host_compiled_s=compiled, sms=sms, architecture=architecture(device), head_dim=m.head_size,
                   attention_kernel=sdpa_kernel(m, seqs[-1], dtype, device), source="calibrated",
                   measured=tuple(measured), grouped_gemm_share=grouped or 1.0, elementwise_tb_s=elementwise)
    kinds = ("torchao", "compiled") if opts.compile else ("torchao",)
    casts = float8_cast_tb_s(kern, m, 2 * seqs[-1], opts, device, kinds)
    if casts:
        kern = dataclasses.replace(kern, float8_cast_tb_s=casts, measured=(*kern.measured, "float8_cast_tb_s"))
    return kern
