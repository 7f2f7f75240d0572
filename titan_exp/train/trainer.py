"""The training loop. Construction builds, in order: mesh -> model (meta) -> parallelize ->
weights -> optimizer and schedule -> data -> metrics -> checkpointer. `train()` resumes from
the latest checkpoint if there is one, runs the steps (and the held-out loss every
validation.freq steps, and downstream evaluations every eval.freq steps in a process of their
own: titan_exp.eval), and returns the numbers the run summary records."""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan_exp import faults, signals, targets
from titan_exp.checkpoint import states
from titan_exp.checkpoint.manager import Checkpointer
from titan_exp.checkpoint.store import complete_steps
from titan_exp.config import JobConfig, OnNonfinite
from titan_exp.data import mixture
from titan_exp.data.corpus import Tokenizer
from titan_exp.data.mixture import open_mixture
from titan_exp.data.sources import open_dataset, validation_source
from titan_exp.eval.runner import Evaluations
from titan_exp.metrics import (
    MetricSinks,
    StepHistory,
    Throughput,
    peak_allocated_gib,
    peak_memory_gib,
    peak_tflops,
    state_bytes,
)
from titan_exp.models import moe
from titan_exp.models.llama import flops_per_token
from titan_exp.parallel import compiles_loss, loss_parallel_enabled, parallelize
from titan_exp.parallel.context import positions
from titan_exp.parallel.dims import ParallelDims
from titan_exp.parallel.pipeline import V_SHAPED, build_pipeline, stage_split, sum_tied_grads
from titan_exp.precision import DTYPES, apply_converter, autocast_dtype, precompute_float8_scales
from titan_exp.record import RunDir
from titan_exp.train.optim import build_optimizers, clip_grad_norm_
from titan_exp.train.profiling import Profiler, timed
from titan_exp.watchdog import set_collective_timeouts, step_deadline, watchdog

logger = logging.getLogger("titan_exp")


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A detached ordinary tensor (under loss parallel the loss is a replicated DTensor)."""
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


@dataclass
class Run:
    """What one call of Trainer.train() gathers as it goes, for its summary."""

    first: int  # the first step it runs: the one after the checkpoint's
    history: StepHistory  # losses, gradient norms, step times
    start: float  # perf_counter() at the start
    interrupted: dict[str, Any] = field(default_factory=dict)  # by which signal, after which step
    nonfinite: list[int] = field(default_factory=list)  # steps whose update was skipped
    val_losses: dict[str, float] = field(default_factory=dict)  # step -> held-out loss
    last_val: dict[str, float] = field(default_factory=dict)  # the last validation's metrics


class Trainer:
    def __init__(self, job: JobConfig, run_dir: RunDir, device: torch.device):
        self.job, self.run_dir, self.device = job, run_dir, device
        self.dims = ParallelDims.from_config(job.parallelism, dist.get_world_size())
        self.dims.build_mesh(device.type)
        self.rank = dist.get_rank()
        self.poison_loss = False  # TITAN_EXP_FAULT=nan@N sets it for step N
        torch.manual_seed(job.training.seed)
        self._build_model()
        self._build_optimizer()
        self._build_data()
        self._build_metrics()
        self._build_checkpointer()
        # eval.*: the model at eval steps, scored by lm-eval in a process of its own (titan_exp.eval)
        self.evals = Evaluations(job, run_dir, device, self.model_parts, self.sinks.log_eval)
        self.profiler = Profiler(job, run_dir.path, self.rank, device)

    def _build_model(self) -> None:
        """Built on the meta device, split into pipeline stages if any, each part parallelized and initialised."""
        job, t = self.job, self.job.training
        with timed("model built on the meta device"), torch.device("meta"):
            model = targets.build(job, "model", job.model)
        if job.precision.full_bf16:
            model.to(torch.bfloat16)
        apply_converter(model, job.precision)
        # Under CP a rank holds 1/cp of each sequence: its load-balanced positions.
        self.cp_positions = positions(t.seq_len, self.dims.local_rank("cp"), self.dims.cp) if self.dims.cp > 1 else None
        self.tokens_per_rank_step = t.global_batch_size // self.dims.dp * t.seq_len // self.dims.cp
        self.loss_parallel = loss_parallel_enabled(job)
        self.autocast_dtype = autocast_dtype(job.precision, self.dims.fsdp_enabled)
        self.cross_entropy = (
            torch.compile(cross_entropy_sum, backend=job.compile.backend.value)
            if compiles_loss(job)
            else cross_entropy_sum
        )
        self.pp_group = self.dims.group("pp")
        loss_mesh = self.dims.mesh("loss")  # the ranks whose losses are averaged
        self.loss_group, self.loss_ranks = (loss_mesh.get_group(), loss_mesh.size()) if loss_mesh else (None, 1)
        if self.pp_group is None:
            self.schedule, self.has_first, self.has_last = None, True, True
            self._prepare(model)
            self.model_parts = [model]
            # The whole model is on this rank: its parameters (a DTensor counts in full) are the
            # config's, each once; a tie undone (to_empty gives a tied weight a Parameter of its own) is not.
            held = sum(p.numel() for p in model.parameters())
            if held != job.model.num_params:
                raise RuntimeError(f"the model holds {held:,} parameters where model.* makes {job.model.num_params:,} "
                                   f"(tie_word_embeddings={job.model.tie_word_embeddings}): a bug; please report it")
            return
        schedule = job.parallelism.pipeline_parallel_schedule
        self.schedule, self.model_parts, self.has_first, self.has_last = build_pipeline(
            model,
            schedule=schedule,
            split=stage_split(job.parallelism, job.model.n_layers),
            pp_mesh=self.dims.mesh("pp"),
            device=self.device,
            n_microbatches=t.local_batch_size // job.parallelism.pipeline_parallel_microbatch_size,
            loss_fn=self._loss,
            prepare=self._prepare,
        )

    def _build_optimizer(self) -> None:
        self.params = [p for part in self.model_parts for p in part.parameters()]
        self.moe_layers = moe.moe_layers(self.model_parts)
        self.expert_counts: torch.Tensor | None = None  # the last step's tokens per expert, summed over ranks
        self.aux_loss = torch.zeros((), device=self.device)  # the last step's balance loss, without its coefficient
        sequences = self.job.training.global_batch_size // self.dims.dp  # per rank and step
        for layer in self.moe_layers:
            layer.aux_loss_scale = 1.0 / sequences
        self.optimizers, self.schedulers = build_optimizers(self.model_parts, self.job)

    def _build_data(self) -> None:
        self.tokenizer = Tokenizer(self.run_dir.tokenizer)
        d, v = self.job.data, self.job.validation
        self.loader = self._loader(open_mixture(mixture.sources(d), self.job.training.seed) if d.mixture
                                   else open_dataset(d), d.text_field)
        # Each held-out set (one per mixture source), opened once; every validation rewinds it to its start.
        self.val_sets: list[tuple[mixture.Source, Any, dict[str, Any]]] = []
        held_out = (mixture.validation_sources(d, v) if d.mixture
                    else [mixture.Source("", 1.0, validation_source(self.job))])
        for source in held_out if v.enable else []:
            loader = self._loader(open_dataset(source.data), source.data.text_field, prefetch=False)
            self.val_sets.append((source, loader, loader.state_dict()))

    def _loader(self, dataset, text_field: str, prefetch: bool = True):
        """A loader of `dataset` (the data node's, a mixture, or a held-out set) from data._target_;
        `prefetch`: cut the next batch in the background while the step runs."""
        t = self.job.training
        return targets.build(
            self.job,
            "data",
            dataset,
            self.tokenizer,
            text_field=text_field,
            seq_len=t.seq_len,
            global_batch_size=t.global_batch_size,
            local_batch_size=t.local_batch_size,
            dp_rank=self.dims.local_rank("batch"),
            dp_degree=self.dims.dp,
            prefetch=prefetch,
        )

    def _build_metrics(self) -> None:
        job = self.job
        self.num_params = job.model.num_params
        self.flops_per_token = flops_per_token(job.model, job.training.seq_len)
        self.peak_tflops, self.peak_source = peak_tflops(job, self.device, DTYPES[job.precision.param_dtype])
        self.throughput = Throughput(
            self.flops_per_token, self.peak_tflops, self.dims.world_size, job.metrics.warmup_steps
        )
        self.sinks = MetricSinks(job, self.run_dir.path, self.rank)
        logger.info(
            "model %s: %.2fM params, %.3g FLOPs/token | mesh %s | peak %.3g TFLOP/s (%s)",
            job.model.flavor, self.num_params / 1e6, self.flops_per_token, self.dims.label, self.peak_tflops,
            self.peak_source,
        )

    def _build_checkpointer(self) -> None:
        self.train_state = states.TrainState()
        parts = {
            "model": states.ModelState(self.model_parts),
            "optimizer": states.OptimizerState(self.model_parts, self.optimizers),
            "lr_scheduler": states.SchedulerState(self.schedulers),
            "dataloader": states.JSONState(self.loader),
            "train_state": self.train_state,
            "rng": states.RNGState(),
        }
        self.checkpointer = Checkpointer(
            self.job.checkpoint, self.run_dir.path, parts, replica_ranks=self.dims.first_replica_ranks(),
            model=self.job.model,
        )

    def _prepare(self, part: torch.nn.Module) -> None:
        with timed(f"parallelized ({self.dims.label})"):
            parallelize(part, self.dims, self.job)
        with timed(f"weights materialised on {self.device.type} and initialised"):
            part.to_empty(device=self.device).init_weights(self.job.training.seed)  # to_empty returns the part
        part.train()

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed token losses over this rank's share of the step's tokens: summing it over
        microbatches gives the rank's mean, and averaging gradients over data-parallel ranks
        (as FSDP/DDP do) gives the global mean, whatever the layout or accumulation."""
        loss = self.cross_entropy(logits, labels) / self.tokens_per_rank_step
        return loss * float("nan") if self.poison_loss else loss  # TITAN_EXP_FAULT=nan@N

    def _loss_context(self):
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over this rank's microbatches; returns (global mean loss, grad norm).
        A step whose loss or gradient norm is not finite (both are global, so every rank sees the
        same) gets no update; `train` then fails or, with training.on_nonfinite=skip, goes on."""
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        moe.reset_counts(self.moe_layers)
        with self.profiler.phase("forward_backward"):
            loss = self._forward_backward(microbatches)
        with self.profiler.phase("optimizer"):
            return self._update(loss)

    def validate(self) -> dict[str, float]:
        """The held-out loss and perplexity; with a mixture, each source's loss too (`val_loss/<label>`)
        and as `val_loss` their mean weighted as the mixture draws them."""
        losses = {source.label: self.held_out_loss(loader, start) for source, loader, start in self.val_sets}
        loss = sum(source.weight * losses[source.label] for source, _, _ in self.val_sets)
        return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 700)),
                **{f"val_loss/{label}": x for label, x in losses.items() if label}}

    def held_out_loss(self, loader, start: dict[str, Any]) -> float:
        """The held-out loss: the mean over validation.steps global batches, read from the start
        of the validation set every time (so the numbers compare across steps and layouts).
        torch's forward-only pipeline `eval` cannot run the V-shaped schedules (it trips on their
        backward actions), so those take a whole step, whose gradients the next step's zero_grad
        discards; the loss is the same, the cost that of a training step."""
        loader.load_state_dict(start)
        by_step = self.schedule is not None and self.job.parallelism.pipeline_parallel_schedule.value in V_SHAPED
        total = 0.0
        with contextlib.nullcontext() if by_step else torch.no_grad():
            for _ in range(self.job.validation.steps):
                total += self._global_loss(self._forward_backward(loader.next_batch(), backward=by_step)).item()
        return total / self.job.validation.steps

    def _forward_backward(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]],
                          backward: bool = True) -> torch.Tensor:
        """This rank's summed loss over its microbatches; gradients accumulate (unless `backward`
        is off: the forward alone, for validation)."""
        loss = torch.zeros((), device=self.device)
        for inputs, labels in microbatches:
            if self.cp_positions is not None:
                inputs, labels = inputs[:, self.cp_positions], labels[:, self.cp_positions]
            inputs, labels = inputs.to(self.device), labels.to(self.device)
            with self._loss_context(), self._autocast():
                if self.schedule is None:
                    mb_loss = self._loss(self.model_parts[0](inputs), labels)
                    if backward:
                        mb_loss.backward()
                    loss += _plain(mb_loss)
                else:
                    losses: list[torch.Tensor] = []
                    args = (inputs,) if self.has_first else ()
                    target, kept = (labels, losses) if self.has_last else (None, None)
                    if backward:  # the last stage keeps no microbatch's logits: only the losses are read
                        self.schedule.step(*args, target=target, losses=kept, return_outputs=False)
                    else:
                        self.schedule.eval(*args, target=target, losses=kept)
                    loss += sum(_plain(part) for part in losses)
        return loss

    def _global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """This rank's loss made the step's global mean: only the last pipeline stage has it, so
        sum over stages, then average over the ranks whose losses differ (data parallel)."""
        if self.pp_group is not None:
            dist.all_reduce(loss, group=self.pp_group)
        if self.loss_group is not None:
            dist.all_reduce(loss, group=self.loss_group)
            loss /= self.loss_ranks
        return loss

    def _update(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The global loss and gradient norm, and the optimizer step. With
        training.on_nonfinite=skip the step is made only if both are finite, which the host must
        read first (a device sync every step). Otherwise the step is made without looking: a
        non-finite step is found at the next read (`StepHistory`), before anything is saved, and
        the run stops, so its update never leaves this process."""
        loss = self._global_loss(loss)
        copies = sum_tied_grads(self.model_parts, self.pp_group)  # tied embeddings under PP: the last stage's copy
        grad_norm = clip_grad_norm_(self.params, self.job.training.max_norm, self.pp_group, copies)
        skip = self.job.training.on_nonfinite == OnNonfinite.skip
        finite = bool(torch.isfinite(grad_norm) & torch.isfinite(loss)) if skip else True  # global: all ranks agree
        # MoE: this step's tokens per expert, summed over ranks; the bias moves with the update.
        self.expert_counts = moe.update_expert_bias(self.moe_layers, self.loss_group, move=finite)
        self.aux_loss = moe.aux_loss_sum(self.moe_layers, self.device)  # this rank's; _expert_load makes it global
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            if finite:
                optimizer.step()
            scheduler.step()  # the schedule follows the step count either way
        if finite:
            precompute_float8_scales(self.job.precision, self.model_parts)
        return loss, grad_norm

    def train(self) -> dict[str, Any]:
        t, ckpt = self.job.training, self.job.checkpoint
        if ckpt.create_seed_checkpoint:
            path = self.checkpointer.save_seed()
            self.sinks.close()
            return {"steps": 0, "losses": [], "seed_checkpoint": str(path)}
        run = Run(first=self.checkpointer.load() + 1, history=StepHistory(self.device), start=time.perf_counter())
        first, history = run.first, run.history
        tokens_per_step = t.global_batch_size * t.seq_len
        try:
            with self.profiler:  # traces and memory records, when profiling.* asks
                for step in range(first, t.steps + 1):
                    watchdog.arm(step, step_deadline(self.job.comm, first=step == first))
                    faults.inject("hang", step)
                    self.poison_loss = faults.inject("nan", step)
                    history.start()
                    faults.inject("slow", step)
                    loss, grad_norm = self.train_step(self.loader.next_batch())
                    history.add(step, loss, grad_norm)
                    self.profiler.step(step)
                    self.train_state.step, self.train_state.tokens_seen = (
                        step, self.train_state.tokens_seen + tokens_per_step)
                    stop = signals.stop_requested()
                    validate = self.job.validation.enable and (step % self.job.validation.freq == 0 or step == t.steps)
                    log = validate or step % self.job.metrics.log_freq == 0 or step == t.steps
                    if (log or step == first or stop or t.on_nonfinite == OnNonfinite.skip
                            or self.checkpointer.due(step, t.steps, force=bool(stop))):
                        self._read(history, tokens_per_step, run.nonfinite, at=step)
                    if step == first:
                        set_collective_timeouts(self.dims.world_mesh, self.job.comm.train_timeout_seconds)
                    val = self.validate() if validate else {}
                    if validate:
                        run.val_losses[str(step)], run.last_val = val["val_loss"], val  # JSON's keys are strings
                    if log:
                        self._log(step, history.losses[-1], history.grad_norms[-1], val)
                    faults.inject("step", step)
                    self.checkpointer.maybe_save(step, last_step=t.steps, force=bool(stop))
                    if not stop:
                        self.evals.after_step(step, t.steps)
                    if stop:
                        run.interrupted = {"interrupted_by": stop, "interrupted_at_step": step}
                        logger.warning("stopped by %s after step %d", " and ".join(stop), step)
                        break
        except BaseException:
            self.evals.kill()  # an evaluator outliving a failed run would hold its cores or GPU
            raise
        finally:
            watchdog.disarm()
        self.checkpointer.close()
        evaluated = self.evals.finish(t.steps, interrupted=bool(run.interrupted))
        self.sinks.close()
        return self._summary(run, evaluated)

    def _summary(self, run: Run, evaluated: dict[str, Any]) -> dict[str, Any]:
        """What the run summary records of this call of train(): where it started and why it
        stopped, the downstream evaluations, losses, held-out losses, speed, memory, the export."""
        t, history = self.job.training, run.history
        resumed = {"start_step": run.first, **run.interrupted, **evaluated,
                   **({} if run.interrupted else self._export())}
        if run.nonfinite:
            resumed["skipped_steps"] = run.nonfinite
        if run.val_losses:
            resumed |= {"val_losses": run.val_losses, "final_val_loss": list(run.val_losses.values())[-1]}
            if self.job.data.mixture:
                resumed["val_loss_per_source"] = {k.split("/", 1)[1]: x for k, x in run.last_val.items()
                                                  if k.startswith("val_loss/")}
        if self.job.data.mixture:
            resumed["tokens_per_source"] = self.loader.tokens_per_source()
        if self.job.checkpoint.enable:
            resumed["checkpoint_blocking_s"] = self.checkpointer.blocking_s
            if run.interrupted:
                resumed["checkpoint_at_stop"] = True  # maybe_save(force=True) wrote it
        if not history.losses:
            logger.info("nothing to train: the checkpoint is at step %d of %d", run.first - 1, t.steps)
            return {"steps": t.steps, "losses": [], **resumed}
        # Largest rank: memory limits are per device.
        allocated = peak_allocated_gib(self.device)
        peak = torch.tensor([peak_memory_gib(self.device), state_bytes(self.params, self.optimizers), allocated or 0.0],
                            dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        steady = self.throughput.steady()
        step_times = history.step_times
        # What the first step cost beyond a typical one: with compile on, the compilation.
        first_step_overhead = max(0.0, step_times[0] - statistics.median(step_times[1:] or step_times))
        return {
            **resumed,
            "steps": t.steps,
            "final_loss": history.losses[-1],
            "losses": history.losses,
            "grad_norms": history.grad_norms,
            "tokens_per_second_per_device": steady["tps_per_device"],
            "mfu": steady["mfu"],
            "tokens_per_second_per_device_mean": steady["tps_per_device_mean"],
            "mfu_mean": steady["mfu_mean"],
            "peak_memory_gib": peak[0].item(),
            **({"peak_memory_allocated_gib": peak[2].item()} if allocated is not None else {}),
            "state_bytes_per_rank": int(peak[1].item()),
            "train_time_s": time.perf_counter() - run.start,
            "num_params": self.num_params,
            "flops_per_token": self.flops_per_token,
            "peak_tflops": self.peak_tflops,
            "peak_tflops_source": self.peak_source,
            "first_step_s": step_times[0],
            "step_times_s": [round(x, 5) for x in step_times],
            **({"expert_load": self._expert_load()} if self.job.model.is_moe else {}),
            **({"compile_s": first_step_overhead} if self.job.compile.enable else {}),
        }

    def _read(self, history: StepHistory, tokens_per_step: int, nonfinite: list[int], at: int) -> None:
        """Read the steps since the last read from the device (`StepHistory`), count their
        tokens and time, and act on the first one that was not finite."""
        for step, loss, grad_norm, seconds in history.read():
            self.throughput.record(tokens_per_step, seconds)
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                nonfinite.append(step)
                self._nonfinite(step, loss, grad_norm, nonfinite, found_at=at)

    def _log(self, step: int, loss: float, grad_norm: float, val: dict[str, float]) -> None:
        self.sinks.log(step, {
            "loss": loss,
            **val,
            "grad_norm": grad_norm,
            "lr": self.schedulers[0].get_last_lr()[0],
            **self.throughput.window(),
            "peak_memory_gib": peak_memory_gib(self.device),
            **{f"moe/{k}": v for k, v in self._expert_load().items()},
            **({f"tokens/{k}": v for k, v in self.loader.tokens_per_source().items()} if self.job.data.mixture else {}),
        })

    def _expert_load(self) -> dict[str, float]:
        """The last step's expert load over every MoE layer (all pipeline stages): the busiest
        and idlest expert's tokens over the mean, the largest load-balancing bias, and the balance
        loss without its coefficient (as transformers reports aux_loss) where it is on. (Dispatch
        is capacity-free: no token is dropped or re-routed, so there is nothing else to count.)"""
        if not self.job.model.is_moe:
            return {}
        stats = (moe.load_stats(self.expert_counts, self.moe_layers) if self.expert_counts is not None
                 else torch.full((3,), -1e9, device=self.device))  # a pipeline stage of dense blocks only
        if self.pp_group is not None:
            dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=self.pp_group)
        busiest, idlest, bias = stats.tolist()
        aux = {"aux_loss": self._global_loss(self.aux_loss.clone()).item()} if self.job.model.aux_loss_coeff else {}
        return {"max_load": busiest, "min_load": -idlest, "max_bias": bias, **aux}

    def _nonfinite(self, step: int, loss: float, grad_norm: float, nonfinite: list[int], found_at: int) -> None:
        """A step whose loss or gradients are NaN/Inf: skip it (training.on_nonfinite=skip; its
        update was not made) or stop, naming the step. Ten skips in a row stop too. Stopping
        raises before this step's checkpoint, so the last good one stays the latest."""
        what = f"step {step}: loss {loss}, gradient norm {grad_norm}"
        in_a_row = len(nonfinite) >= 10 and nonfinite[-10] == step - 9
        if self.job.training.on_nonfinite == OnNonfinite.skip and not in_a_row:
            logger.warning("%s: not finite; the update was skipped (training.on_nonfinite=skip)", what)
            return
        latest = complete_steps(self.checkpointer.folder) if self.job.checkpoint.enable else {}
        kept = f"the latest checkpoint stays step-{max(latest)}" if latest else "no checkpoint was written"
        reason = "10 steps in a row were skipped" if in_a_row else "training.on_nonfinite=stop"
        found = f" at step {found_at}'s read of the device" if found_at != step else ""
        raise FloatingPointError(f"{what}: not finite, stopped{found} before saving any state it touched ({reason}); "
                                 f"{kept}. Lower optimizer.lr or training.max_norm, or set training.on_nonfinite=skip")

    def _export(self) -> dict[str, str]:
        """The last checkpoint's exports (titan_exp.checkpoint.export.export_last), written by rank 0."""
        from titan_exp.checkpoint.export import export_last

        outs = export_last(self.job, self.run_dir, write=self.rank == 0)
        if not outs:
            return {}
        dist.barrier()
        return {"export": str(outs[0])}
