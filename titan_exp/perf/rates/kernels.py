"""What each kind of kernel achieves on a GPU planned from its spec sheet: the rates
perf.model.block prices a block's parts at (a profile.Kernels), each from the spec sheet or a published
microbenchmark, with its source: matmuls at the best shape's share of the dtype's peak [mamf];
attention by kernel, sequence length and head dim [fa3] [cudnn-fe], the kernel being the one
PyTorch SDPA runs there [sdpa] or another engine's [fa2]; memory-bound kernels at a share of the
HBM bandwidth [hbm]; host time per eager op and per compiled kernel [host] on the host's CPU
[te-2053]; all at the SM clock the power limit leaves [power]. A GPU's own rates, measured by
`python -m titan_exp.perf.calibrate` on it (perf.calibration.kernels), take their place.

Sources (checked 2026-11):
  [mamf] Maximum achievable matmul FLOPS at the best shape, stas00/ml-engineering
         compute/accelerator/README.md: each GPU's bf16 share (TF32 takes it too) and float8 share
         (perf.rates.devices lists them; H100 SXM 80.3 % and 70.9 %).
  [fa3]  Shah et al., FlashAttention-3 (arXiv:2407.08608), Figs. 5-6, H100 80GB SXM5, head dim
         128: FlashAttention-2 causal forward 191, 260, 298, 319, 333, 335 TFLOP/s and backward
         214, 260, 291, 310, 318, 322 at sequence 512 ... 16k (doubling). Read as shares of the
         bf16 peak; below 512 the share falls in proportion to the sequence (an assumption).
         On Ampere, FlashAttention-2's paper (Dao 2023) gives up to 73 % of the A100's peak
         forward: the Hopper curve is scaled to that. The same figures give cuDNN's causal
         attention at head dim 128 (ATTENTION) and FlashAttention-2's causal forward at head dim
         64 (HEAD_DIM_64), taken as head dim 64's share of head dim 128's for every kernel and
         for the backward too (an assumption: no backward at head dim 64 is read here).
  [cudnn-fe] NVIDIA/cudnn-frontend benchmark/sdpa_benchmark_training, bf16, causal, head dim 128,
         forward and backward TFLOP/s (its backward FLOPs 2.5 x the forward's, as here), each
         Blackwell GPU measured on its own (BLACKWELL_ATTENTION): cuDNN's fused attention from
         results/llama3.1/{gb200,gb300}/llama3.1_20260724_*.csv (commit e99b0d0b, cuDNN 9.26, Llama
         3.1 70B's heads, batch 2, top-left causal mask, non-deterministic backward), sequence 2k-32k;
         PyTorch SDPA's flash backend from artifacts/sdpa_bf16_benchmark_results_NVIDIA_{GB200,GB300,
         B200}.csv (commits d48a60eb and bb37575d; 128 query heads, batch 1), sequence 512-32k. B200's
         cuDNN curve, not measured there, is GB200's at B200's bf16 peak over GB200's (2,250 over
         2,500: the same die at a lower clock, as their flash curves differ, 0.90 at 8k; an assumption);
         B300's two curves, neither measured there, are GB300's the same way. Hopper's and Ampere's
         stay [fa3]'s; a Blackwell GPU without its own takes them (as shares of its peak), which
         overstates FlashAttention-2 there about twice.
  [sdpa] Which kernel this toolkit's attention runs: PyTorch SDPA's first eligible backend in its
         priority order, cuDNN's on Hopper and Blackwell (sm90, sm100) with a recent cuDNN
         (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, check_prefer_cudnn_attention; found
         running by this project's H200 calibration, torch 2.11), else FlashAttention-2 (SDPA_KERNEL);
         an older cuDNN keeps FlashAttention-2 first; calibrate measures whichever runs.
  [fa2]  Dao, FlashAttention-2 (arXiv:2307.08691), Section 4.1: FlashAttention-2 is 1.3-2.5x faster
         than Triton's FlashAttention on A100; priced at its rate over 1.8, the geometric middle (assumed).
  [hbm]  Memory-bound kernels at 90 % of the spec's HBM bandwidth (the share STREAM-like copies
         reach on HBM GPUs; an assumption, not a measurement of these kernels). A calibrated
         profile prices them at the rate this toolkit's block ran its own memory-bound ops on the
         GPU, eager and compiled (Kernels.elementwise_tb_s; the loss's kernels and autocast's
         casts taken to run alike), else at its contiguous add's rate.
  [host] Per eager op (Python, dispatch, autograd's record, the launch) and per compiled kernel,
         an x86 host: the medians of this project's five H200 calibrations (benchmarks/data/
         gpu_h200_*profile.json: 8.1-14.1 us, 9.9-17.3 us); calibrate measures a GPU's own host.
  [te-2053] A Grace host's, x 37.08 / 13.48 (HOST_CPU): NVIDIA/TransformerEngine#2053's torch
         Linear forward, CPU time on GB200's Grace against an H100 DGX's Xeon 8480C.
  [power] Dynamic power ~ f x V^2 with V ~ f in the boost range: at a power limit P below the
         TDP the sustained SM clock is ((P - idle) / (TDP - idle))^(1/3) of the TDP's, idle
         being 10 % of the TDP (an assumption). HBM speed does not change.
"""

from __future__ import annotations

import math

from titan_exp.perf.rates.profile import Kernels

HBM_SHARE = 0.9  # [hbm]
HOST_EAGER_S, HOST_COMPILED_S = 12.9e-6, 15.4e-6  # [host]: on an x86 host
HOST_CPU = {"x86": 1.0, "grace": 37.08 / 13.48}  # host time per op over an x86 host's [te-2053]
IDLE_SHARE = 0.1  # [power]
FA2_SEQ = (512, 1024, 2048, 4096, 8192, 16384)
H100_BF16 = 989.4  # the TFLOP/s [fa3]'s rates are shares of
FA2_FWD_TFLOPS = (191, 260, 298, 319, 333, 335)  # [fa3], head dim 128
FA2_FWD = tuple(t / H100_BF16 for t in FA2_FWD_TFLOPS)  # share of H100's bf16 peak
FA2_BWD = tuple(t / H100_BF16 for t in (214, 260, 291, 310, 318, 322))
AMPERE_FA2_PEAK = 0.73  # [fa3]: FlashAttention-2's paper, A100 forward
TRITON_SLOWDOWN = 1.8  # [fa2]
# Attention kernels: (forward, backward) shares of H100's bf16 peak at FA2_SEQ, head dim 128, causal [fa3].
ATTENTION = {"flash": (FA2_FWD, FA2_BWD),
             "cudnn": (tuple(t / H100_BF16 for t in (315, 410, 484, 518, 529, 539)),
                       tuple(t / H100_BF16 for t in (305, 408, 465, 499, 518, 516))),
             "triton": None}  # "triton": FlashAttention-2's curve over TRITON_SLOWDOWN [fa2] (attention_curves)
# The kernel PyTorch SDPA runs by GPU architecture [sdpa]: what a spec sheet's plan prices.
SDPA_KERNEL = {"ampere": "flash", "hopper": "cudnn", "blackwell": "cudnn"}
# Blackwell GPUs' own attention curves [cudnn-fe], kernel -> (forward, backward) (sequence, TFLOP/s), at the TDP clock.
_CUDNN_SEQ = (2048, 4096, 8192, 16384, 32768)
_FLASH_SEQ = (512, 1024, 2048, 4096, 8192, 16384, 32768)
_GB200_CUDNN = ((1098, 1407, 1646, 1728, 1569), (899, 1172, 1344, 1327, 1202))
_GB300 = {"cudnn": ((1467, 1813, 1991, 2065, 2105), (971, 1254, 1448, 1516, 1416)),
          "flash": ((58.6, 154, 271, 366, 411, 431, 440), (76.5, 149, 230, 292, 330, 351, 362))}
_HGX_OVER_NVL72 = 2250 / 2500  # an HGX GPU's bf16 peak over its NVL72 sibling's [cudnn-fe]


def _at_hgx_peak(curves):
    return tuple(tuple(t * _HGX_OVER_NVL72 for t in curve) for curve in curves)


BLACKWELL_ATTENTION = {
    "gb200": {"cudnn": _GB200_CUDNN,
              "flash": ((163, 255, 336, 387, 414, 430, 438), (146, 207, 268, 311, 338, 352, 360))},
    "gb300": _GB300,
    "b200": {"cudnn": _at_hgx_peak(_GB200_CUDNN),
             "flash": ((74.6, 166, 242, 325, 373, 394, 404), (83.0, 108, 186, 256, 299, 320, 331))},
    "b300": {kernel: _at_hgx_peak(curves) for kernel, curves in _GB300.items()},
}
# Head dim 64's rate over head dim 128's, by sequence: FlashAttention-2's causal forward [fa3].
HEAD_DIM_64 = tuple((s, a / b) for s, a, b in zip(FA2_SEQ, (180, 229, 262, 284, 295, 299), FA2_FWD_TFLOPS))


def clock_ratio(spec) -> float:
    """Sustained SM clock at the spec's power limit over the clock at its TDP [power]."""
    limit = spec.power_limit_w or spec.tdp_w
    if limit >= spec.tdp_w:
        return 1.0
    idle = IDLE_SHARE * spec.tdp_w
    return max(0.05, (limit - idle) / (spec.tdp_w - idle)) ** (1 / 3)


def spec_kernels(spec, attention: str | None = None) -> Kernels:
    """A spec sheet's GPU's kernel rates: each peak at the clock under its power limit, GEMMs at
    the best shape's share [mamf], attention on its kernel's curve (ATTENTION: "flash", SDPA's
    FlashAttention-2; "cudnn"; "triton"; by default the one SDPA runs on its architecture,
    SDPA_KERNEL [sdpa]) [fa3] or the GPU's own [cudnn-fe], memory-bound kernels at HBM_SHARE of
    the bandwidth [hbm], host times [host] on its host's CPU [te-2053]."""
    attention = attention or SDPA_KERNEL.get(spec.architecture, "flash")
    if attention not in ATTENTION:
        raise ValueError(f"attention {attention!r}: no such kernel; choose from {', '.join(ATTENTION)}")
    clock = clock_ratio(spec)
    shares = {"float32": spec.matmul_share, "bfloat16": spec.matmul_share,
              "float8": spec.fp8_share or spec.matmul_share}  # TF32 at bf16's share [mamf]
    fwd, bwd = attention_curves(spec, attention)
    return Kernels(matmul_tflops={k: v * shares[k] * clock for k, v in spec.peaks().items()},
                   attention_fwd=fwd, attention_bwd=bwd,
                   memory_tb_s=spec.memory_tb_s * HBM_SHARE, host_eager_s=HOST_EAGER_S * HOST_CPU[spec.host_cpu],
                   host_compiled_s=HOST_COMPILED_S * HOST_CPU[spec.host_cpu],
                   sms=spec.sms, architecture=spec.architecture, attention_kernel=attention, source="spec")


def attention_curves(spec, attention: str) -> tuple[tuple[tuple[int, float], ...], ...]:
    """The forward and backward (sequence, TFLOP/s) curves of `attention` on this GPU at the clock
    under its power limit: the GPU's own where [cudnn-fe] measured it (BLACKWELL_ATTENTION), else
    [fa3]'s H100 shares of its bf16 peak (Ampere's scaled to FlashAttention-2's A100 peak); Triton's
    FlashAttention at FlashAttention-2's over TRITON_SLOWDOWN [fa2]."""
    if attention == "triton":  # [fa2]: FlashAttention-2's rate on this GPU over TRITON_SLOWDOWN
        return tuple(tuple((s, t / TRITON_SLOWDOWN) for s, t in curve) for curve in attention_curves(spec, "flash"))
    clock = clock_ratio(spec)
    own = BLACKWELL_ATTENTION.get(spec.name, {})
    if attention in own:
        seqs = _FLASH_SEQ if attention == "flash" else _CUDNN_SEQ
        return tuple(tuple((s, t * clock) for s, t in zip(seqs, curve)) for curve in own[attention])
    peak = spec.bf16_tflops * clock * (AMPERE_FA2_PEAK / FA2_FWD[-1] if spec.architecture == "ampere" else 1.0)
    return tuple(tuple((s, share * peak) for s, share in zip(FA2_SEQ, curve)) for curve in ATTENTION[attention])


def attention_tflops(curve: tuple[tuple[int, float], ...], seq: float) -> float:
    """Flash attention's TFLOP/s at this sequence length, on a curve of (sequence, TFLOP/s):
    linear in log2(sequence) between its points, its last value beyond them, and below its first
    falling in proportion to the sequence (an assumption)."""
    seqs, rates = [s for s, _ in curve], [r for _, r in curve]
    if seq <= seqs[0]:
        return rates[0] * seq / seqs[0]
    if seq >= seqs[-1]:
        return rates[-1]
    i = max(j for j in range(len(seqs)) if seqs[j] <= seq)
    x = (math.log2(seq) - math.log2(seqs[i])) / (math.log2(seqs[i + 1]) - math.log2(seqs[i]))
    return rates[i] + (rates[i + 1] - rates[i]) * x


def head_dim_share(curve_head_dim: int, head_dim: int, seq: float) -> float:
    """Attention's rate at `head_dim` over its rate at the head dim its curve was taken at: head
    dim 64's share of 128's [fa3] where one is at most 64 and the other above, else 1."""
    if (head_dim <= 64) == (curve_head_dim <= 64):
        return 1.0
    share = attention_tflops(HEAD_DIM_64, max(seq, FA2_SEQ[0]))
    return share if head_dim <= 64 else 1 / share


def hbm(k: Kernels) -> float:
    """Bytes per second of a memory-bound kernel."""
    return k.memory_tb_s * 1e12
