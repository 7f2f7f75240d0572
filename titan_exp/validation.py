"""Validation: one pure function from a JobConfig to every error it has, and the resolution of
derived values (world size, dp_shard=-1, global batch) that runs only on a valid config.

Each message reads `field = value: what is wrong; how to fix it`. The launcher runs this before
anything is spawned or written, and every rank runs it again on the resolved config.
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import json
import os
import re

from titan_exp.config import JobConfig
from titan_exp.models.llama import ffn_hidden_dim
from titan_exp.parallel.compile import BACKENDS
from titan_exp.parallel.dims import ParallelDims
from titan_exp.parallel.fsdp import RESHARD_MODES
from titan_exp.parallel.pipeline import LOOPED, SCHEDULES, SINGLE_STAGE, V_SHAPED, stages_per_rank
from titan_exp.precision import ALIGNMENT, CONVERTERS, DTYPES, FLOAT8_RECIPES

DTYPE_NAMES = tuple(DTYPES)
AC_MODES = ("none", "full", "selective")
# torchao's MXFP8TrainingRecipe values, listed here so validation need not import torchao (~4 s);
# a test keeps the two in step.
MX_RECIPES = ("mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp", "mxfp8_emulated_rceil")
NOT_YET = "not supported yet (tracked in its own issue)"


class ConfigError(ValueError):
    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("invalid config:\n  - " + "\n  - ".join(errors))


def world_size(job: JobConfig) -> int:
    """Ranks the job runs on: nnodes x nproc_per_node, or what the degrees need when unset."""
    c, p = job.cluster, job.parallelism
    if c.nproc_per_node is not None:
        return c.nnodes * c.nproc_per_node
    if c.executor == "slurm" and c.gpus_per_node > 0:
        return c.nnodes * c.gpus_per_node  # one rank per GPU
    need = p.pipeline_parallel_degree * p.data_parallel_replicate_degree
    need *= p.context_parallel_degree * p.tensor_parallel_degree * max(1, p.data_parallel_shard_degree)
    return need


def _err(errors: list[str], field: str, value, problem: str) -> None:
    errors.append(f"{field} = {value!r}: {problem}")


def validate(job: JobConfig, *, cuda: bool | None = None, tokenizer_vocab: int | None = None) -> list[str]:
    """Every error in `job`. `cuda` defaults to what this machine has; `tokenizer_vocab` is
    checked against the model when the tokenizer is known."""
    if cuda is None and job.cluster.executor == "slurm":
        cuda = job.cluster.gpus_per_node > 0  # the nodes', not the submitting machine's
    elif cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    e: list[str] = []
    m, t, c = job.model, job.training, job.cluster

    # Every integer that counts something must be positive.
    for group, names in (
        ("model", ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len")),
        ("training", ("steps", "local_batch_size", "seq_len")),
        ("parallelism", ("data_parallel_replicate_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
                         "context_parallel_degree", "pipeline_parallel_microbatch_size")),
        ("cluster", ("nnodes",)),
        ("metrics", ("log_freq",)),
    ):
        for name in names:
            value = getattr(getattr(job, group), name)
            if value < 1:
                _err(e, f"{group}.{name}", value, "must be >= 1")
    if e:
        return e  # the rules below divide by these

    # Model shape.
    if m.name != "llama3":
        _err(e, "model.name", m.name, "unknown model family; use 'llama3'")
    if m.dim % m.n_heads:
        _err(e, "model.dim", m.dim, f"must be divisible by model.n_heads = {m.n_heads}")
    elif (m.dim // m.n_heads) % 2:
        _err(e, "model.dim", m.dim, "head_dim = dim / n_heads must be even for RoPE")
    kv = m.n_kv_heads if m.n_kv_heads is not None else m.n_heads
    if kv < 1 or m.n_heads % kv:
        _err(e, "model.n_kv_heads", m.n_kv_heads, f"must divide model.n_heads = {m.n_heads}")
    for name in ("norm_eps", "rope_theta"):
        if not getattr(m, name) > 0:
            _err(e, f"model.{name}", getattr(m, name), "must be > 0")
    if m.ffn_dim_multiplier is not None and not m.ffn_dim_multiplier > 0:
        _err(e, "model.ffn_dim_multiplier", m.ffn_dim_multiplier, "must be > 0, or null")
    if tokenizer_vocab is not None and tokenizer_vocab > m.vocab_size:
        _err(e, "model.vocab_size", m.vocab_size,
             f"smaller than the tokenizer's vocabulary ({tokenizer_vocab}); set it to at least that")
    if t.seq_len > m.max_seq_len:
        _err(e, "training.seq_len", t.seq_len, f"exceeds model.max_seq_len = {m.max_seq_len}")

    # Training, optimizer, schedule, metrics.
    if t.on_nonfinite not in ("stop", "skip"):
        _err(e, "training.on_nonfinite", t.on_nonfinite, "choose stop or skip")
    for name in ("init_timeout_seconds", "train_timeout_seconds"):
        if getattr(job.comm, name) < 1:
            _err(e, f"comm.{name}", getattr(job.comm, name), "must be >= 1 (seconds)")
    if t.max_norm < 0:
        _err(e, "training.max_norm", t.max_norm, "must be >= 0 (0 disables clipping)")
    o = job.optimizer
    if o.name not in ("AdamW", "Adam"):
        _err(e, "optimizer.name", o.name, "choose AdamW or Adam")
    if not o.lr > 0:
        _err(e, "optimizer.lr", o.lr, "must be > 0")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(o, name) < 1:
            _err(e, f"optimizer.{name}", getattr(o, name), "must be in [0, 1)")
    if not o.eps > 0:
        _err(e, "optimizer.eps", o.eps, "must be > 0")
    if o.weight_decay < 0:
        _err(e, "optimizer.weight_decay", o.weight_decay, "must be >= 0")
    s = job.lr_scheduler
    if not 0 <= s.warmup_steps <= t.steps:
        _err(e, "lr_scheduler.warmup_steps", s.warmup_steps, f"must be in [0, training.steps = {t.steps}]")
    if s.decay_ratio is not None and not 0 <= s.decay_ratio <= 1:
        _err(e, "lr_scheduler.decay_ratio", s.decay_ratio, "must be in [0, 1] or null")
    elif s.decay_ratio is not None and s.warmup_steps + round(s.decay_ratio * t.steps) > t.steps:
        _err(e, "lr_scheduler.decay_ratio", s.decay_ratio,
             "warmup plus decay steps exceed training.steps; lower one of them")
    if s.decay_type not in ("linear", "sqrt", "cosine"):
        _err(e, "lr_scheduler.decay_type", s.decay_type, "choose linear, sqrt or cosine")
    if not 0 <= s.min_lr_factor <= 1:
        _err(e, "lr_scheduler.min_lr_factor", s.min_lr_factor, "must be in [0, 1]")
    if job.metrics.warmup_steps < 0:
        _err(e, "metrics.warmup_steps", job.metrics.warmup_steps, "must be >= 0")
    if job.metrics.wandb_mode not in ("online", "offline"):
        _err(e, "metrics.wandb_mode", job.metrics.wandb_mode, "choose online or offline")
    if job.metrics.peak_tflops is not None and not job.metrics.peak_tflops > 0:
        _err(e, "metrics.peak_tflops", job.metrics.peak_tflops, "must be > 0, or null to measure/look up")

    # Data.
    d = job.data
    if d.dataset in ("text", "json") and not d.path:
        _err(e, "data.path", d.path, f"data.dataset = {d.dataset!r} reads local files; give a file or glob")
    elif d.dataset in ("text", "json") and not glob.glob(d.path):
        _err(e, "data.path", d.path, "matches no file; check the path")
    if d.tokenizer_path is not None and not os.path.isfile(d.tokenizer_path):
        _err(e, "data.tokenizer_path", d.tokenizer_path, "is not a file; give a tokenizers JSON file or null")
    if d.tokenizer_path is None and d.tokenizer_vocab_size < 258:
        _err(e, "data.tokenizer_vocab_size", d.tokenizer_vocab_size,
             "a byte-level BPE needs >= 258 (256 bytes + BOS/EOS)")

    e += _validate_speed_features(job, cuda)
    e += _validate_checkpoint(job, cuda)

    # Cluster.
    if c.executor not in ("local", "slurm", "debug"):
        _err(e, "cluster.executor", c.executor, "choose local, slurm or debug")
    if c.executor == "slurm":
        e += _validate_slurm(c)
    if c.cpu_malloc_mmap_threshold_mib is not None and not 0 <= c.cpu_malloc_mmap_threshold_mib <= 32:
        _err(e, "cluster.cpu_malloc_mmap_threshold_mib", c.cpu_malloc_mmap_threshold_mib,
             "glibc accepts 0..32 MiB; or null for its default")
    if c.nproc_per_node is not None and c.nproc_per_node < 1:
        _err(e, "cluster.nproc_per_node", c.nproc_per_node, "must be >= 1, or null to derive it from the degrees")
        return e
    if c.nproc_per_node is None and world_size(job) % c.nnodes:
        _err(e, "cluster.nnodes", c.nnodes,
             f"does not divide the {world_size(job)} ranks the degrees need; set cluster.nproc_per_node")

    e += _validate_layout(job, cuda)
    return e


def _validate_speed_features(job: JobConfig, cuda: bool) -> list[str]:
    """Precision, torch.compile, activation checkpointing."""
    e: list[str] = []
    pr, m, p = job.precision, job.model, job.parallelism
    for name in ("param_dtype", "reduce_dtype"):
        if getattr(pr, name) not in DTYPE_NAMES:
            _err(e, f"precision.{name}", getattr(pr, name), f"choose one of {', '.join(DTYPE_NAMES)}")
    if pr.full_bf16 and pr.param_dtype != "bfloat16":
        _err(e, "precision.full_bf16", True, "stores parameters in bf16, so precision.param_dtype must be bfloat16")
    if pr.converter not in CONVERTERS:
        _err(e, "precision.converter", pr.converter, f"choose one of {', '.join(CONVERTERS)}")
    elif pr.converter != "none":
        align = ALIGNMENT[pr.converter]
        tp = max(1, p.tensor_parallel_degree)
        kv = m.n_kv_heads or m.n_heads
        for field, width in (("model.dim", m.dim), ("the ffn hidden size", ffn_hidden_dim(m)),
                             ("n_kv_heads x head_dim", kv * (m.dim // max(1, m.n_heads)))):
            if width % (align * tp):
                _err(e, "precision.converter", pr.converter,
                     f"{field} = {width} is not divisible by {align}{f' x tp = {align * tp}' if tp > 1 else ''}; "
                     f"{pr.converter} matmuls need multiples of {align} per rank (or use precision=bf16)")
                break
    if pr.converter == "float8":
        if pr.float8_recipe not in FLOAT8_RECIPES:
            _err(e, "precision.float8_recipe", pr.float8_recipe, f"choose one of {', '.join(FLOAT8_RECIPES)}")
        elif pr.float8_enable_fsdp_all_gather and pr.float8_recipe != "tensorwise":
            _err(e, "precision.float8_enable_fsdp_all_gather", True,
                 f"works with the tensorwise recipe only, not {pr.float8_recipe}; turn it off or use tensorwise")
    if pr.float8_precompute_dynamic_scale_for_fsdp and not (pr.converter == "float8" and pr.float8_enable_fsdp_all_gather):
        _err(e, "precision.float8_precompute_dynamic_scale_for_fsdp", True,
             "precomputes scales for float8 all-gather; needs converter=float8 and float8_enable_fsdp_all_gather=true")
    if pr.converter == "mxfp8":
        if pr.mx_recipe not in MX_RECIPES:
            _err(e, "precision.mx_recipe", pr.mx_recipe, f"choose one of {', '.join(MX_RECIPES)}")

    c = job.compile
    if c.backend not in BACKENDS:
        _err(e, "compile.backend", c.backend, f"choose one of {', '.join(BACKENDS)}")
    if c.enable and p.tensor_parallel_degree > 1 and not cuda:
        _err(e, "compile.enable", True,
             "with tensor_parallel_degree > 1 it fails on CPU in torch 2.13 (a DTensor redistribute's backward "
             "receives a plain tensor); compile without TP, or run TP eager")

    ac = job.activation_checkpoint
    if ac.mode not in AC_MODES:
        _err(e, "activation_checkpoint.mode", ac.mode, f"choose one of {', '.join(AC_MODES)}")
    elif ac.mode == "selective" and ac.selective_ac_option != "op" and not (
        ac.selective_ac_option.isdigit() and int(ac.selective_ac_option) >= 1
    ):
        _err(e, "activation_checkpoint.selective_ac_option", ac.selective_ac_option,
             "'op' for the per-op policy or a positive integer N to checkpoint every Nth block")
    return e


HEAD_BYTES = 1 << 16


def data_file_errors(d) -> list[str]:
    """Local data files (data.dataset text/json) that cannot feed training: empty, not UTF-8
    text, or (json) lines that are not objects with the text field. It reads the first 64 KiB of
    every file, so the launcher calls it once (`validate`, which every rank and the planner run
    too, only checks that data.path matches files)."""
    e: list[str] = []
    if d.dataset not in ("text", "json") or not d.path:
        return e
    for path in sorted(glob.glob(d.path)):
        try:
            with open(path, "rb") as f:
                head = f.read(HEAD_BYTES)
        except OSError as exc:
            _err(e, "data.path", d.path, f"{path} cannot be read ({exc.strerror})")
            continue
        if not head.strip():
            _err(e, "data.path", d.path, f"{path} is empty; remove it or point data.path elsewhere")
            continue
        try:
            text = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        except UnicodeDecodeError as exc:
            text = None
            _err(e, "data.path", d.path, f"{path} is not UTF-8 text (byte {exc.start}); is it a binary or compressed file?")
        if text is not None and "\x00" in text:
            _err(e, "data.path", d.path, f"{path} holds NUL bytes: a binary file, not text")
        elif text is not None and d.dataset == "json":
            for number, line in enumerate(text.splitlines()[:-1] if len(head) == HEAD_BYTES else text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    _err(e, "data.path", d.path, f"{path} line {number} is not JSON ({exc.msg}); json data is one object per line")
                    break
                if not isinstance(record, dict) or not isinstance(record.get(d.text_field), str):
                    _err(e, "data.text_field", d.text_field, f"{path} line {number} has no string field {d.text_field!r}; "
                         "set data.text_field to the field that holds the text")
                    break
    return e


SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL", re.IGNORECASE)
MAIL_TYPES = {"NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT", "TIME_LIMIT",
              "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS"}


def _validate_slurm(c) -> list[str]:
    """What sbatch would reject, or what would make the job misbehave, known without asking the
    controller (titan_exp.cluster.slurm.preflight asks it about partitions and node sizes)."""
    e: list[str] = []
    for name, low in (("timeout_min", 1), ("cpus_per_task", 1), ("gpus_per_node", 0), ("signal_delay_s", 0),
                      ("max_num_timeout", 0), ("array_parallelism", 1)):
        if getattr(c, name) < low:
            _err(e, f"cluster.{name}", getattr(c, name), f"must be >= {low}")
    if c.mem_gb is not None and c.mem_gb < 1:
        _err(e, "cluster.mem_gb", c.mem_gb, "must be >= 1 (GiB per node), or null for the partition's default")
    if c.timeout_min >= 1 and c.signal_delay_s >= c.timeout_min * 60:
        _err(e, "cluster.signal_delay_s", c.signal_delay_s,
             f"the warning signal would come before the job starts (time limit {c.timeout_min} min); lower it")
    if c.gpus_per_node > 0 and c.nproc_per_node is not None and c.nproc_per_node != c.gpus_per_node:
        _err(e, "cluster.nproc_per_node", c.nproc_per_node,
             f"one rank per GPU: must equal cluster.gpus_per_node = {c.gpus_per_node}, or null")
    if c.mail_type is not None:
        unknown = [t for t in c.mail_type.split(",") if t.strip().upper() not in MAIL_TYPES]
        if unknown:
            _err(e, "cluster.mail_type", c.mail_type, f"unknown event(s) {unknown}; choose from {sorted(MAIL_TYPES)}")
    secrets = [k for k in c.env if SECRET.search(k)]
    if secrets:
        _err(e, "cluster.env", secrets, "looks like a secret, and the config is written to the run dir and the job "
             "script; export it in the shell that runs launch.py instead (sbatch passes that environment on)")
    bad_env = [k for k in c.env if not k.isidentifier()]
    if bad_env:
        _err(e, "cluster.env", bad_env, "environment variable names are letters, digits and _, not starting with a digit")
    return e


def _validate_layout(job: JobConfig, cuda: bool) -> list[str]:
    e: list[str] = []
    m, p, t, c = job.model, job.parallelism, job.training, job.cluster
    world = world_size(job)
    other = p.pipeline_parallel_degree * p.data_parallel_replicate_degree
    other *= p.context_parallel_degree * p.tensor_parallel_degree
    shard = p.data_parallel_shard_degree
    if shard == -1:
        if world % other:
            _err(e, "parallelism", _degrees(p),
                 f"pp x dp_replicate x cp x tp = {other} does not divide the world size {world}; "
                 "change the degrees or cluster.nproc_per_node")
            return e
    elif shard < 1:
        _err(e, "parallelism.data_parallel_shard_degree", shard, "must be >= 1, or -1 for the rest of the world")
        return e
    elif other * shard != world:
        _err(e, "parallelism", _degrees(p),
             f"the product of the degrees is {other * shard} but the world size is {world} "
             f"(cluster.nnodes x cluster.nproc_per_node); make them equal or set data_parallel_shard_degree=-1")
        return e
    dims = ParallelDims.from_config(p, world)

    if c.executor == "debug" and world != 1:
        _err(e, "cluster.executor", "debug", f"runs one rank in-process but the world size is {world}; use cluster=local")
    mode = p.fsdp_reshard_after_forward
    if mode.isdigit():
        group = dims.dp_shard * dims.cp
        if not (1 < int(mode) < group and group % int(mode) == 0):
            _err(e, "parallelism.fsdp_reshard_after_forward", mode,
                 f"an integer must be a proper divisor (> 1) of the FSDP group size {group}; "
                 f"or choose one of {', '.join(RESHARD_MODES)}")
    elif mode not in RESHARD_MODES:
        _err(e, "parallelism.fsdp_reshard_after_forward", mode,
             f"choose one of {', '.join(RESHARD_MODES)} or an integer group size")

    # Batch sizes.
    gbs = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * dims.dp
    if gbs < 1:
        _err(e, "training.global_batch_size", t.global_batch_size, "must be >= 1, or -1 for local_batch_size x dp")
    elif gbs % (t.local_batch_size * dims.dp):
        _err(e, "training.global_batch_size", gbs,
             f"must be a multiple of local_batch_size x dp = {t.local_batch_size} x {dims.dp}; "
             "the quotient is the number of gradient accumulation steps")

    # Tensor parallel.
    if dims.tp > 1:
        kv = m.n_kv_heads if m.n_kv_heads is not None else m.n_heads
        for field, value in (("model.n_heads", m.n_heads), ("model.n_kv_heads", kv),
                             ("ffn hidden size (from model.dim/multiple_of/ffn_dim_multiplier)", ffn_hidden_dim(m)),
                             ("the sequence per rank (training.seq_len / cp, sequence parallel)",
                              t.seq_len // dims.cp)):
            if value % dims.tp:
                _err(e, "parallelism.tensor_parallel_degree", dims.tp,
                     f"does not divide {field} = {value}; pick a degree that does")
    if p.enable_async_tensor_parallel:
        why = []
        if not cuda:
            why.append("needs CUDA (torch skips the fused collective-matmul passes without NCCL, so it would do nothing)")
        if not job.compile.enable:
            why.append("needs compile.enable=true (it is a torch.compile pass)")
        if dims.tp == 1:
            why.append("needs tensor_parallel_degree > 1")
        if why:
            _err(e, "parallelism.enable_async_tensor_parallel", True, "; ".join(why))

    # Context parallel: 2 x cp load-balanced chunks per sequence.
    if dims.cp > 1 and t.seq_len % (2 * dims.cp):
        _err(e, "parallelism.context_parallel_degree", dims.cp,
             f"training.seq_len = {t.seq_len} must be divisible by 2 x cp = {2 * dims.cp} (load-balanced chunks)")

    # Data parallel flavours.
    if dims.dp_replicate > 1 and not dims.fsdp_enabled and (dims.tp > 1 or dims.pp > 1):
        _err(e, "parallelism.data_parallel_replicate_degree", dims.dp_replicate,
             "replicate-only data parallel (DDP) does not compose with TP/PP; "
             "shard too (data_parallel_shard_degree > 1, i.e. HSDP) or use FSDP")

    # Pipeline parallel.
    if dims.pp > 1:
        sched = p.pipeline_parallel_schedule
        if sched not in SCHEDULES:
            _err(e, "parallelism.pipeline_parallel_schedule", sched, f"choose one of {', '.join(SCHEDULES)}")
            return e
        lps = p.pipeline_parallel_layers_per_stage
        if lps is not None:
            if lps < 1 or m.n_layers % lps:
                _err(e, "parallelism.pipeline_parallel_layers_per_stage", lps,
                     f"must divide model.n_layers = {m.n_layers}")
                return e
            if (m.n_layers // lps) % dims.pp:
                _err(e, "parallelism.pipeline_parallel_layers_per_stage", lps,
                     f"gives {m.n_layers // lps} stages, not a multiple of pipeline_parallel_degree = {dims.pp}")
                return e
            spr = p.pipeline_parallel_stages_per_rank
            if spr is not None and spr != m.n_layers // lps // dims.pp:
                _err(e, "parallelism.pipeline_parallel_stages_per_rank", spr,
                     f"contradicts layers_per_stage = {lps} ({m.n_layers // lps // dims.pp} per rank); set only one")
                return e
        per_rank = stages_per_rank(p, m.n_layers)
        if sched in SINGLE_STAGE and per_rank != 1:
            _err(e, "parallelism.pipeline_parallel_stages_per_rank", per_rank,
                 f"{sched} runs one stage per rank; set it to 1 (or null) or pick a looped schedule")
        if sched in V_SHAPED and per_rank != 2:
            _err(e, "parallelism.pipeline_parallel_stages_per_rank", per_rank, f"{sched} needs exactly 2 (a V)")
        if sched in LOOPED and per_rank < 2:
            _err(e, "parallelism.pipeline_parallel_stages_per_rank", per_rank, f"{sched} needs >= 2 stages per rank")
        stages = dims.pp * per_rank
        if stages > m.n_layers:
            _err(e, "parallelism.pipeline_parallel_degree", dims.pp,
                 f"{dims.pp} ranks x {per_rank} stages = {stages} stages but model.n_layers = {m.n_layers}; "
                 "every stage needs a block")
        mbs = p.pipeline_parallel_microbatch_size
        if t.local_batch_size % mbs:
            _err(e, "parallelism.pipeline_parallel_microbatch_size", mbs,
                 f"must divide training.local_batch_size = {t.local_batch_size}")
        else:
            n_mb = t.local_batch_size // mbs
            if sched not in SINGLE_STAGE and n_mb % dims.pp:
                _err(e, "training.local_batch_size", t.local_batch_size,
                     f"{sched} needs the microbatch count ({n_mb}) to be a multiple of pipeline_parallel_degree "
                     f"= {dims.pp}; raise local_batch_size or lower pipeline_parallel_microbatch_size")
            elif n_mb < dims.pp:
                _err(e, "training.local_batch_size", t.local_batch_size,
                     f"gives {n_mb} microbatches for {dims.pp} pipeline ranks; need at least one per rank")
        if m.tie_word_embeddings:
            _err(e, "model.tie_word_embeddings", True, "tied embeddings span the first and last stage; " + NOT_YET + " with PP")
    return e


def _validate_checkpoint(job: JobConfig, cuda: bool) -> list[str]:
    from titan_exp.checkpoint import EXPORT_DTYPES, EXPORT_FORMATS, PARTS

    e: list[str] = []
    k = job.checkpoint
    if k.interval < 1:
        _err(e, "checkpoint.interval", k.interval, "must be >= 1")
    if k.keep_latest_k < 0:
        _err(e, "checkpoint.keep_latest_k", k.keep_latest_k, "must be >= 0 (0 keeps every checkpoint)")
    if k.load_step < -1:
        _err(e, "checkpoint.load_step", k.load_step, "must be a saved step, or -1 for the latest")
    if k.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
        _err(e, "checkpoint.async_mode", k.async_mode, "choose disabled, async or async_with_pinned_mem")
    elif k.async_mode == "async_with_pinned_mem" and not cuda:
        _err(e, "checkpoint.async_mode", k.async_mode, "pinned memory needs CUDA; use async on this machine")
    for part in k.exclude_from_loading:
        if part not in PARTS:
            _err(e, "checkpoint.exclude_from_loading", part, f"not a checkpoint part; choose from {', '.join(PARTS)}")
    if k.export_dtype not in EXPORT_DTYPES:
        _err(e, "checkpoint.export_dtype", k.export_dtype, f"choose {', '.join(EXPORT_DTYPES)}")
    if k.export_format is not None and k.export_format not in EXPORT_FORMATS:
        _err(e, "checkpoint.export_format", k.export_format, f"choose {', '.join(EXPORT_FORMATS)}, or null")
    if k.hsdp_save_replicas not in ("all", "first"):
        _err(e, "checkpoint.hsdp_save_replicas", k.hsdp_save_replicas, "choose all or first")
    if not k.folder:
        _err(e, "checkpoint.folder", k.folder, "give a folder (relative paths are inside the run dir)")
    if not k.enable:
        needs = {"export_format": k.export_format is not None, "create_seed_checkpoint": k.create_seed_checkpoint,
                 "last_save_model_only": k.last_save_model_only, "initial_load_path": k.initial_load_path is not None}
        for name, used in needs.items():
            if used:
                _err(e, f"checkpoint.{name}", getattr(k, name),
                     "needs checkpoint.enable=true (or checkpoint=default)")
    return e


def _degrees(p) -> str:
    return (f"pp={p.pipeline_parallel_degree} dp_replicate={p.data_parallel_replicate_degree} "
            f"dp_shard={p.data_parallel_shard_degree} cp={p.context_parallel_degree} tp={p.tensor_parallel_degree}")


def resolve(job: JobConfig) -> JobConfig:
    """Fill the derived values of a valid config, so the ranks and the record see numbers."""
    world = world_size(job)
    dims = ParallelDims.from_config(job.parallelism, world)
    t, d, k = job.training, job.data, job.checkpoint

    def absolute(path: str | None) -> str | None:  # the ranks may start in another directory (SLURM)
        return os.path.abspath(os.path.expanduser(path)) if path else path

    return dataclasses.replace(
        job,
        data=dataclasses.replace(d, path=absolute(d.path), tokenizer_path=absolute(d.tokenizer_path)),
        checkpoint=dataclasses.replace(k, initial_load_path=absolute(k.initial_load_path)),
        cluster=dataclasses.replace(job.cluster, nproc_per_node=world // job.cluster.nnodes),
        parallelism=dataclasses.replace(job.parallelism, data_parallel_shard_degree=dims.dp_shard),
        training=dataclasses.replace(
            t, global_batch_size=t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * dims.dp
        ),
    )

