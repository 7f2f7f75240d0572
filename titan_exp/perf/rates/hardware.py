"""`cluster.hardware=FILE`: the GPUs a job's ranks run on, described in a hardware file (the YAML
that `python -m titan_exp.perf.plan --hardware` reads, titan_exp.perf.rates.hardware.load_hardware). The
file's profile replaces this machine's in every prediction made for the job: autotune's candidates
and its memory limit, the dry run's predicted step, cluster.elastic's re-plan, and the predicted
step the launcher logs before the ranks start.

The job's nodes are its own (cluster.nnodes, and the ranks on each); the file's `gpus_per_node` is
what a node holds, so a job may put fewer ranks on a node, never more. The device memory a
prediction is checked against is autotune.device_memory_gib when set, else the file's GPU's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from titan_exp.config import Executor, JobConfig, problem
from titan_exp.perf.rates.devices import SPECS, DeviceSpec, Efficiency, spec_profile
from titan_exp.perf.rates.kernels import HOST_CPU, clock_ratio
from titan_exp.perf.rates.profile import MachineProfile

# A user's cluster in one file (`python -m titan_exp.perf.plan ... --hardware FILE`): its GPU (a spec
# name above, or its numbers) and what a spec sheet cannot know about the cluster it sits in.
SPEC_NUMBERS = ("bf16_tflops", "fp8_tflops", "tf32_tflops", "memory_gib", "memory_tb_s", "tdp_w", "sms",
                "matmul_share", "fp8_share")
OPTIONAL_NUMBERS = {"fp8_tflops": "no FP8", "tdp_w": "700 W", "sms": "132", "matmul_share": "H100's 0.803",
                    "fp8_share": "matmul_share"}
HARDWARE_KEYS = {
    "device": "a spec name (" + ", ".join(SPECS) + ") or a mapping of its numbers: " + ", ".join(SPEC_NUMBERS),
    "gpus_per_node": "GPUs per node (an integer > 0)",
    "nvlink_gb_s": f"GB/s per GPU and direction inside a node (the datasheet's; NCCL reaches {Efficiency.nvlink} "
                   "of it)",
    "network_gb_s": f"GB/s per GPU and direction between nodes (the NIC's; NCCL taken to reach {Efficiency.network} "
                    "of it)",
    "nvlink_bus_gb_s": "NCCL's bus bandwidth inside a node as measured there (nccl-tests' busbw of a large "
                       "all-gather over a node's GPUs), GB/s, taken as it is: in place of nvlink_gb_s",
    "network_bus_gb_s": "NCCL's bus bandwidth between nodes as measured there (nccl-tests' busbw of a large "
                        "all-gather with one rank a node), GB/s, taken as it is: in place of network_gb_s",
    "latency_nvlink_us": "a ring step's latency inside a node for large messages (NCCL's Simple protocol; "
                         "3.4), microseconds",
    "latency_network_us": "a ring step's latency between nodes for large messages (Simple; 14), microseconds",
    "power_limit_w": "the GPUs' power limit, watts: below the TDP it lowers the SM clock "
                     "(perf.rates.kernels.clock_ratio)",
    "host_cpu": "the CPU the ranks' Python runs on, " + " or ".join(HOST_CPU) + ": its host time per op (perf."
                "rates.kernels.HOST_CPU; a named device's own by default: grace for "
                + " and ".join(name for name, s in SPECS.items() if s.host_cpu == "grace") + ", else x86)",
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
        clock = (f" (SM clock {clock_ratio(self.spec):.2f} of the {self.spec.tdp_w:.0f} W TDP's)"
                 if "power_limit_w" in self.from_file else "")
        rest = (f"the rest from the spec sheet of {self.spec.name}" if self.spec.name in SPECS
                else "the rest as perf.rates.devices assumes for any GPU")
        return f"hardware from {self.path}: {given}{clock}; {rest}"


def _positive(path: str, key: str, value: object, *, integer: bool = False) -> float:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or value <= 0:
        raise ValueError(f"{path}: {key} = {value!r}: must be a {'whole number' if integer else 'number'} > 0")
    return value


def load_hardware(path: str | Path) -> Hardware:
    """The cluster a hardware file describes, or a ValueError naming the file, the key, the value
    and what it should be. Every key is used; none is ignored (an unknown one is refused)."""
    path = str(path)
    data = _read(path)
    spec = _device(path, data["device"])
    spec, eff = _links(path, data, spec)
    if "power_limit_w" in data:
        spec = dataclasses.replace(spec, power_limit_w=_positive(path, "power_limit_w", data["power_limit_w"]))
    if "host_cpu" in data:
        if data["host_cpu"] not in HOST_CPU:
            raise ValueError(f"{path}: host_cpu = {data['host_cpu']!r}: choose from {', '.join(HOST_CPU)}")
        spec = dataclasses.replace(spec, host_cpu=data["host_cpu"])
    for key, field in (("latency_nvlink_us", "latency_nvlink_s"), ("latency_network_us", "latency_network_s")):
        if key in data:
            eff = dataclasses.replace(eff, **{field: _positive(path, key, data[key]) * 1e-6})
    per_node = 8
    if "gpus_per_node" in data:
        per_node = int(_positive(path, "gpus_per_node", data["gpus_per_node"], integer=True))
    return Hardware(spec, eff, per_node, dict(data), path)


def _read(path: str) -> dict:
    """The file's mapping, with `device` and known keys only."""
    import yaml

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
    return data


def _device(path: str, device: object) -> DeviceSpec:
    """The GPU `device` names (a spec sheet) or describes (its numbers)."""
    if isinstance(device, str):
        if device not in SPECS:
            raise ValueError(f"{path}: device = {device!r}: no spec sheet for it; choose from {', '.join(SPECS)}, "
                             f"or give its numbers ({', '.join(SPEC_NUMBERS)})")
        return SPECS[device]
    if not isinstance(device, dict):
        raise ValueError(f"{path}: device = {device!r}: {HARDWARE_KEYS['device']}")
    wrong = sorted(set(device) - set(SPEC_NUMBERS))
    missing = [k for k in SPEC_NUMBERS if k not in device and k not in OPTIONAL_NUMBERS]
    if wrong or missing:
        raise ValueError(f"{path}: device: {'unknown ' + ', '.join(wrong) + '; ' if wrong else ''}"
                         f"{'missing ' + ', '.join(missing) + '; ' if missing else ''}"
                         f"a device's numbers are {', '.join(SPEC_NUMBERS)} (left out: "
                         + ", ".join(f"{k} = {v}" for k, v in OPTIONAL_NUMBERS.items()) + ")")
    numbers = {k: _positive(path, f"device.{k}", v, integer=k == "sms") for k, v in device.items()}
    for share in ("matmul_share", "fp8_share"):
        if numbers.get(share, 0.5) > 1:
            raise ValueError(f"{path}: device.{share} = {numbers[share]!r}: a share of the peak, at most 1")
    return DeviceSpec("custom", (), numbers.pop("bf16_tflops"), numbers.pop("fp8_tflops", None),
                      numbers.pop("tf32_tflops"), numbers.pop("memory_gib"), numbers.pop("memory_tb_s"), 0.0, 0.0,
                      f"the numbers in {path}", **numbers)


def _links(path: str, data: dict, spec: DeviceSpec) -> tuple[DeviceSpec, Efficiency]:
    """The links' rates: the datasheet's (NCCL taken to reach a share of them) or NCCL's measured bus
    bandwidth (taken whole), inside a node and between nodes."""
    eff, links = Efficiency(), {}
    for link, bus, share in (("nvlink_gb_s", "nvlink_bus_gb_s", "nvlink"),
                             ("network_gb_s", "network_bus_gb_s", "network")):
        if link in data and bus in data:
            raise ValueError(f"{path}: {link} = {data[link]!r} and {bus} = {data[bus]!r}: give one, the link's rate "
                             f"(NCCL taken to reach {getattr(eff, share)} of it) or NCCL's measured bus bandwidth")
        if link in data:
            links[link] = _positive(path, link, data[link])
        elif bus in data:  # the links at NCCL's measured rate, whole
            links[link], eff = _positive(path, bus, data[bus]), dataclasses.replace(eff, **{share: 1.0})
    if spec.name == "custom" and len(links) < 2:
        raise ValueError(f"{path}: a device given by its numbers needs nvlink_gb_s (or nvlink_bus_gb_s) and "
                         "network_gb_s (or network_bus_gb_s) too")
    return dataclasses.replace(spec, **links), eff


FIELD = "cluster.hardware"


def read(job: JobConfig) -> Hardware | None:
    """The job's hardware file, read (None without one), or a ValueError naming cluster.hardware,
    its value, what is wrong and the fix."""
    value = job.cluster.hardware
    if value is None:
        return None
    if not Path(value).expanduser().is_file():
        raise ValueError(problem(FIELD, value, "no such file; give the path of a hardware YAML (keys: "
                                 + ", ".join(HARDWARE_KEYS) + "), or null to predict from this machine's profile"))
    try:
        return load_hardware(Path(value).expanduser())
    except ValueError as exc:
        raise ValueError(problem(FIELD, value, str(exc).removeprefix("--hardware "))) from None


def checked(job: JobConfig) -> tuple[Hardware | None, list[str]]:
    """The job's hardware file, read once (None without one), and why the job cannot use it: the
    file itself, ranks on CPUs (the file describes GPUs; a dry run, which only predicts for them,
    may run anywhere), or more ranks on a node than the file's nodes hold."""
    from titan_exp.validation import ranks_have_gpus

    try:
        hardware = read(job)
    except ValueError as exc:
        return None, [str(exc)]
    if hardware is None:
        return None, []
    value, c = job.cluster.hardware, job.cluster
    e = []
    if not c.dry_run and not ranks_have_gpus(job):
        where = "cluster.gpus_per_node = 0" if c.executor == Executor.slurm else "this machine has no GPU"
        e.append(problem(FIELD, value, f"the file describes GPUs, and this job's ranks run on CPUs ({where}); "
                         "run it where the file's GPUs are, or dry-run it (cluster.dry_run=true), or remove "
                         "cluster.hardware"))
    held = hardware.from_file.get("gpus_per_node")
    per_node = math.ceil(job.world_size / c.nnodes)
    if held is not None and per_node > held:
        nodes = math.ceil(job.world_size / held)
        e.append(problem(FIELD, value, f"its nodes hold gpus_per_node {held} GPUs, and the job puts {per_node} ranks "
                         f"on each of its {c.nnodes} node(s), one per GPU; set cluster.nnodes={nodes} "
                         f"cluster.nproc_per_node={held}" + ("" if job.world_size % held == 0 else
                                                              f" (and a world size divisible by {held})")))
    return hardware, e


def profile(job: JobConfig, hardware: Hardware, world: int | None = None) -> MachineProfile:
    """The machine profile of `world` (default: the job's) such GPUs, on the job's nodes."""
    world = world or job.world_size
    return spec_profile(hardware.spec, world, max(1, world // job.cluster.nodes_for(world)), hardware.efficiency)


def memory_gib(job: JobConfig, hardware: Hardware) -> float:
    """Memory per device the predictions are checked against: autotune.device_memory_gib, else the file's GPU's."""
    return job.autotune.device_memory_gib or hardware.spec.memory_gib


