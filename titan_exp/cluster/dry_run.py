"""`cluster.dry_run=true`: one rank of a layout of any size, alone, on this machine.

    python launch.py model=llama3_8b parallelism.tensor_parallel_degree=8 cluster.nnodes=64 \
        cluster.nproc_per_node=8 cluster.dry_run=true cluster.dry_run_rank=0

Rank `cluster.dry_run_rank` of the nnodes x nproc_per_node ranks runs as one process here, on
torch's fake process group (TorchTitan's fake backend): every collective returns at once without
moving data and no other rank exists. The real model, parallelism (device mesh, FSDP, TP, PP
stages, CP, EP) and optimizer are built for that rank, and two real training steps run on its
share of the data. The first makes what a run allocates once (the optimizer's state). The run's summary
records what the rank holds (parameters, gradients, optimizer state: its shards) and its peak
memory during the second step, two ways: the peak bytes of live tensor storage (counted by a
dispatch mode, so on any device) and the device's own (the caching allocator's reserved peak on
a GPU, the process's resident high-water mark on a CPU). Beside them are the planner's prediction
(titan_exp.perf.model.memory) and, apart, the peak while the model was built and initialised. Values
that collectives computed (the loss, the gradient norm) are meaningless under the fake group;
memory and shapes are not. With cluster.hardware the report adds the layout's predicted step
time and this rank's predicted memory on the GPUs the file describes, beside its device memory,
and the line saying which values came from the file. Nothing is submitted and no checkpoint,
validation, evaluation or tracker is touched. The weights are drawn for the rank's shards alone
(`shard_draws`), so the build peak leaves out the whole parameter a real run draws before cutting its
shard. The process prints each part (the build's, each step) with its seconds as it ends, whichever
rank it is; the launcher prints the table from the summary, once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from titan_exp.cluster.env import checkout_path
from titan_exp.config import JobConfig, OnNonfinite, layout_label, load_job_config
from titan_exp.config.cluster import rank_env
from titan_exp.record import RunDir, RunSummary, Status

logger = logging.getLogger("titan_exp")


def run_dry(job: JobConfig, run_dir: RunDir) -> Optional[str]:
    """Run the rank as its own process, so that its peak memory is its own and not the
    launcher's; None, or what went wrong."""
    import torch

    rank = job.cluster.dry_run_rank
    env = {**os.environ, **rank_env(job.cluster, threads=torch.get_num_threads(), gpu=torch.cuda.is_available()),
           "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(job.world_size), "LOCAL_WORLD_SIZE": "1",
           **checkout_path()}
    done = subprocess.run([sys.executable, "-m", "titan_exp.cluster.dry_run", str(run_dir.path)], env=env)
    return None if done.returncode == 0 else f"rank {rank} (dry run): exit code {done.returncode}"


def dry_job(job: JobConfig) -> JobConfig:
    """The job as the dry run trains it: two steps that always update, and nothing written beside
    the summary and the log. The first makes what a run allocates once (the optimizer's state, which it
    creates at its first update); the second is measured, as every later step of a run would be."""
    return dataclasses.replace(
        job,
        training=dataclasses.replace(job.training, steps=2, on_nonfinite=OnNonfinite.stop),
        checkpoint=dataclasses.replace(job.checkpoint, enable=False, initial_load_path=None),
        validation=dataclasses.replace(job.validation, enable=False),
        eval=dataclasses.replace(job.eval, enable=False, tasks=[]),
        metrics=dataclasses.replace(job.metrics, enable_wandb=False, enable_tensorboard=False),
    )


@contextlib.contextmanager
def neighbours_metadata(job: JobConfig) -> Iterator[None]:
    """Under PP, torch's PipelineStage learns its input shapes from the previous stage and its
    output gradients' from the next one, sent as pickled metadata at the first step. Under the
    fake group nothing arrives (the unpickler reads garbage), so this supplies what the
    neighbours would send: the hidden state between stages (a microbatch of this rank's
    positions, its sequence split by tp under sequence parallel; float32 unless the parameters
    are bf16) and its gradient, which has the same shape. The patch uses torch's private
    pipelining metadata types (torch 2.13); without them the dry run of a PP layout fails there."""
    import torch
    from torch.distributed.pipelining._utils import _StageBackwardMeta, _StageForwardMeta, extract_tensor_metas
    from torch.distributed.pipelining.stage import PipelineStage

    p, t = job.parallelism, job.training
    seq = t.seq_len // p.context_parallel_degree // p.tensor_parallel_degree
    hidden = torch.empty(p.pipeline_parallel_microbatch_size, seq, job.model.dim, device="meta",
                         dtype=torch.bfloat16 if job.precision.full_bf16 else torch.float32)
    metas = extract_tensor_metas((hidden,))

    def recv_meta(stage, src_stage: int):
        return _StageForwardMeta(metas) if src_stage < stage.stage_index else _StageBackwardMeta(metas)

    original = PipelineStage._recv_meta
    PipelineStage._recv_meta = recv_meta
    try:
        yield
    finally:
        PipelineStage._recv_meta = original


@contextlib.contextmanager
def balanced_expert_counts() -> Iterator[None]:
    """Under EP each rank learns from the others how many tokens they route to its experts (a
    count all-to-all) and sizes the token all-to-all by it; the fake group returns no counts. The
    rank alone assumes balanced routing, as the planner does: every source sends each expert its
    share of the rows it routes. (Its own counts would not do: the fake group's all-gathers leave
    the gathered weights unwritten, the router may send every token to the same few experts, and
    the rank's own may get none of its rows, its return all-to-all then nothing to send back: a
    128-expert layer at EP 8 did.)"""
    import torch

    from titan_exp.models.moe import MoE

    def counts_from_self(self, counts_E):
        ep = self.ep_mesh.size()
        share = int(counts_E.sum()) // counts_E.numel()  # a host sync: one rank on a CPU
        return torch.full((ep, counts_E.numel() // ep), share, dtype=counts_E.dtype, device=counts_E.device)

    original = MoE._exchange_counts
    MoE._exchange_counts = counts_from_self
    try:
        yield
    finally:
        MoE._exchange_counts = original


@contextlib.contextmanager
def shard_draws() -> Iterator[None]:
    """The model's init draws each rank's shards alone instead of every parameter in full
    (`Transformer.draw_in_full`): the values do not matter under the fake group, and the full draws
    cost a rank of a large model minutes for the 1/64 or less of them that it keeps (rank 0 of a
    512-rank 70B layout, its embedding and one block: about 2 CPU-minutes and a 8.7 GiB peak, where
    its shards take seconds and 0.6 GiB)."""
    from titan_exp.models.llama import Transformer

    Transformer.draw_in_full = False
    try:
        yield
    finally:
        Transformer.draw_in_full = True


def tensor_peak():
    """A TorchDispatchMode that keeps the peak bytes of live tensor storage (see `TensorPeak`)."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
    from torch.utils._pytree import tree_leaves

    class TensorPeak(TorchDispatchMode):
        """The peak bytes of live tensor storage during the step: on a GPU, what torch's caching
        allocator reports as allocated (max_memory_allocated). A CPU needs it: there the resident
        set undercounts under the fake process group (a collective's output buffer that the fake
        group never writes is never touched, so never resident) and overcounts what glibc keeps
        after building the model. A storage counts from the op that makes it, or FSDP's `resize_`
        that allocates it, until it dies; the tensors `track`ed before the step count from the
        start."""

        def __init__(self) -> None:
            super().__init__()
            self.sizes: dict[int, int] = {}
            self.live = self.peak = 0
            self._resize = torch.UntypedStorage.resize_

        def track(self, tensor: torch.Tensor) -> None:
            if is_traceable_wrapper_subclass(tensor):  # DTensor, float8: their inner tensors
                for name in tensor.__tensor_flatten__()[0]:
                    inner = getattr(tensor, name)
                    if isinstance(inner, torch.Tensor):
                        self.track(inner)
                return
            self._count(tensor.untyped_storage())

        def _count(self, storage) -> None:
            key = storage._cdata
            if key not in self.sizes:
                self.sizes[key] = 0
                weakref.finalize(storage, self._set, key, None)  # no longer counted once it dies
            self._set(key, storage.nbytes())

        def _set(self, key: int, nbytes: int | None) -> None:
            self.live += (nbytes or 0) - self.sizes.get(key, 0)
            if nbytes is None:
                self.sizes.pop(key, None)
            else:
                self.sizes[key] = nbytes
            self.peak = max(self.peak, self.live)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    self.track(t)
            return out

        def __enter__(self):
            mode = self

            def resize_(storage, size):  # how FSDP allocates and frees gathered parameters: no op sees it
                mode._resize(storage, size)
                mode._count(storage)

            torch.UntypedStorage.resize_ = resize_
            return super().__enter__()

        def __exit__(self, *exc):
            torch.UntypedStorage.resize_ = self._resize
            return super().__exit__(*exc)

    return TensorPeak()


def peak_gib(device) -> float:
    """Peak memory since the last `reset_peak`: what torch's caching allocator reserved on a GPU;
    on a CPU the process's resident high-water mark (VmHWM, which Linux resets; ru_maxrss cannot
    be)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) / 2**20


def reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from what is resident now


def join_fake_group(rank: int, world: int):
    """This process as `rank` of `world` on torch's fake process group; its device."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    return device


def dry_step(job: JobConfig, run_dir: RunDir, rank: int, world: int, started: float) -> dict[str, Any]:
    """Build the rank and run its two steps, each part logged with its seconds as it ends (the
    first line counts from `started`, when `main` began); what it measured, beside the planner."""
    from titan_exp import targets
    from titan_exp.train.profiling import timed

    device = join_fake_group(rank, world)
    logger.info("dry run of rank %d of %d on %s: torch imported, fake process group up: %.1f s", rank, world,
                device.type, time.perf_counter() - started)
    dry = dry_job(job)
    with timed("the rank built (model, optimizer, data)"), shard_draws():
        trainer = targets.build(dry, "training", dry, run_dir, device)
    built = peak_gib(device)  # building and initialising the model: a transient the steps do not repeat
    tensors = two_steps(job, trainer, device)
    return measured(job, trainer, device, rank, world, {"tensor_peak_gib": tensors, "build_peak_gib": built})


def two_steps(job: JobConfig, trainer, device) -> float:
    """The first step (unmeasured: it makes the optimizer's state), then the measured one, from the same
    weights; the peak GiB of live tensors during the second (the process's peak is reset before it)."""
    import torch
    from torch.distributed.tensor import DTensor

    from titan_exp.train.profiling import timed

    tensors = tensor_peak()
    with contextlib.ExitStack() as patches:
        if job.parallelism.pipeline_parallel_degree > 1:
            patches.enter_context(neighbours_metadata(job))
        if job.parallelism.expert_parallel_degree > 1:
            patches.enter_context(balanced_expert_counts())
        # The fake group's collectives leave their outputs unwritten, so the first update leaves
        # garbage (NaN, say) in the weights, and an MoE router would then send every token to one
        # expert: the second step starts from the first one's weights and buffers.
        local = [t.to_local() if isinstance(t, DTensor) else t for part in trainer.model_parts
                 for t in (*part.parameters(), *part.buffers())]
        start = [t.detach().clone() for t in local]
        with timed("step 1 of 2 (makes the optimizer's state, not measured)"):
            trainer.train_step(trainer.loader.next_batch())
        with torch.no_grad():
            for t, saved in zip(local, start):
                t.copy_(saved)
        del start
        batch = trainer.loader.next_batch()
        reset_peak(device)
        optimizer_state = (v for o in trainer.optimizers for st in o.state.values() for v in st.values())
        for t in [*trainer.params, *(p.grad for p in trainer.params if p.grad is not None),
                  *(b for part in trainer.model_parts for b in part.buffers()),
                  *(v for v in optimizer_state if torch.is_tensor(v))]:
            tensors.track(t)  # what the step starts with
        with timed("step 2 of 2 (measured)"), tensors:
            trainer.train_step(batch)
    return tensors.peak / 2**30


def measured(job: JobConfig, trainer, device, rank: int, world: int, peaks: dict[str, float]) -> dict[str, Any]:
    """The report: what the rank holds, its peak during the step and `peaks` (the tensor and build
    peaks), beside the planner's prediction (with cluster.hardware also the layout's predicted step
    on the file's GPUs)."""
    from titan_exp.metrics import state_bytes_by_kind
    from titan_exp.perf.model.memory import predict_memory

    held = state_bytes_by_kind(trainer.params, trainer.optimizers)
    pp_rank = rank // (world // job.parallelism.pipeline_parallel_degree)  # pp is the mesh's outermost dim
    report = {
        "rank": rank, "world": world, "layout": layout_label(job.parallelism.layout), "device": str(device),
        "peak": "torch allocator, reserved" if device.type == "cuda" else "process resident set",
        "measured": {**held, "states_gib": sum(held.values()) / 2**30, "peak_gib": peak_gib(device), **peaks},
        "predicted": predict_memory(job, cuda=device.type == "cuda", pp_rank=pp_rank),
    }
    if job.cluster.hardware:  # the step and memory of this rank on the GPUs the file describes
        from titan_exp.perf.model.predict import prediction
        from titan_exp.perf.rates.hardware import read

        report["hardware"] = prediction(job, read(job), pp_rank=pp_rank)
    return report


def table(report: dict[str, Any]) -> str:
    """The dry run's numbers beside the planner's, as the launcher prints them."""
    from titan_exp.perf.model.memory import tensor_gib

    m, p = report["measured"], report["predicted"]
    gib = 2**30
    rows = [
        ("parameters (this rank's shards)", m["params"] / gib, None),
        ("gradients", m["grads"] / gib, None),
        ("optimizer state", m["optimizer"] / gib, None),
        ("parameters + gradients + optimizer", m["states_gib"], p["states"]),
        (f"peak while building the model, its shards drawn alone ({report['peak']})", m["build_peak_gib"], None),
        ("peak of live tensors during the step (planner: less runtime and allocator slack)",
         m["tensor_peak_gib"], tensor_gib(p)),
        (f"peak during the step ({report['peak']})", m["peak_gib"], p["total"]),
    ]
    lines = [f"rank {report['rank']} of {report['world']} ({report['layout']}) on {report['device']}, one step:",
             "| GiB | measured | planner |", "|---|---|---|"]
    lines += [f"| {name} | {value:.4f} | {'' if want is None else f'{want:.4f}'} |" for name, value, want in rows]
    if p.get("nccl"):  # a GPU's: allocated by NCCL itself, so in no peak above
        lines.append(f"NCCL's buffers, outside torch's allocator and its peak: {p['nccl']:.4f} GiB predicted")
    if "hardware" in report:
        from titan_exp.perf.model.predict import prediction_line

        lines += [report["hardware"]["hardware"], prediction_line(report["hardware"])]
    return "\n".join(lines)


def main(path: str) -> int:
    """The rank's process: its progress on stdout whichever rank it is, its report in the run's
    summary (the launcher prints the table from there, once)."""
    started = time.perf_counter()
    from titan_exp.train.rank import failure_status, setup_logging

    run_dir = RunDir(path)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    setup_logging(run_dir, rank, console_info=True)
    job = load_job_config(run_dir.config)
    summary = RunSummary.of(job, Status.running, run_dir.path)
    try:
        report = dry_step(job, run_dir, rank, world, started)
        summary = summary.replace(status=Status.ok, dry_run=report, peak_memory_gib=report["measured"]["peak_gib"],
                                  state_bytes_per_rank=int(report["measured"]["states_gib"] * 2**30))
        logger.info("dry run of rank %d done: %.1f s in all", rank, time.perf_counter() - started)
        return 0
    except BaseException as exc:  # noqa: BLE001 - the summary must say why, whatever it was
        summary = summary.replace(status=failure_status(exc), error=f"{type(exc).__name__}: {exc}")
        logger.exception("dry run of rank %d failed", rank)
        return 1
    finally:
        run_dir.write_summary(summary)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
