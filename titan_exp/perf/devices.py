"""GPUs a user plans for before having them: spec-sheet numbers, each with its source, turned into
a machine profile the performance model reads like a calibrated one.

    python -m titan_exp.perf.plan model=llama3_8b --device h100 --world 512 --gpus-per-node 8

A profile calibrated on the real device (`python -m titan_exp.perf.calibrate` on that GPU) replaces the
spec one wherever both exist (`profile_for`). A spec sheet gives peaks; what a training step
achieves of them is the `Efficiency` below, whose values are assumptions until fitted to
published runs (issue 19), and the profile's `source` says "spec" so every table built from it
says its numbers are predicted from a spec sheet.

Sources (checked 2026-11):
  [h100]  NVIDIA H100 Tensor Core GPU datasheet, SXM5 column:
          https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
  [h200]  NVIDIA H200 Tensor Core GPU datasheet, SXM column: https://www.nvidia.com/en-us/data-center/h200/
  [a100]  NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column:
          https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
  [b200]  NVIDIA DGX B200 datasheet (8 GPUs; per-GPU values are the system's divided by 8):
          https://resources.nvidia.com/en-us-dgx-systems/dgx-b200-datasheet
  [titan] TorchTitan's benchmark machines, docs/performance.md in pytorch/torchtitan: Grand Teton
          hosts of 8 H100 with 96 GB HBM2e at 2.4 TB/s, NVLink, 400 Gb/s RDMA per GPU, the
          default 500 W power limit.
  [nccl]  Latencies are not on spec sheets: the small-message times of nccl-tests' all_reduce
          on NVLink (~10 us) and over InfiniBand (~20 us per hop), as NVIDIA's published
          nccl-tests runs show; rounded, and the same for every GPU of a generation.
Bandwidths are per GPU and per direction (NVLink's datasheet figure is both directions added:
900 GB/s on Hopper is 450 each way); the network is one NIC per GPU.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from titan_exp.perf.profile import COLLECTIVES, Line, MachineProfile, machine_key

GIB = 2**30


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    cuda_names: tuple[str, ...]  # what torch.cuda.get_device_name() says for it
    bf16_tflops: float  # dense, tensor cores
    fp8_tflops: float | None  # dense; None where the GPU has no FP8 tensor cores
    tf32_tflops: float  # dense: what fp32 matmuls run at (TF32)
    memory_gib: float
    memory_tb_s: float
    nvlink_gb_s: float  # per GPU, per direction
    network_gb_s: float  # per GPU, per direction, between nodes
    source: str


SPECS: dict[str, DeviceSpec] = {s.name: s for s in (
    DeviceSpec("h100", ("H100 80GB HBM3", "H100 SXM"), 989.4, 1978.9, 494.7, 80 * 1e9 / GIB, 3.35, 450, 50,
               "[h100] SXM5 700 W; NDR 400 Gb/s per GPU"),
    DeviceSpec("h100_500w", ("H100",), 989.4, 1978.9, 494.7, 96 * 1e9 / GIB, 2.4, 450, 50,
               "[titan] the H100 TorchTitan's tables were measured on: 96 GB HBM2e at 2.4 TB/s, 500 W cap "
               "(the cap lowers sustained clocks, which the fitted efficiency absorbs; the peaks are [h100]'s)"),
    DeviceSpec("h200", ("H200",), 989.4, 1978.9, 494.7, 141 * 1e9 / GIB, 4.8, 450, 50,
               "[h200] SXM; NDR 400 Gb/s per GPU"),
    DeviceSpec("a100", ("A100-SXM4-80GB", "A100 80GB"), 312.0, None, 156.0, 80 * 1e9 / GIB, 2.039, 300, 25,
               "[a100] 80GB SXM; HDR 200 Gb/s per GPU"),
    DeviceSpec("a100_40gb", ("A100-SXM4-40GB", "A100 40GB"), 312.0, None, 156.0, 40 * 1e9 / GIB, 1.555, 300, 25,
               "[a100] 40GB SXM; HDR 200 Gb/s per GPU"),
    DeviceSpec("b200", ("B200",), 2250.0, 4500.0, 1100.0, 180 * 1e9 / GIB, 8.0, 900, 50,
               "[b200] DGX B200: 72/144 PFLOPS FP8 dense/sparse and 1,440 GB HBM3e for 8 GPUs, NVLink 5 "
               "(1.8 TB/s both directions), ConnectX-7 400 Gb/s per GPU"),
)}


@dataclass(frozen=True)
class Efficiency:
    """What a training step achieves of the spec's peaks. The compute terms were fitted to
    TorchTitan's Llama 3.1 8B rows on 8 H100s (benchmarks/bench_torchtitan.py; BENCHMARKS.md has
    the fit and its check on the other published rows); the communication ones are assumptions
    (NCCL's bus bandwidth ~80 % of NVLink's and ~90 % of the NIC's), not fitted: on those rows
    compute dominates, so they could not be told apart."""

    matmul: float = 0.715  # bf16 (and TF32) matmul FLOP/s over the spec's peak
    float8_matmul: float = 0.773  # float8 matmuls over the FP8 peak
    compile_speedup: float = 1.161  # eager block time over compiled
    nvlink: float = 0.8
    network: float = 0.9
    latency_nvlink_s: float = 10e-6
    latency_network_s: float = 20e-6  # per ring hop between nodes
    overlap: float = 0.8  # share of FSDP's communication hidden behind compute (prefetch)


def _collective(op: str, g: int, bandwidth: float, hop_s: float) -> Line:
    """Ring algorithms, as NCCL runs them, in seconds by the bytes of the full buffer: all-gather
    and reduce-scatter move (g-1)/g of it over each link, all-reduce twice that; send/recv all
    of it once."""
    if op == "send_recv":
        return Line(hop_s, 1 / bandwidth)
    factor = 2 * (g - 1) / g if op == "all_reduce" else (g - 1) / g
    steps = 2 * (g - 1) if op == "all_reduce" else g - 1
    return Line(hop_s * steps, factor / bandwidth)


def spec_profile(spec: DeviceSpec, world: int, gpus_per_node: int, eff: Efficiency = Efficiency()) -> MachineProfile:
    """The profile of `world` such GPUs, `gpus_per_node` to a node, from the spec sheet."""
    nodes = max(1, world // gpus_per_node)
    def rate(tflops: float, efficiency: float) -> Line:
        return Line(10e-6, 1 / (tflops * 1e12 * efficiency))

    gemm = {"float32": rate(spec.tf32_tflops, eff.matmul), "bfloat16": rate(spec.bf16_tflops, eff.matmul)}
    if spec.fp8_tflops:
        gemm["float8"] = rate(spec.fp8_tflops, eff.float8_matmul)
    sizes = sorted({g for g in range(2, world + 1) if world % g == 0 and g <= gpus_per_node} | {2})
    intra = {op: {g: _collective(op, g, spec.nvlink_gb_s * 1e9 * eff.nvlink, eff.latency_nvlink_s) for g in sizes}
             for op in COLLECTIVES}
    node_sizes = sorted({g for g in range(2, nodes + 1) if nodes % g == 0} | {2})
    inter = {op: {g: _collective(op, g, spec.network_gb_s * 1e9 * eff.network, eff.latency_network_s)
                  for g in node_sizes} for op in COLLECTIVES} if nodes > 1 else {}
    adam_bytes = 4 * 4 * 2  # param, grad and two moments, fp32, each read and written
    return MachineProfile(
        key=machine_key(spec.name, "nccl", world, 1, nodes), source="spec", created=time.strftime("%Y-%m-%dT%H:%M:%S"),
        concurrency=float(world), overlap=eff.overlap, gemm=gemm, collectives=intra, inter_node=inter,
        optimizer_s_per_param=adam_bytes / (spec.memory_tb_s * 1e12 * 0.7), step_overhead_s=5e-3,
        compile_speedup=eff.compile_speedup,
        notes=[f"from the spec sheet of {spec.name}: {spec.source}", f"efficiency {dataclasses.asdict(eff)}"],
    )


def spec_for(device: str) -> DeviceSpec:
    """The spec named `device` (h100, h100_500w, h200, a100, a100_40gb, b200), or an error naming them."""
    if device not in SPECS:
        raise ValueError(f"--device {device!r}: no spec sheet for it; choose from {', '.join(SPECS)}")
    return SPECS[device]


def profile_for(device: str, world: int, gpus_per_node: int, folder=None) -> MachineProfile:
    """A calibrated profile of this device at this world size (and node count) if one was made
    on it, else the spec sheet's."""
    from titan_exp.perf.profile import find

    spec = spec_for(device)
    nodes = max(1, world // gpus_per_node)
    for cuda_name in spec.cuda_names:
        measured = find(f"NVIDIA {cuda_name}", "nccl", world, 1, folder, nodes) or find(cuda_name, "nccl", world, 1, folder, nodes)
        if measured is not None and measured.source == "calibrated":
            return measured
    return spec_profile(spec, world, gpus_per_node)


# A user's cluster in one file (`python -m titan_exp.perf.plan ... --hardware FILE`): its GPU (a spec
# name above, or its numbers) and what a spec sheet cannot know about the cluster it sits in.
SPEC_NUMBERS = ("bf16_tflops", "fp8_tflops", "tf32_tflops", "memory_gib", "memory_tb_s")
HARDWARE_KEYS = {
    "device": "a spec name (" + ", ".join(SPECS) + ") or a mapping of its numbers: " + ", ".join(SPEC_NUMBERS),
    "gpus_per_node": "GPUs per node (an integer > 0)",
    "nvlink_gb_s": "GB/s per GPU and direction inside a node",
    "network_gb_s": "GB/s per GPU and direction between nodes",
    "latency_nvlink_us": "a collective step's latency inside a node, microseconds",
    "latency_network_us": "a ring hop's latency between nodes, microseconds",
    "power_limit_w": "the GPUs' power limit, watts",
}


@dataclass(frozen=True)
class Hardware:
    """A cluster read from a hardware file: the spec to plan with, the efficiency terms it set,
    GPUs per node, and which values the file gave (for the plan to say)."""

    spec: DeviceSpec
    efficiency: Efficiency
    gpus_per_node: int
    from_file: dict[str, object]
    path: str

    def line(self) -> str:
        given = ", ".join(f"{k} {v}" for k, v in self.from_file.items())
        return f"hardware from {self.path}: {given}; the rest from the spec sheet of {self.spec.name}"


def _positive(path: str, key: str, value: object, *, integer: bool = False) -> float:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or value <= 0:
        raise ValueError(f"{path}: {key} = {value!r}: must be a {'whole number' if integer else 'number'} > 0")
    return value


def load_hardware(path: str | Path) -> Hardware:
    """The cluster a hardware file describes, or a ValueError naming the file, the key, the value
    and what it should be. Every key is used; none is ignored (an unknown one is refused)."""
    import yaml

    path = str(path)
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--hardware {path}: cannot read it as YAML ({exc})") from None
    if not isinstance(data, dict) or "device" not in data:
        raise ValueError(f"{path}: needs a mapping with at least `device`; keys: "
                         + "; ".join(f"{k} ({v})" for k, v in HARDWARE_KEYS.items()))
    unknown = sorted(set(data) - set(HARDWARE_KEYS))
    if unknown:
        import difflib

        hints = [f"{k} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(k, HARDWARE_KEYS, 1)) else k
                 for k in unknown]
        raise ValueError(f"{path}: unknown key(s) {', '.join(hints)}; the keys are {', '.join(HARDWARE_KEYS)}")
    if "power_limit_w" in data:
        raise ValueError(f"{path}: power_limit_w = {data['power_limit_w']!r}: not modelled yet (sustained clocks under "
                         "a power cap are issue 36's next part); remove it, and for TorchTitan's 500 W H100 use "
                         "device: h100_500w, whose efficiencies were fitted at that cap")
    device = data["device"]
    if isinstance(device, str):
        if device not in SPECS:
            raise ValueError(f"{path}: device = {device!r}: no spec sheet for it; choose from {', '.join(SPECS)}, "
                             f"or give its numbers ({', '.join(SPEC_NUMBERS)})")
        spec = SPECS[device]
    elif isinstance(device, dict):
        wrong = sorted(set(device) - set(SPEC_NUMBERS))
        missing = [k for k in SPEC_NUMBERS if k not in device and k != "fp8_tflops"]
        if wrong or missing:
            raise ValueError(f"{path}: device: {'unknown ' + ', '.join(wrong) + '; ' if wrong else ''}"
                             f"{'missing ' + ', '.join(missing) + '; ' if missing else ''}"
                             f"a device's numbers are {', '.join(SPEC_NUMBERS)} (fp8_tflops may be left out: no FP8)")
        numbers = {k: _positive(path, f"device.{k}", v) for k, v in device.items()}
        spec = DeviceSpec("custom", (), numbers["bf16_tflops"], numbers.get("fp8_tflops"), numbers["tf32_tflops"],
                          numbers["memory_gib"], numbers["memory_tb_s"], 0.0, 0.0, f"the numbers in {path}")
    else:
        raise ValueError(f"{path}: device = {device!r}: {HARDWARE_KEYS['device']}")
    links = {k: _positive(path, k, data[k]) for k in ("nvlink_gb_s", "network_gb_s") if k in data}
    if spec.name == "custom" and len(links) < 2:
        raise ValueError(f"{path}: a device given by its numbers needs nvlink_gb_s and network_gb_s too")
    spec = dataclasses.replace(spec, **links)
    eff = Efficiency()
    for key, field in (("latency_nvlink_us", "latency_nvlink_s"), ("latency_network_us", "latency_network_s")):
        if key in data:
            eff = dataclasses.replace(eff, **{field: _positive(path, key, data[key]) * 1e-6})
    per_node = int(_positive(path, "gpus_per_node", data["gpus_per_node"], integer=True)) if "gpus_per_node" in data else 8
    return Hardware(spec, eff, per_node, dict(data), path)
