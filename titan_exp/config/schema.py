"""Typed schemas for the config groups (the model's in model.py), JobConfig that holds them all,
and the values derived from them.

Each group is a dataclass registered in Hydra's ConfigStore; the YAML presets in `conf/` only
change values, so a typo, a value of the wrong type or a choice that is not on the list is
rejected by OmegaConf at composition, naming the field and the choices. Every field carries a
one-line doc (``metadata["doc"]``) that `python launch.py --help` prints, and counts carry their
lower bound (``metadata["min"]``), checked first by `titan_exp.config.validate`. Cross-field
rules live with the component they configure (its `check`), which `validate` gathers.

A derived value has one home: the head width, kv heads, the SwiGLU width and parameter counts on
ModelConfig; the degrees, their product and the layout label on ParallelismConfig; the world size
on JobConfig. How a field is declared (its doc, its choices, its validation message) is fields.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from titan_exp.config.fields import (
    DEGREE_FIELDS,
    ACMode,
    AsyncMode,
    AutotuneAxis,
    CheckpointPart,
    CompileBackend,
    Converter,
    DecayType,
    DType,
    Executor,
    ExportDType,
    ExportFormat,
    Float8Recipe,
    MuonAdjustLR,
    MXRecipe,
    OnNonfinite,
    OptimizerImpl,
    PipelineSchedule,
    SaveReplicas,
    WandbMode,
    doc,
    target,
    target_kwargs,
)
from titan_exp.config.model import ModelConfig


@dataclass
class ParallelismConfig:
    """Degrees of the named DeviceMesh (pp, dp_replicate, dp_shard, cp, tp); TorchTitan's names."""

    data_parallel_replicate_degree: int = doc(1, "replicas (DDP, or the outer dim of HSDP)", min=1)
    data_parallel_shard_degree: int = doc(-1, "FSDP shards; -1 = the rest of the world size")
    tensor_parallel_degree: int = doc(1, "tensor parallel degree (with sequence parallel)", min=1)
    pipeline_parallel_degree: int = doc(1, "pipeline stages across ranks", min=1)
    pipeline_parallel_schedule: PipelineSchedule = doc(PipelineSchedule["1F1B"],
                                                       "torch.distributed.pipelining schedule")
    pipeline_parallel_microbatch_size: int = doc(1, "sequences per pipeline microbatch", min=1)
    pipeline_parallel_stages_per_rank: Optional[int] = doc(
        None, "stages each pipeline rank holds; null = from layers_per_stage, else 1 (2 for looped/V schedules)"
    )
    pipeline_parallel_layers_per_stage: Optional[int] = doc(
        None, "transformer blocks per stage; sets the stage count to n_layers / this, the ends counted as below "
              "(null = split evenly)"
    )
    pipeline_parallel_first_stage_less_layers: int = doc(
        0, "blocks fewer on the first stage: its embedding counts as this many in the split (TorchTitan's option; "
           "1 there, and Megatron's account_for_embedding_in_pipeline_split)", min=0)
    pipeline_parallel_last_stage_less_layers: int = doc(
        0, "blocks fewer on the last stage: its norm, output and loss count as this many in the split (TorchTitan's "
           "option; 1 there, and Megatron's account_for_loss_in_pipeline_split)", min=0)
    context_parallel_degree: int = doc(1, "context parallel degree (sequence sharding in attention)", min=1)
    expert_parallel_degree: int = doc(1, "expert parallel degree: ranks the routed experts are split over, carved "
                                         "out of data_parallel_shard_degree x context_parallel_degree x "
                                         "tensor_parallel_degree (all of cp and tp)", min=1)
    fsdp_reshard_after_forward: str = doc("default", "default | always | never | N (reshard to groups of N ranks)")
    enable_async_tensor_parallel: bool = doc(False, "fuse TP collectives with matmuls (CUDA + compile)")
    disable_loss_parallel: bool = doc(False, "gather logits before the loss instead of a parallel loss")

    @property
    def degrees(self) -> dict[str, int]:
        """Mesh dim -> degree as configured (dp_shard may be -1: the rest of the world)."""
        return {dim: getattr(self, name) for dim, name in DEGREE_FIELDS.items()}

    @property
    def layout(self) -> dict[str, int]:
        """The degrees, and ep when expert parallel is on (ep is carved out of dp_shard x cp x tp, so it
        is not a factor of the world size): what summaries and reports name a layout by."""
        return self.degrees | ({"ep": self.expert_parallel_degree} if self.expert_parallel_degree > 1 else {})

    @property
    def dispatch_split(self) -> int:
        """The ranks a microbatch's routed tokens are split over within one TP group: all tp of
        them under expert parallel, which spreads over TP (parallel.expert); 1 without it (every
        TP rank runs every routed token, through its slice of each expert: expert_width_split)."""
        return self.tensor_parallel_degree if self.expert_parallel_degree > 1 else 1

    @property
    def expert_width_split(self) -> int:
        """The ranks each routed expert's hidden width is split over: all tp of them without
        expert parallel (parallel.tensor, TorchTitan's expert tensor parallel); 1 under it, whose
        ranks hold whole experts and split the tokens instead (dispatch_split). Either way a TP
        rank does 1/tp of its TP group's routed work."""
        return 1 if self.expert_parallel_degree > 1 else self.tensor_parallel_degree

    @property
    def known_degree(self) -> int:
        """The product of every degree but dp_shard's."""
        return math.prod(d for dim, d in self.degrees.items() if dim != "dp_shard")

    def dp_shard_at(self, world: int) -> int:
        """dp_shard on `world` ranks: as configured, or with -1 the rest of them (at least 1)."""
        shard = self.data_parallel_shard_degree
        return shard if shard != -1 else max(1, world // self.known_degree)

    def dp_at(self, world: int) -> int:
        """Data-parallel ranks on `world` ranks: dp_replicate x dp_shard_at(world)."""
        return self.data_parallel_replicate_degree * self.dp_shard_at(world)

    def lays_out(self, world: int) -> bool:
        """Whether these degrees multiply to `world` ranks (dp_shard = -1 taking the rest)."""
        return world % self.known_degree == 0 and self.known_degree * self.dp_shard_at(world) == world


# In precision.filter_fqns, TorchTitan's name for torchao's float8 shape filter: a linear stays in
# high precision where its recipe's float8 GEMM and casts were measured slower than bf16's on an
# H100 (torchao.float8._auto_filter_for_recipe, torchao/float8/README.md's performance tables).
AUTO_FILTER = "auto_filter_small_kn"


@dataclass
class PrecisionConfig:
    """Numeric formats: mixed precision, and low-precision linears through torchao."""

    name: str = doc("fp32", "preset name, recorded in the run summary")
    param_dtype: DType = doc(DType.float32, "compute dtype of parameters")
    reduce_dtype: DType = doc(DType.float32, "dtype of gradient reduction")
    full_bf16: bool = doc(False, "keep parameters and optimizer state in bf16 too (no fp32 master weights)")
    converter: Converter = doc(Converter.none, "swap linears for torchao's low-precision training ones")
    float8_recipe: Float8Recipe = doc(Float8Recipe.tensorwise, "torchao float8 scaling recipe")
    float8_enable_fsdp_all_gather: bool = doc(False, "all-gather FSDP shards in float8 (tensorwise only)")
    float8_precompute_dynamic_scale_for_fsdp: bool = doc(
        False, "one all-reduce for every weight's float8 scale after each step (needs float8 all-gather)"
    )
    mx_recipe: MXRecipe = doc(MXRecipe.mxfp8_emulated_rceil, "torchao MXFP8 training recipe")
    filter_fqns: List[str] = doc(["output"], "linears whose name contains one of these stay in high precision; "
                                 f"'{AUTO_FILTER}' adds torchao's float8 shape filter (as TorchTitan)")
    emulate: Optional[bool] = doc(None, "emulate low-precision matmuls; null = when the device lacks them")

    @property
    def shape_filterable(self) -> bool:
        """Whether torchao's float8 shape filter (AUTO_FILTER) has thresholds for this recipe:
        float8 tensorwise or rowwise."""
        return self.converter == Converter.float8 and self.float8_recipe != Float8Recipe.rowwise_with_gw_hp


@dataclass
class CompileConfig:
    enable: bool = doc(False, "torch.compile each transformer block (and the loss)")
    backend: CompileBackend = doc(CompileBackend.inductor, "torch.compile backend")
    fullgraph: bool = doc(True, "fail on graph breaks instead of silently splitting a block")


@dataclass
class ActivationCheckpointConfig:
    mode: ACMode = doc(ACMode.none, "none, full (every block) or selective")
    selective_ac_option: str = doc("op", "'op' (per-op save policy) or an integer N (checkpoint every Nth block)")


@dataclass
class CheckpointConfig:
    """Distributed checkpoints (torch.distributed.checkpoint); TorchTitan's field names."""

    enable: bool = doc(False, "save checkpoints; a relaunch with the same run dir resumes from the latest")
    folder: str = doc("checkpoints", "checkpoint folder; a relative path is inside the run dir")
    interval: int = doc(500, "save every this many steps, and at the last step")
    async_mode: AsyncMode = doc(AsyncMode.disabled, "async: written by a background thread; "
                                                    "async_with_pinned_mem: CUDA")
    keep_latest_k: int = doc(0, "keep only the k newest complete checkpoints; 0 = keep all")
    load_step: int = doc(-1, "step to resume from; -1 = the latest complete checkpoint")
    exclude_from_loading: List[CheckpointPart] = doc([], "parts not restored")
    initial_load_path: Optional[str] = doc(None, "a step-N checkpoint to start from "
                                                 "when the run dir has none of its own")
    initial_load_model_only: bool = doc(True, "take only the model weights from initial_load_path")
    initial_load_in_hf: bool = doc(False, "initial_load_path is a Hugging Face Llama directory (config.json and "
                                          "safetensors, sharded or not): its weights, into any layout")
    last_save_in_hf: bool = doc(False, "after training, also write <run dir>/export/hf: a Hugging Face Llama "
                                       "directory that transformers loads (in export_dtype, with the run's "
                                       "tokenizer; needs transformers)")
    last_save_model_only: bool = doc(False, "the checkpoint at the last step holds the model alone, in export_dtype")
    export_dtype: ExportDType = doc(ExportDType.float32, "dtype of model-only checkpoints and exports")
    export_format: Optional[ExportFormat] = doc(None, "after training, write <run dir>/export/model.<ext>; "
                                                      "null = no export")
    create_seed_checkpoint: bool = doc(False, "write the initial weights as step-0 (model only) and stop")
    hsdp_save_replicas: SaveReplicas = doc(
        SaveReplicas.all, "with data-parallel replicas: all (every rank writes, DCP de-duplicates) "
        "or first (only the first replica writes)"
    )


@dataclass
class ClusterConfig:
    """Where the ranks run. The SLURM fields (cluster=slurm) take the names and meanings of
    hydra-submitit-launcher's, which map onto sbatch options."""

    executor: Executor = doc(Executor.local, "local (processes on this machine), slurm (a job through submitit) or "
                                             "debug (one rank in-process)")
    nnodes: int = doc(1, "nodes; local runs put every node's ranks on this machine", min=1)
    nproc_per_node: Optional[int] = doc(None, "ranks per node; null = what the parallelism degrees need "
                                              "(slurm: gpus_per_node when set)")
    cpu_malloc_mmap_threshold_mib: Optional[int] = doc(
        16, "CPU ranks: glibc serves allocations >= this from mmap, so freed buffers go back to the OS "
        "(null = glibc's default, whose heap grows ~2x under FSDP); see BENCHMARKS.md"
    )
    cuda_expandable_segments: bool = doc(
        True, "GPU ranks: PyTorch's caching allocator grows its segments in place (PYTORCH_CUDA_ALLOC_CONF="
        "expandable_segments:True, as TorchTitan's launcher sets), so what it reserves stays near what is "
        "allocated; false = PyTorch's default; a PYTORCH_CUDA_ALLOC_CONF of the user's own wins"
    )
    fork_ranks: bool = doc(True, "local CPU ranks fork from a server that imported them once "
                                 "(titan_exp.cluster.forkserver: a launch's ranks start at once, a sweep's later "
                                 "members import nothing); false = each rank a fresh `python -m` process, as GPU ranks "
                                 "always are")
    elastic: bool = doc(False, "a run resumed on a world size its layout cannot use continues in the planner's "
                               "fastest layout for that world (same global batch), from its checkpoint")
    hardware: Optional[str] = doc(None, "a YAML file describing the GPUs the ranks run on (device: a spec name or its "
                                        "numbers, gpus_per_node: the most ranks a node holds, nvlink_gb_s, "
                                        "network_gb_s, nvlink_bus_gb_s, network_bus_gb_s, latency_nvlink_us, "
                                        "latency_network_us, power_limit_w, host_cpu): every prediction for this job "
                                        "uses it (autotune, the dry run, cluster.elastic, the launch's predicted "
                                        "step); null = this machine's profile")
    # SLURM (cluster=slurm): one task per rank, nnodes x nproc_per_node tasks.
    min_nodes: Optional[int] = doc(None, "slurm: the job may start on as few as this many nodes (--nodes="
                                         "min_nodes-nnodes; needs cluster.elastic=true); null = exactly nnodes")
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
    additional_parameters: Dict[str, Any] = doc({}, "slurm: any other sbatch option, "
                                                    "e.g. +cluster.additional_parameters.reservation=x")
    setup: List[str] = doc([], "slurm: shell lines run before the ranks start (module load, conda activate, ...)")
    env: Dict[str, str] = doc({}, "slurm: environment of the ranks, e.g. +cluster.env.HF_HOME=/scratch/hf; keep "
                                  "secrets in the submitting shell's environment (sbatch passes it on), not here")
    srun_args: List[str] = doc([], "slurm: extra srun arguments, e.g. [--cpu-bind=none]; --kill-on-bad-exit=1 (a "
                               "task that dies ends the others) unless one is given")
    signal_delay_s: int = doc(120, "slurm: SIGUSR2 this many seconds before the time limit: checkpoint and requeue")
    max_num_timeout: int = doc(3, "slurm: requeues after a time limit before the job gives up "
                                  "(preemptions do not count)")
    array_parallelism: int = doc(256, "slurm: members of a multirun job array that may run at once")
    wait: bool = doc(False, "slurm: wait for the job and return its result, instead of returning once it is queued")
    dry_run: bool = doc(False, "build rank dry_run_rank of this layout alone, here, on torch's fake process group "
                               "(no other rank exists, nothing is submitted), run one step and report its memory "
                               "beside the planner's (TorchTitan's fake backend)")
    dry_run_rank: int = doc(0, "the rank cluster.dry_run builds", min=0)

    def nodes_for(self, world: int) -> int:
        """The nodes `world` ranks span: nnodes when it divides them, else one (a world size
        the planner or calibration picked that does not fit this job's nodes)."""
        return self.nnodes if world % self.nnodes == 0 else 1


@dataclass
class SourceConfig:
    """One source of a data mixture (data.mixture): the fields of `data` that name documents,
    and its weight."""

    dataset: Optional[str] = doc(None, "as data.dataset: json | text | parquet | csv | arrow | tokens | a hub id")
    path: Optional[str] = doc(None, "as data.path: a file, a glob, a directory, or a token store's folder")
    name: Optional[str] = doc(None, "as data.name: a hub data set's subset")
    split: str = doc("train", "as data.split")
    text_field: str = doc("text", "as data.text_field")
    weight: float = doc(1.0, "the source's share of the training rows is weight / the sum of the weights (> 0)")
    label: Optional[str] = doc(None, "its name in metrics, summary.json and the report; null = its path's or data "
                                     "set's name")
    validation_path: Optional[str] = doc(None, "held-out files of this source (a token store for dataset=tokens); "
                                               "null = the validation.split of its directory or hub data set")


@dataclass
class DataConfig:
    _target_: str = target("titan_exp.data.loader.build_loader",
                           "(dataset, tokenizer, seq_len=, global_batch_size=, ...)")
    kwargs: Dict[str, Any] = target_kwargs()
    dataset: str = doc("pydoc_topics", "pydoc_topics (bundled) | json | text | parquet | csv | arrow (local files, "
                                       "through datasets) | tokens (a store made by python -m titan_exp.data.prepare) "
                                       "| c4 | any Hugging Face hub id")
    path: Optional[str] = doc(None, "local builders: a file, a glob, or a directory whose files are named by split "
                                    "(train.jsonl, validation.parquet, ...); set at launch for pydoc_topics")
    name: Optional[str] = doc(None, "hub data sets: the subset (configuration), e.g. en for allenai/c4")
    split: str = doc("train", "the split to train on (a directory's files or the hub's splits)")
    pretokenize: bool = doc(False, "tokenize the data once into a token store in the cache (keyed by data and "
                                   "tokenizer) and train from it: each rank reads only its own rows")
    text_field: str = doc("text", "field holding the document text (the text builder's is always text)")
    tokenizer_path: Optional[str] = doc(None, "a tokenizer.json, or a directory holding one (the Hugging Face / "
                                              "Llama 3 layout, whose tokenizer_config.json names BOS/EOS); null = BPE "
                                              "trained on the default corpus")
    tokenizer_vocab_size: int = doc(2048, "vocabulary of the trained BPE when tokenizer_path is null")
    mixture: List[SourceConfig] = doc([], "train on several sources, each global batch's rows drawn by weight with a "
                                          "seeded generator (titan_exp.data.mixture), instead of dataset/path/name/"
                                          "split/text_field: [{dataset: json, path: a.jsonl, weight: 3}, ...]")


@dataclass
class ValidationConfig:
    """Held-out loss every `freq` steps (TorchTitan's names), in every layout, with training's
    batch shapes; its data is the data node with these fields changed."""

    enable: bool = doc(False, "compute the validation loss and perplexity every freq steps and at the last step")
    freq: int = doc(10, "steps between validations", min=1)
    steps: int = doc(2, "global batches per validation (the same batches every time)", min=1)
    dataset: Optional[str] = doc(None, "null = data.dataset")
    path: Optional[str] = doc(None, "held-out files (a file, glob or directory); null = data.path, whose directory "
                                    "(or hub data set) then needs this split")
    name: Optional[str] = doc(None, "null = data.name")
    split: str = doc("validation", "the held-out split (of a directory or a hub data set; "
                                   "files given in path are read whole)")


@dataclass
class EvalConfig:
    """Downstream evaluation with lm-evaluation-harness (`pip install 'titan_exp[eval]'`): every
    `freq` steps and at the last step the model is exported as a Hugging Face directory and scored
    in a separate process while training goes on (titan_exp.eval)."""

    enable: bool = doc(False, "evaluate every freq steps and at the last step, in a process of its own")
    freq: int = doc(100, "steps between evaluations; one still running at the next is skipped (the last is awaited)",
                    min=1)
    tasks: List[str] = doc([], "lm-eval task names, e.g. [hellaswag] or your own from include_path")
    include_path: Optional[str] = doc(None, "a directory of your own lm-eval task YAMLs (their relative data_files "
                                            "are read from it)")
    limit: Optional[int] = doc(None, "documents per task; null = all")
    batch_size: int = doc(8, "sequences per evaluation forward", min=1)
    device: Optional[str] = doc(None, "where the evaluator runs: cpu, cuda or cuda:N; null = rank 0's device")


@dataclass
class TrainingConfig:
    _target_: str = target("titan_exp.train.trainer.Trainer", "(job, run_dir, device); a subclass plugs in")
    kwargs: Dict[str, Any] = target_kwargs()
    steps: int = doc(40, "optimizer steps", min=1)
    local_batch_size: int = doc(8, "sequences per rank per forward/backward (micro) batch", min=1)
    global_batch_size: int = doc(-1, "sequences per step across data parallel ranks; -1 = local x dp")
    seq_len: int = doc(128, "tokens per sequence", min=1)
    max_norm: float = doc(1.0, "gradient clipping norm; 0 disables clipping", inf="no limit, as 0")
    seed: int = doc(42, "seed for weights and every random op")
    deterministic: bool = doc(False, "torch.use_deterministic_algorithms(True)")
    on_nonfinite: OnNonfinite = doc(
        OnNonfinite.stop, "a step whose loss or gradients are NaN/Inf: stop (fail naming the step; the last "
        "checkpoint stays the latest) or skip (no update for that step, logged; stops after 10 in a row)"
    )


@dataclass
class CommConfig:
    """Collective timeouts (TorchTitan's names): a rank that dies or hangs ends the run instead
    of leaving the others waiting forever."""

    init_timeout_seconds: int = doc(300, "timeout of every collective until the first step is done "
                                         "(compile, first gathers)")
    train_timeout_seconds: int = doc(600, "timeout of every collective after the first step; a step running 5 s "
                                     "longer than this ends the rank with its stack in its log (watchdog)")


@dataclass
class MuonConfig:
    """Muon's group under optimizer=muon (titan_exp.train.muon): the blocks' weight matrices
    (attention, feed-forward, each routed expert's own), orthogonalised whole on every layout."""

    lr: Optional[float] = doc(None, "peak learning rate of the matrices; null = optimizer.lr (with adjust_lr="
                                    "match_rms_adamw the update's RMS matches AdamW's, so one lr serves both groups)")
    weight_decay: Optional[float] = doc(None, "decoupled weight decay of the matrices; null = optimizer.weight_decay")
    momentum: float = doc(0.95, "momentum of the gradient average Muon orthogonalises")
    nesterov: bool = doc(True, "Nesterov momentum: orthogonalise the gradient pulled towards the average")
    ns_coefficients: List[float] = doc([3.4445, -4.7750, 2.0315], "Newton-Schulz quintic coefficients (a, b, c), "
                                                                 "Keller Jordan's")
    ns_steps: int = doc(5, "Newton-Schulz iterations")
    ns_dtype: Optional[DType] = doc(None, "dtype of the Newton-Schulz iterations; null = bfloat16 on GPUs (torch's "
                                          "and the published choice), float32 on CPUs (layouts then agree to fp32 "
                                          "rounding; bf16 rounds their ulp-apart gradients apart)")
    eps: float = doc(1e-7, "floor of the norm a matrix is divided by before the iterations")
    adjust_lr: MuonAdjustLR = doc(MuonAdjustLR.match_rms_adamw,
                                  "lr scale by matrix shape (out A, in B): match_rms_adamw = 0.2 sqrt(max(A, B)) "
                                  "(Moonlight), original = sqrt(max(1, A / B)) (Keller Jordan)")


@dataclass
class OptimizerConfig:
    """optimizer=adamw (the default): AdamW over every parameter. optimizer=muon: Muon's group
    (`muon`) for the blocks' weight matrices and AdamW (these top-level fields) for the rest."""

    _target_: str = target("torch.optim.AdamW", "(params, lr=, betas=, eps=, weight_decay=, foreach=, fused=) where it "
                                                "takes them")
    kwargs: Dict[str, Any] = target_kwargs()
    implementation: OptimizerImpl = doc(OptimizerImpl.auto, "the update's kernels (TorchTitan's field): fused = one "
                                                            "kernel a parameter group; foreach = a kernel an op over "
                                                            "every tensor; for-loop = per tensor; auto = fused on "
                                                            "GPUs, foreach on CPUs")
    lr: float = doc(8e-4, "peak learning rate (optimizer=muon: of the AdamW group)")
    beta1: float = doc(0.9, "Adam beta1")
    beta2: float = doc(0.95, "Adam beta2")
    eps: float = doc(1e-8, "Adam epsilon")
    weight_decay: float = doc(0.1, "decoupled weight decay")
    muon: MuonConfig = field(default_factory=MuonConfig)


@dataclass
class LRSchedulerConfig:
    """Warmup-stable-decay: linear warmup, flat, then decay over the last decay_ratio of steps
    (the lr_lambda offered to _target_; another scheduler takes its own kwargs)."""

    _target_: str = target("torch.optim.lr_scheduler.LambdaLR",
                           "(optimizer, lr_lambda=, total_steps=) where it takes them")
    kwargs: Dict[str, Any] = target_kwargs()

    warmup_steps: int = doc(2, "linear warmup steps")
    decay_ratio: Optional[float] = doc(None, "fraction of steps spent decaying; null = decay after warmup")
    decay_type: DecayType = doc(DecayType.linear, "shape of the decay")
    min_lr_factor: float = doc(0.0, "final lr as a fraction of the peak")


@dataclass
class MetricsConfig:
    log_freq: int = doc(5, "log metrics every this many steps", min=1)
    enable_tensorboard: bool = doc(False, "write TensorBoard events to <run dir>/tb")
    enable_wandb: bool = doc(False, "log to Weights & Biases")
    # wandb's own settings: null leaves them to its WANDB_* environment variables.
    wandb_entity: Optional[str] = doc(None, "team or user; null = WANDB_ENTITY, else your default entity")
    wandb_project: Optional[str] = doc(None, "null = WANDB_PROJECT, else 'titan_exp'")
    wandb_group: Optional[str] = doc(None, "null = WANDB_RUN_GROUP, else a sweep's members share the sweep dir's name")
    wandb_tags: List[str] = doc([], "tags on the run (WANDB_TAGS adds to them)")
    wandb_name: Optional[str] = doc(None, "null = WANDB_NAME, else a sweep member's overrides (Hydra's "
                                          "override_dirname), else the run dir's name")
    wandb_mode: Optional[WandbMode] = doc(None, "online, offline or disabled; null = WANDB_MODE, else online when "
                                                "logged in (WANDB_API_KEY or ~/.netrc), else offline")
    peak_tflops: Optional[float] = doc(
        None, "per-device peak for MFU; null = looked up by GPU name, "
        "or on CPU measured at launch and shared by the ranks"
    )
    warmup_steps: int = doc(2, "steps left out of the summary's steady-state throughput")


@dataclass
class ProfilingConfig:
    """torch.profiler traces and memory snapshots in the run dir (TorchTitan's field names)."""

    enable_profiling: bool = doc(False, "trace one step in every profile_freq with torch.profiler (Perfetto / "
                                        "chrome://tracing), every rank")
    profile_freq: int = doc(10, "steps between traced steps", min=2)
    save_traces_folder: str = doc("profile_traces", "<run dir>/<this>/iteration_<step>/rank<r>_trace.json")
    enable_memory_snapshot: bool = doc(False, "CUDA: the allocator's memory snapshot (pytorch.org/memory_viz) at "
                                              "the end; CPU: peak resident memory per phase of every step")
    save_memory_snapshot_folder: str = doc("memory_snapshot", "<run dir>/<this>/rank<r>_memory_snapshot.pickle "
                                                              "(CUDA) or rank<r>_memory_phases.json (CPU)")


@dataclass
class AutotuneConfig:
    """`python launch.py -m +sweep=autotune`: predict every candidate, measure those that may be the
    fastest, round after round until one is (titan_exp.perf.autotune)."""

    search: List[AutotuneAxis] = doc([AutotuneAxis.layout],
                                     "the axes to search, a list: autotune.search=[layout,compile]")
    top_k: Optional[int] = doc(None, "at most this many candidates in the first round; null = every one whose "
                               "predicted interval reaches the best one's")
    calibrate: bool = doc(True, "autotune and `python -m titan_exp.perf.plan` first measure what the machine profile "
                          "lacks (the model's block at every TP degree, compile if searched, the collectives); "
                          "false = estimate it from FLOPs, and say so")
    budget_minutes: float = doc(30.0, "machine time the measuring may take; rounds that would overrun are not started",
                                inf="no limit")
    warmup_steps: int = doc(2, "untimed steps at the start of every member (compile, allocator)", min=0)
    steps: int = doc(4, "timed steps per member in the first round; each later round doubles them", min=2)
    drop_slower_than: float = doc(0.5, "a member measured below this share of the round's fastest is dropped at once")
    tolerance: float = doc(0.02, "a candidate that cannot be more than this share faster than the fastest measured is "
                                 "as good as tied: no more rounds are spent telling them apart")
    device_memory_gib: Optional[float] = doc(None, "memory per device for pruning (and cluster.elastic's re-plan); "
                                                   "null = cluster.hardware's GPU's, else this GPU's, or RAM / world")
    refit: bool = doc(True, "refit the machine profile's corrections to the measured members")


@dataclass
class SweepConfig:
    """What a multirun member tells Hydra's sweeper."""

    objective: Optional[str] = doc(None, "a number in summary.json each member returns to the sweeper (e.g. "
                                         "tokens_per_second_per_device, final_loss, or eval.<task>.<metric> of "
                                         "eval.enable) for optimising sweepers like hydra/sweeper=optuna, whose own "
                                         "config sets the direction; NaN when the member failed; null = the exit code")


@dataclass
class JobConfig:
    """The whole job: one node per group, and the modules a `_target_` may name."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    autotune: AutotuneConfig = field(default_factory=AutotuneConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    allowed_targets: List[str] = doc([], "modules whose classes a _target_ may name besides titan_exp, torch.optim "
                                         "and torch.nn, e.g. allowed_targets=[mylab]")

    @property
    def world_size(self) -> int:
        """Ranks the job runs on: nnodes x nproc_per_node, one rank per GPU on SLURM GPU nodes,
        or what the degrees need when neither is set."""
        c = self.cluster
        if c.nproc_per_node is not None:
            return c.nnodes * c.nproc_per_node
        if c.executor == Executor.slurm and c.gpus_per_node > 0:
            return c.nnodes * c.gpus_per_node
        return self.parallelism.known_degree * max(1, self.parallelism.data_parallel_shard_degree)

    def global_batch_at(self, world: int) -> int:
        """Sequences a step takes on `world` ranks: training.global_batch_size, or with -1 the local
        batch on each data-parallel rank (dp_replicate x dp_shard at that world)."""
        t = self.training
        return t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * self.parallelism.dp_at(world)

    @property
    def accumulation(self) -> int:
        """Gradient accumulation steps: the global batch over the local batch x dp, at world_size."""
        world = self.world_size
        return max(1, self.global_batch_at(world) // (self.training.local_batch_size * self.parallelism.dp_at(world)))


