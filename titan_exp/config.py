"""Typed schemas for every config group.

Each group is a dataclass registered in Hydra's ConfigStore; the YAML presets in `conf/` only
change values, so a typo or a value of the wrong type is rejected by OmegaConf at compose time.
Every field carries a one-line doc (``metadata["doc"]``) that `python launch.py --help` prints.
Semantic checks (ranges, choices, cross-field rules) live in `titan_exp.validation`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf


CONF = Path(__file__).resolve().parents[1] / "conf"
SWEEPS = Path(__file__).resolve().parents[1] / "sweeps"


def sweep_groups() -> dict[str, Path]:
    """Groups selected with `+group=name`: named sweeps, the ladder's rungs, the planner's layouts."""
    return {"sweep": SWEEPS, "rung": SWEEPS / "rung", "plan_layout": SWEEPS / "plan_layout"}


def doc(default: Any, text: str) -> Any:
    """A dataclass field with a default and a one-line description."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


@dataclass
class ModelConfig:
    """Llama 3 shapes. Presets in conf/model/ carry the published shapes of each flavor."""

    name: str = doc("llama3", "model family; only 'llama3' is implemented")
    flavor: str = doc("debugmodel", "preset name, recorded in the run summary")
    dim: int = doc(256, "hidden size")
    n_layers: int = doc(6, "number of transformer blocks")
    n_heads: int = doc(16, "attention (query) heads")
    n_kv_heads: Optional[int] = doc(None, "key/value heads for GQA; null = n_heads")
    vocab_size: int = doc(2048, "embedding rows; must be >= the tokenizer's vocabulary")
    multiple_of: int = doc(256, "SwiGLU hidden size is rounded up to a multiple of this")
    ffn_dim_multiplier: Optional[float] = doc(None, "scales the SwiGLU hidden size (Llama 3: 1.3 for 8B/70B)")
    norm_eps: float = doc(1e-5, "RMSNorm epsilon")
    rope_theta: float = doc(500000.0, "RoPE base frequency")
    max_seq_len: int = doc(2048, "longest sequence the model accepts (RoPE table size)")
    tie_word_embeddings: bool = doc(False, "share the embedding and output matrices (Llama 3.2 1B/3B)")


@dataclass
class ParallelismConfig:
    """Degrees of the named DeviceMesh (pp, dp_replicate, dp_shard, cp, tp); TorchTitan's names."""

    data_parallel_replicate_degree: int = doc(1, "replicas (DDP, or the outer dim of HSDP)")
    data_parallel_shard_degree: int = doc(-1, "FSDP shards; -1 = the rest of the world size")
    tensor_parallel_degree: int = doc(1, "tensor parallel degree (with sequence parallel)")
    pipeline_parallel_degree: int = doc(1, "pipeline stages across ranks")
    pipeline_parallel_schedule: str = doc(
        "1F1B", "GPipe | 1F1B | Interleaved1F1B | LoopedBFS | InterleavedZeroBubble | ZBVZeroBubble | DualPipeV"
    )
    pipeline_parallel_microbatch_size: int = doc(1, "sequences per pipeline microbatch")
    pipeline_parallel_stages_per_rank: Optional[int] = doc(
        None, "stages each pipeline rank holds; null = from layers_per_stage, else 1 (2 for looped/V schedules)"
    )
    pipeline_parallel_layers_per_stage: Optional[int] = doc(
        None, "transformer blocks per stage; sets the stage count to n_layers / this (null = split evenly)"
    )
    context_parallel_degree: int = doc(1, "context parallel degree (sequence sharding in attention)")
    fsdp_reshard_after_forward: str = doc("default", "default | always | never | N (reshard to groups of N ranks)")
    enable_async_tensor_parallel: bool = doc(False, "fuse TP collectives with matmuls (CUDA + compile)")
    disable_loss_parallel: bool = doc(False, "gather logits before the loss instead of a parallel loss")


@dataclass
class PrecisionConfig:
    """Numeric formats: mixed precision, and low-precision linears through torchao."""

    name: str = doc("fp32", "preset name, recorded in the run summary")
    param_dtype: str = doc("float32", "compute dtype of parameters: float32 | bfloat16")
    reduce_dtype: str = doc("float32", "dtype of gradient reduction: float32 | bfloat16")
    full_bf16: bool = doc(False, "keep parameters and optimizer state in bf16 too (no fp32 master weights)")
    converter: str = doc("none", "none | float8 | mxfp8: swap linears for torchao low-precision training ones")
    float8_recipe: str = doc("tensorwise", "tensorwise | rowwise | rowwise_with_gw_hp")
    float8_enable_fsdp_all_gather: bool = doc(False, "all-gather FSDP shards in float8 (tensorwise only)")
    float8_precompute_dynamic_scale_for_fsdp: bool = doc(
        False, "one all-reduce for every weight's float8 scale after each step (needs float8 all-gather)"
    )
    mx_recipe: str = doc("mxfp8_emulated_rceil", "torchao MXFP8 training recipe: mxfp8_rceil | mxfp8_emulated_rceil | ...")
    filter_fqns: List[str] = doc(["output"], "linears whose name contains one of these stay in high precision")
    emulate: Optional[bool] = doc(None, "emulate low-precision matmuls; null = when the device lacks them")


@dataclass
class CompileConfig:
    enable: bool = doc(False, "torch.compile each transformer block (and the loss)")
    backend: str = doc("inductor", "torch.compile backend: inductor | aot_eager | eager")
    fullgraph: bool = doc(True, "fail on graph breaks instead of silently splitting a block")


@dataclass
class ActivationCheckpointConfig:
    mode: str = doc("none", "none | full (every block) | selective")
    selective_ac_option: str = doc("op", "'op' (per-op save policy) or an integer N (checkpoint every Nth block)")


@dataclass
class CheckpointConfig:
    """Distributed checkpoints (torch.distributed.checkpoint); TorchTitan's field names."""

    enable: bool = doc(False, "save checkpoints; a relaunch with the same run dir resumes from the latest")
    folder: str = doc("checkpoints", "checkpoint folder; a relative path is inside the run dir")
    interval: int = doc(500, "save every this many steps, and at the last step")
    async_mode: str = doc("disabled", "disabled | async (written by a background thread) | async_with_pinned_mem (CUDA)")
    keep_latest_k: int = doc(0, "keep only the k newest complete checkpoints; 0 = keep all")
    load_step: int = doc(-1, "step to resume from; -1 = the latest complete checkpoint")
    exclude_from_loading: List[str] = doc(
        [], "parts not restored: model, optimizer, lr_scheduler, dataloader, train_state, rng"
    )
    initial_load_path: Optional[str] = doc(None, "a step-N checkpoint to start from when the run dir has none of its own")
    initial_load_model_only: bool = doc(True, "take only the model weights from initial_load_path")
    last_save_model_only: bool = doc(False, "the checkpoint at the last step holds the model alone, in export_dtype")
    export_dtype: str = doc("float32", "dtype of model-only checkpoints and exports: float32 | bfloat16 | float16")
    export_format: Optional[str] = doc(
        None, "after training, write <run dir>/export/model.<ext>: safetensors | pt; null = no export"
    )
    create_seed_checkpoint: bool = doc(False, "write the initial weights as step-0 (model only) and stop")
    hsdp_save_replicas: str = doc(
        "all", "with data-parallel replicas: all (every rank writes, DCP de-duplicates) | first (only the first replica writes)"
    )


@dataclass
class ClusterConfig:
    """Where the ranks run. The SLURM fields (cluster=slurm) take the names and meanings of
    hydra-submitit-launcher's, which map onto sbatch options."""

    executor: str = doc("local", "local (processes on this machine) | slurm (a job through submitit) | debug (one rank in-process)")
    nnodes: int = doc(1, "nodes; local runs put every node's ranks on this machine")
    nproc_per_node: Optional[int] = doc(None, "ranks per node; null = what the parallelism degrees need (slurm: gpus_per_node when set)")
    cpu_malloc_mmap_threshold_mib: Optional[int] = doc(
        16, "CPU ranks: glibc serves allocations >= this from mmap, so freed buffers go back to the OS "
        "(null = glibc's default, whose heap grows ~2x under FSDP); see BENCHMARKS.md"
    )
    # SLURM (cluster=slurm): one task per rank, nnodes x nproc_per_node tasks.
    gpus_per_node: int = doc(0, "slurm: GPUs per node (--gpus-per-node), one rank per GPU; 0 = CPU nodes (gloo)")
    partition: Optional[str] = doc(None, "slurm: partition (-p); null = the cluster's default partition")
    account: Optional[str] = doc(None, "slurm: account to charge (-A)")
    qos: Optional[str] = doc(None, "slurm: quality of service (--qos)")
    timeout_min: int = doc(60, "slurm: time limit in minutes (-t); the job checkpoints and requeues before it")
    constraint: Optional[str] = doc(None, "slurm: node features required (-C)")
    exclude: Optional[str] = doc(None, "slurm: nodes not to use (-x)")
    cpus_per_task: int = doc(1, "slurm: CPU cores per rank (-c)")
    mem_gb: Optional[int] = doc(None, "slurm: memory per node in GiB (--mem); null = the partition's default")
    mail_user: Optional[str] = doc(None, "slurm: address for job mail (--mail-user)")
    mail_type: Optional[str] = doc(None, "slurm: events to mail about, e.g. END,FAIL (--mail-type)")
    name: str = doc("titan_exp", "slurm: job name (-J)")
    additional_parameters: Dict[str, Any] = doc({}, "slurm: any other sbatch option, e.g. +cluster.additional_parameters.reservation=x")
    setup: List[str] = doc([], "slurm: shell lines run before the ranks start (module load, conda activate, ...)")
    env: Dict[str, str] = doc({}, "slurm: environment of the ranks, e.g. +cluster.env.HF_HOME=/scratch/hf; keep secrets in the submitting shell's environment (sbatch passes it on), not here")
    srun_args: List[str] = doc([], "slurm: extra srun arguments, e.g. [--cpu-bind=none]")
    signal_delay_s: int = doc(120, "slurm: SIGUSR2 this many seconds before the time limit: checkpoint and requeue")
    max_num_timeout: int = doc(3, "slurm: requeues after a time limit before the job gives up (preemptions do not count)")
    array_parallelism: int = doc(256, "slurm: members of a multirun job array that may run at once")
    wait: bool = doc(False, "slurm: wait for the job and return its result, instead of returning once it is queued")


@dataclass
class DataConfig:
    dataset: str = doc("pydoc_topics", "pydoc_topics (bundled) | text | json | c4 | any hub id")
    path: Optional[str] = doc(None, "local file or glob for text/json; resolved at launch for pydoc_topics")
    text_field: str = doc("text", "field holding the document text (json and hub data sets)")
    tokenizer_path: Optional[str] = doc(None, "a tokenizers JSON file; null = BPE trained on the default corpus")
    tokenizer_vocab_size: int = doc(2048, "vocabulary of the trained BPE when tokenizer_path is null")


@dataclass
class TrainingConfig:
    steps: int = doc(40, "optimizer steps")
    local_batch_size: int = doc(8, "sequences per rank per forward/backward (micro) batch")
    global_batch_size: int = doc(-1, "sequences per step across data parallel ranks; -1 = local x dp")
    seq_len: int = doc(128, "tokens per sequence")
    max_norm: float = doc(1.0, "gradient clipping norm; 0 disables clipping")
    seed: int = doc(42, "seed for weights and every random op")
    deterministic: bool = doc(False, "torch.use_deterministic_algorithms(True)")
    on_nonfinite: str = doc(
        "stop", "a step whose loss or gradients are NaN/Inf: stop (fail naming the step; the last checkpoint "
        "stays the latest) | skip (no update for that step, logged; stops after 10 in a row)"
    )


@dataclass
class CommConfig:
    """Collective timeouts (TorchTitan's names): a rank that dies or hangs ends the run instead
    of leaving the others waiting forever."""

    init_timeout_seconds: int = doc(300, "timeout of every collective until the first step is done (compile, first gathers)")
    train_timeout_seconds: int = doc(600, "timeout of every collective after the first step; a step running 5 s "
                                     "longer than this ends the rank with its stack in its log (watchdog)")


@dataclass
class OptimizerConfig:
    name: str = doc("AdamW", "AdamW | Adam")
    lr: float = doc(8e-4, "peak learning rate")
    beta1: float = doc(0.9, "Adam beta1")
    beta2: float = doc(0.95, "Adam beta2")
    eps: float = doc(1e-8, "Adam epsilon")
    weight_decay: float = doc(0.1, "decoupled weight decay")


@dataclass
class LRSchedulerConfig:
    """Warmup-stable-decay: linear warmup, flat, then decay over the last decay_ratio of steps."""

    warmup_steps: int = doc(2, "linear warmup steps")
    decay_ratio: Optional[float] = doc(None, "fraction of steps spent decaying; null = decay after warmup")
    decay_type: str = doc("linear", "linear | sqrt | cosine")
    min_lr_factor: float = doc(0.0, "final lr as a fraction of the peak")


@dataclass
class MetricsConfig:
    log_freq: int = doc(5, "log metrics every this many steps")
    enable_tensorboard: bool = doc(False, "write TensorBoard events to <run dir>/tb")
    enable_wandb: bool = doc(False, "log to Weights & Biases")
    wandb_project: str = doc("titan_exp", "wandb project")
    wandb_mode: str = doc("offline", "online | offline (offline needs no network)")
    peak_tflops: Optional[float] = doc(
        None, "per-device peak for MFU; null = looked up by GPU name, or on CPU measured at launch and shared by the ranks"
    )
    warmup_steps: int = doc(2, "steps left out of the summary's steady-state throughput")


@dataclass
class JobConfig:
    """The whole job: one node per group."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


GROUPS = {
    "model": ModelConfig,
    "parallelism": ParallelismConfig,
    "precision": PrecisionConfig,
    "checkpoint": CheckpointConfig,
    "cluster": ClusterConfig,
    "data": DataConfig,
}


def to_job_config(cfg: DictConfig | dict) -> JobConfig:
    """Typed JobConfig from a composed DictConfig (or a plain dict), ignoring Hydra's own node."""
    cfg = OmegaConf.create(cfg) if not isinstance(cfg, DictConfig) else cfg
    plain = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k != "hydra"}
    merged = OmegaConf.merge(OmegaConf.structured(JobConfig), plain)
    return OmegaConf.to_object(merged)


def to_yaml(job: JobConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(job))


def load_job_config(path: str) -> JobConfig:
    return to_job_config(OmegaConf.load(path))


def help_text() -> str:
    """Every field with its default and doc, grouped by node: the body of `launch.py --help`."""
    lines = []
    for top in dataclasses.fields(JobConfig):
        schema = top.default_factory
        lines.append(f"{top.name}:")
        for f in dataclasses.fields(schema):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  {f.name} = {default!r}\n      {f.metadata.get('doc', '')}")
    return "\n".join(lines)


def register_configs() -> None:
    """Register the schema as Hydra's base config and a help page generated from the field docs."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="job_schema", node=JobConfig)
    # Named sweeps (`python launch.py -m +sweep=NAME`), the ladder's rungs and the planner's
    # layouts (titan_exp.plan --write-sweep), from sweeps/.
    for group, folder in sweep_groups().items():
        for preset in sorted(folder.glob("*.yaml")):
            cs.store(group=group, name=preset.stem, node=OmegaConf.load(preset), package="_global_")
    template = (
        "== titan_exp ==\n"
        "Train Llama-family models with N-D parallelism.\n"
        "  python launch.py [group=option ...] [key=value ...]   e.g. parallelism=fsdp cluster.nproc_per_node=2\n"
        "  python launch.py --cfg job                            print the composed config\n"
        "  python launch.py -m key=a,b                           sweep (Hydra multirun)\n\n"
        "== Config groups ==\n$APP_CONFIG_GROUPS\n\n"
        "== Fields (default, doc) ==\n" + help_text().replace("$", "$$") + "\n\n"
        "Hydra's own options: python launch.py --hydra-help\n"
    )
    cs.store(group="hydra/help", name="titan_exp", node={"app_name": "titan_exp", "header": "", "footer": "", "template": template})
