"""GPUs a user plans for before having them: spec-sheet numbers, each with its source, turned into
a machine profile the performance model reads like a calibrated one.

    python -m titan_exp.perf.plan model=llama3_8b --device h100 --world 512 --gpus-per-node 8

A profile calibrated on the real device (`python -m titan_exp.perf.calibrate` on that GPU) replaces the
spec one wherever both exist (`profile_for`). A spec sheet gives peaks; what each kernel of a
step achieves of them is priced from its parts in perf.model.block (matmuls by shape, attention by
sequence length, memory-bound kernels at HBM speed, host time, clocks under the power limit),
and the profile's `source` says "spec" so every table built from it says its numbers are
predicted from a spec sheet.

Sources (checked 2026-11):
  [h100]  NVIDIA H100 Tensor Core GPU datasheet, SXM5 column:
          https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
  [h200]  NVIDIA H200 Tensor Core GPU datasheet, SXM column: https://www.nvidia.com/en-us/data-center/h200/
  [a100]  NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column:
          https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
  [b200]  NVIDIA DGX B200 datasheet (8 GPUs; per-GPU values are the system's divided by 8):
          https://resources.nvidia.com/en-us-dgx-systems/dgx-b200-datasheet
  [b300]  NVIDIA DGX B300 (8 Blackwell Ultra GPUs): 72 PFLOPS FP8 training and 2.3 TB HBM3e for 8
          GPUs, NVLink 5 (1.8 TB/s both directions), ConnectX-8 800 Gb/s per GPU; per GPU 8 TB/s HBM3e,
          160 SMs, 1,100 W; the HGX B300's dense tensor peaks are the B200's (bf16 2,250, FP8 4,500
          TFLOP/s), as [mamf] takes them (https://www.nvidia.com/en-us/data-center/dgx-b300/).
  [gb200] NVIDIA GB200 NVL72 (72 GPUs in one NVLink domain; per-GPU values are the rack's divided by
          72, dense being half the sparse figures listed): https://www.nvidia.com/en-us/data-center/gb200-nvl72/
          FP16/BF16 360 PFLOPS and FP8 720 PFLOPS sparse, 13.4 TB HBM3e at 576 TB/s, NVLink
          130 TB/s; the GPU is B200 (148 SMs) configured at 1,200 W (NVIDIA Blackwell architecture
          technical brief); ConnectX-7 400 Gb/s per GPU; a Grace CPU hosts each two GPUs.
  [gb300] NVIDIA GB300 NVL72, the same way: https://www.nvidia.com/en-us/data-center/gb300-nvl72/
          FP16/BF16 360 PFLOPS and FP8 720 PFLOPS sparse, 20 TB HBM3e at 576 TB/s, NVLink
          130 TB/s, ConnectX-8 800 Gb/s per GPU; Blackwell Ultra, 160 SMs, 1,400 W.
  [titan] TorchTitan's benchmark machines, docs/performance.md in pytorch/torchtitan: Grand Teton
          hosts of 8 H100 with 96 GB HBM2e at 2.4 TB/s, NVLink, 400 Gb/s RDMA per GPU, the
          default 500 W power limit.
  [mamf]  The best-shaped matmul's share of the peak, measured in bf16 and in float8 (e4m3):
          stas00/ml-engineering compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS
          comparison table" (at 744d01e), its TFLOP/s over the theoretical in `MAMF`
          below (H100 80.3 % bf16, 70.9 % float8; "H200 is the same" in bf16). No GB300 row: its
          shares are B300's times GB200's over B200's (an NVL72 Blackwell against its HGX one, as
          measured: 73.9 % and 70.6 %), an assumption.
  [nvml]  The memory a GPU offers is what its driver shows (NVML's memory.total: nvidia-smi's, and
          torch.cuda's total_memory): a datasheet's "GB" of HBM are GiB, less a reserve. H100 80GB
          81,559 MiB, H200 141GB 143,771 MiB (as this project's H200 showed, BENCHMARKS.md), A100
          80GB 81,920 and 40GB 40,960 MiB: Modal's table in "Why does an NVIDIA H100 80GB card offer
          85.52 GB?" (https://thundergolfer.com/blog/nvidia-gpu-memory-capacity). A GPU without such a
          reading, its datasheet's figure as GiB x NVML_SHARE, the Hopper readings' share of theirs
          (0.9956, 0.9958): B200's 179.2 GiB so, where Vultr's HGX B200 overview lists 179 GB read
          from nvidia-smi (https://docs.vultr.com/inference-cookbook/cuda/getting-started/hardware-overview).
  [nccl]  Latencies are not on spec sheets: NCCL's own tuning model's (perf.rates.nccl), the same for
          every GPU; a hardware file may give the per-step ones of large messages.
Bandwidths are per GPU and per direction (NVLink's datasheet figure is both directions added:
900 GB/s on Hopper is 450 each way); the network is one NIC per GPU.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from titan_exp.perf.rates.kernels import hbm, spec_kernels
from titan_exp.perf.rates.nccl import NET_STEP_S, NVLINK_STEP_S, SIMPLE, NcclModel
from titan_exp.perf.rates.profile import COLLECTIVES, Corrections, Line, MachineProfile, find, machine_key

NVML_SHARE = 0.9957  # [nvml]: a GPU's memory.total over its datasheet's figure read as GiB (Hopper's)


# [mamf]'s measured matmul TFLOP/s over the theoretical, (bf16, float8) per GPU it lists.
MAMF = {"h100": (794.5 / 989, 1402.6 / 1979), "h200": (794.5 / 989, 1453.4 / 1979), "a100": (271.2 / 312, None),
        "b200": (1745 / 2250, 3432.5 / 4500), "gb200": (1822 / 2500, 3615.6 / 5000),
        "b300": (1769 / 2250, 3353.3 / 4500)}
# GB300, which [mamf] lacks: B300's shares, scaled as GB200's are B200's (an assumption).
MAMF["gb300"] = tuple(u * g / b for u, g, b in zip(MAMF["b300"], MAMF["gb200"], MAMF["b200"]))


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    cuda_names: tuple[str, ...]  # what torch.cuda.get_device_name() says for it
    bf16_tflops: float  # dense, tensor cores
    fp8_tflops: float | None  # dense; None where the GPU has no FP8 tensor cores
    tf32_tflops: float  # dense: what fp32 matmuls run at (TF32)
    memory_gib: float  # as the driver shows it (NVML's memory.total) [nvml]
    memory_tb_s: float
    nvlink_gb_s: float  # per GPU, per direction
    network_gb_s: float  # per GPU, per direction, between nodes
    source: str
    sms: int = 132  # streaming multiprocessors: a GEMM's waves (perf.model.block)
    tdp_w: float = 700.0  # the power the spec's clocks are sustained at
    power_limit_w: float | None = None  # a lower cap lowers the SM clock (kernels.clock_ratio); None = the TDP
    matmul_share: float = MAMF["h100"][0]  # the best-shaped bf16 matmul's share of the peak (TF32's too) [mamf]
    fp8_share: float | None = None  # the best-shaped float8 matmul's share [mamf]; None = matmul_share
    architecture: str = "hopper"  # hopper, ampere or blackwell: which attention curve (perf.rates.kernels)
    host_cpu: str = "x86"  # the CPU the ranks' Python runs on: its host time per op (kernels.HOST_CPU)

    def peaks(self) -> dict[str, float]:
        """The dense tensor-core TFLOP/s by dtype: fp32 matmuls at TF32's; float8 where it has FP8."""
        return {"float32": self.tf32_tflops, "bfloat16": self.bf16_tflops,
                **({"float8": self.fp8_tflops} if self.fp8_tflops else {})}


SPECS: dict[str, DeviceSpec] = {s.name: s for s in (
    DeviceSpec("h100", ("H100 80GB HBM3", "H100 SXM"), 989.4, 1978.9, 494.7, 81_559 / 1024, 3.35, 450, 50,
               "[h100] SXM5 700 W; NDR 400 Gb/s per GPU", fp8_share=MAMF["h100"][1]),
    DeviceSpec("h100_500w", ("H100",), 989.4, 1978.9, 494.7, 96 * NVML_SHARE, 2.4, 450, 50,
               "[titan] the H100 TorchTitan's tables were measured on: 96 GB HBM2e at 2.4 TB/s, capped at 500 W "
               "(the peaks, TDP and matmul shares are [h100]'s)", power_limit_w=500.0, fp8_share=MAMF["h100"][1]),
    DeviceSpec("h200", ("H200",), 989.4, 1978.9, 494.7, 143_771 / 1024, 4.8, 450, 50,
               "[h200] SXM 700 W; NDR 400 Gb/s per GPU; its bf16 matmul share H100's (the same GH100 die)",
               fp8_share=MAMF["h200"][1]),
    DeviceSpec("a100", ("A100-SXM4-80GB", "A100 80GB"), 312.0, None, 156.0, 81_920 / 1024, 2.039, 300, 25,
               "[a100] 80GB SXM 400 W; HDR 200 Gb/s per GPU", sms=108, tdp_w=400.0, matmul_share=MAMF["a100"][0],
               architecture="ampere"),
    DeviceSpec("a100_40gb", ("A100-SXM4-40GB", "A100 40GB"), 312.0, None, 156.0, 40_960 / 1024, 1.555, 300, 25,
               "[a100] 40GB SXM 400 W; HDR 200 Gb/s per GPU; the 80GB's matmul share", sms=108, tdp_w=400.0,
               matmul_share=MAMF["a100"][0], architecture="ampere"),
    DeviceSpec("b200", ("B200",), 2250.0, 4500.0, 1100.0, 180 * NVML_SHARE, 8.0, 900, 50,
               "[b200] DGX B200: 72/144 PFLOPS FP8 dense/sparse and 1,440 GB HBM3e for 8 GPUs, NVLink 5 "
               "(1.8 TB/s both directions), ConnectX-7 400 Gb/s per GPU, 1000 W", sms=148, tdp_w=1000.0,
               matmul_share=MAMF["b200"][0], fp8_share=MAMF["b200"][1], architecture="blackwell"),
    DeviceSpec("b300", ("B300",), 2250.0, 4500.0, 1100.0, 288 * NVML_SHARE, 8.0, 900, 100,
               "[b300] DGX B300: Blackwell Ultra at 1,100 W, 288 GB HBM3e at 8 TB/s, NVLink 5, ConnectX-8 800 Gb/s "
               "per GPU; TF32 taken as B200's", sms=160, tdp_w=1100.0, matmul_share=MAMF["b300"][0],
               fp8_share=MAMF["b300"][1], architecture="blackwell"),
    DeviceSpec("gb200", ("GB200",), 2500.0, 5000.0, 1250.0, 13.4e3 / 72 * NVML_SHARE, 8.0, 900, 50,
               "[gb200] GB200 NVL72's B200 at 1,200 W, Grace-hosted", sms=148, tdp_w=1200.0,
               matmul_share=MAMF["gb200"][0], fp8_share=MAMF["gb200"][1], architecture="blackwell", host_cpu="grace"),
    DeviceSpec("gb300", ("GB300",), 2500.0, 5000.0, 1250.0, 20e3 / 72 * NVML_SHARE, 8.0, 900, 100,
               "[gb300] GB300 NVL72's Blackwell Ultra at 1,400 W, Grace-hosted; its matmul shares B300's scaled "
               "as GB200's are B200's [mamf]", sms=160, tdp_w=1400.0, matmul_share=MAMF["gb300"][0],
               fp8_share=MAMF["gb300"][1], architecture="blackwell", host_cpu="grace"),
)}


@dataclass(frozen=True)
class Efficiency:
    """What a spec sheet does not say. NCCL's bus bandwidth over NVLink is 0.8 of the datasheet's, as
    NCCL's own topology model rates a link (NVIDIA/nccl src/graph/topo.h at b6475625: SM80_NVLINK_BW
    20.0 and SM90_NVLINK_BW 20.6 GB/s of Ampere's and Hopper's 25 per direction, and at 5067397c
    SM100_NVLINK_BW 40.1 of Blackwell's 50: 0.80, 0.82, 0.80); XLA's measurements of NCCL's
    collectives reach less in 8-GPU nodes (benchmarks/bench_parts.py; taken in its place, it
    scored worse: BENCHMARKS.md). Over the network, 0.9 of the NIC's is an assumption; the
    latencies, a ring step's under NCCL's Simple protocol (large messages), are [nccl]'s.
    `compute_scale` is the one fitted term: a block's time over the sum of its parts as perf.model.block
    prices them (what they leave out: kernels slowing each other and NCCL's, the framework's own
    work), fitted by benchmarks/published on its fitting set, each source weighing the same
    (245 rows: 7 declared, one per source and precision, and 238 moved there after the model was
    changed for them or their layouts were derived, LLM Foundry's every row among them;
    BENCHMARKS.md)."""

    compute_scale: float = 1.287
    nvlink: float = 0.8
    network: float = 0.9
    latency_nvlink_s: float = NVLINK_STEP_S["ring"][SIMPLE]  # per ring step inside a node
    latency_network_s: float = NET_STEP_S["ring"][SIMPLE]  # per ring step between nodes


def _collective(op: str, g: int, bandwidth: float, model: NcclModel, nodes: int = 1) -> Line:
    """Ring algorithms, as NCCL runs them with its Simple protocol, in seconds by the bytes of the
    full buffer: all-gather and reduce-scatter move (g-1)/g of it over each link, all-reduce twice
    that; send/recv all of it once; at `model`'s latency for g ranks over `nodes` nodes."""
    factor = 1.0 if op == "send_recv" else 2 * (g - 1) / g if op == "all_reduce" else (g - 1) / g
    latency, per_unit = model.lines(op, g, nodes, factor / bandwidth)[0]
    return Line(latency, per_unit)




def spec_profile(spec: DeviceSpec, world: int, gpus_per_node: int, eff: Efficiency = Efficiency(),
                 attention: str | None = None) -> MachineProfile:
    """The profile of `world` such GPUs, `gpus_per_node` to a node, from the spec sheet. Its
    blocks are priced from their parts (perf.model.block) at the spec's kernel rates (`kernels`, attention
    by the kernel named, perf.rates.kernels.ATTENTION, or else the one PyTorch SDPA runs on it,
    perf.rates.kernels.SDPA_KERNEL); its matmul lines are the same rates, for what reads
    them directly."""
    nodes = max(1, world // gpus_per_node)
    kernels = spec_kernels(spec, attention)
    gemm = {dtype: Line(10e-6, 1 / (tflops * 1e12)) for dtype, tflops in kernels.matmul_tflops.items()}
    nccl = NcclModel(eff.latency_nvlink_s, eff.latency_network_s)
    sizes = sorted({g for g in range(2, world + 1) if world % g == 0 and g <= gpus_per_node} | {2})
    intra = {op: {g: _collective(op, g, spec.nvlink_gb_s * 1e9 * eff.nvlink, nccl) for g in sizes}
             for op in COLLECTIVES}
    node_sizes = sorted({g for g in range(2, nodes + 1) if nodes % g == 0} | {2})
    inter = {op: {g: _collective(op, g, spec.network_gb_s * 1e9 * eff.network, nccl, g)  # one rank a node
                  for g in node_sizes} for op in COLLECTIVES} if nodes > 1 else {}
    adam_bytes = 4 * 7  # AdamW on fp32: param, grad and two moments read, param and moments written
    return MachineProfile(
        key=machine_key(spec.name, "nccl", world, 1, nodes), source="spec", created=time.strftime("%Y-%m-%dT%H:%M:%S"),
        concurrency=float(world), gemm=gemm, collectives=intra, inter_node=inter,
        optimizer_s_per_param=adam_bytes / hbm(kernels), step_overhead_s=5e-3,
        corrections=Corrections(compute=eff.compute_scale), kernels=kernels,
        nccl=nccl,
        notes=[f"from the spec sheet of {spec.name}: {spec.source}", f"efficiency {dataclasses.asdict(eff)}"],
    )


def spec_for(device: str) -> DeviceSpec:
    """The spec named `device` (a key of SPECS), or an error naming them."""
    if device not in SPECS:
        raise ValueError(f"--device {device!r}: no spec sheet for it; choose from {', '.join(SPECS)}")
    return SPECS[device]


def profile_for(device: str, world: int, gpus_per_node: int, folder=None) -> MachineProfile:
    """A calibrated profile of this device at this world size (and node count) if one was made
    on it, else the spec sheet's."""
    spec = spec_for(device)
    nodes = max(1, world // gpus_per_node)
    for cuda_name in spec.cuda_names:
        measured = (find(f"NVIDIA {cuda_name}", "nccl", world, 1, folder, nodes)
                    or find(cuda_name, "nccl", world, 1, folder, nodes))
        if measured is not None and measured.source == "calibrated":
            return measured
    return spec_profile(spec, world, gpus_per_node)


