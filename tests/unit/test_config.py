"""Composition, typing and validation: no process is started here."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import compose, job_config, launch_cli
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from titan_exp.config import CONF
from titan_exp.validation import resolve, validate

PRESETS = {group: sorted(p.stem for p in (CONF / group).glob("*.yaml"))
           for group in ("model", "parallelism", "precision", "checkpoint", "cluster", "data")}


# Presets that need another group's choice to be valid: expert parallel needs an MoE model.
NEEDS = {("parallelism", "ep"): ["model=moe_debug"], ("parallelism", "3d_ep"): ["model=moe_debug"]}


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in PRESETS.items() for o in opts])
def test_every_preset_composes_and_validates(group, option):
    job = job_config([f"{group}={option}", *NEEDS.get((group, option), [])])
    if group == "data" and option != "default":
        return  # hub data sets need a network at run time, not at validation
    assert validate(job, cuda=False) == []


def test_parallelism_presets_derive_their_world_size():
    sizes = {name: job_config([f"parallelism={name}"]).world_size for name in PRESETS["parallelism"]}
    assert sizes == {"single": 1, "fsdp": 1, "ddp": 2, "tp": 2, "pp": 2, "cp": 2, "hsdp": 4, "2d": 4, "3d": 8, "4d": 16,
                     "ep": 2, "3d_ep": 8}


def test_published_llama3_shapes():
    """The presets carry the published shapes: parameter counts of the released checkpoints."""
    published = {
        "llama3_1b": 1_235_814_400,
        "llama3_3b": 3_212_749_824,
        "llama3_8b": 8_030_261_248,
        "llama3_70b": 70_553_706_496,
        "llama3_405b": 405_853_388_800,
    }
    for flavor, expected in published.items():
        assert job_config([f"model={flavor}"]).model.num_params == expected, flavor
    assert job_config(["model=llama3_8b"]).model.ffn_hidden_dim == 14336


@pytest.mark.quick
def test_resolve_fills_derived_values():
    job = resolve(job_config(["parallelism=fsdp", "cluster.nproc_per_node=4", "training.local_batch_size=2"]))
    assert job.parallelism.data_parallel_shard_degree == 4
    assert job.training.global_batch_size == 8
    job = resolve(job_config(["parallelism=3d"]))
    assert job.cluster.nproc_per_node == 8


# (overrides, a fragment one of the messages must contain).
BAD = [
    (["training.steps=0"], "training.steps = 0: must be >= 1"),
    (["parallelism.tensor_parallel_degree=2", "parallelism.data_parallel_shard_degree=1",
      "cluster.nproc_per_node=3"], "the product of the degrees is 2 but the world size is 3"),
    (["parallelism.tensor_parallel_degree=2", "parallelism.data_parallel_shard_degree=-1",
      "cluster.nproc_per_node=3"], "does not divide the world size 3"),
    (["parallelism=fsdp", "cluster.nproc_per_node=2", "training.local_batch_size=3",
      "training.global_batch_size=8"], "must be a multiple of local_batch_size x dp = 3 x 2"),
    (["parallelism=tp", "parallelism.tensor_parallel_degree=3"], "does not divide model.n_heads = 16"),
    (["parallelism=tp", "model.n_kv_heads=1"], "does not divide model.n_kv_heads = 1"),
    (["parallelism=tp", "parallelism.tensor_parallel_degree=16", "model.n_kv_heads=16", "model.multiple_of=100"],
     "does not divide ffn hidden size (from model.dim/multiple_of/ffn_dim_multiplier) = 700"),
    (["model.n_kv_heads=3"], "model.n_kv_heads = 3: must divide model.n_heads = 16"),
    (["model.dim=250"], "model.dim = 250: must be divisible by model.n_heads = 16, or set model.head_dim"),
    (["model.head_dim=15"], "model.head_dim = 15: must be even and >= 2 for RoPE"),
    (["parallelism=pp", "model.n_layers=1"], "2 stages but model.n_layers = 1"),
    (["parallelism=pp", "parallelism.pipeline_parallel_microbatch_size=3"],
     "must divide training.local_batch_size = 8"),
    (["parallelism=pp", "parallelism.pipeline_parallel_schedule=Interleaved1F1B", "training.local_batch_size=3"],
     "to be a multiple of pipeline_parallel_degree = 2"),
    (["parallelism=pp", "training.local_batch_size=1"], "gives 1 microbatches for 2 pipeline ranks"),
    (["parallelism=pp", "parallelism.pipeline_parallel_schedule=ZBVZeroBubble",
      "parallelism.pipeline_parallel_stages_per_rank=3"], "ZBVZeroBubble needs exactly 2"),
    (["parallelism=pp", "parallelism.pipeline_parallel_stages_per_rank=2"], "1F1B runs one stage per rank"),
    (["parallelism=pp", "parallelism.pipeline_parallel_layers_per_stage=4"], "must divide model.n_layers = 6"),
    (["parallelism=pp", "parallelism.pipeline_parallel_layers_per_stage=3",
      "parallelism.pipeline_parallel_first_stage_less_layers=1"],
     "must divide model.n_layers = 6 + the ends' 1 + 0 = 7"),
    (["parallelism=pp", "parallelism.pipeline_parallel_schedule=Interleaved1F1B",
      "parallelism.pipeline_parallel_stages_per_rank=4"],
     "8 stages but model.n_layers = 6; every stage needs a block or one of the model's ends; or count the embedding"),
    (["parallelism=pp", "parallelism.pipeline_parallel_first_stage_less_layers=7"],
     "pipeline_parallel_first_stage_less_layers = 7: is more than the 6 blocks each of the 2 stages is given"),
    (["parallelism=pp", "parallelism.pipeline_parallel_last_stage_less_layers=-1"],
     "pipeline_parallel_last_stage_less_layers"),
    (["parallelism=pp", "parallelism.pipeline_parallel_layers_per_stage=2"],
     "gives 3 stages, not a multiple of pipeline_parallel_degree = 2"),
    (["parallelism=pp", "parallelism.pipeline_parallel_schedule=LoopedBFS",
      "parallelism.pipeline_parallel_layers_per_stage=3"],
     "LoopedBFS needs >= 2 stages per rank"),
    (["parallelism=pp", "parallelism.pipeline_parallel_schedule=LoopedBFS",
      "parallelism.pipeline_parallel_layers_per_stage=1", "parallelism.pipeline_parallel_stages_per_rank=2"],
     "contradicts layers_per_stage = 1 (3 per rank)"),
    (["parallelism=tp", "parallelism.enable_async_tensor_parallel=true"], "needs CUDA"),
    (["parallelism.context_parallel_degree=2", "training.seq_len=66"], "must be divisible by 2 x cp = 4"),
    (["parallelism.fsdp_reshard_after_forward=sometimes"], "choose one of default, always, never"),
    (["parallelism=fsdp", "cluster.nproc_per_node=2", "parallelism.fsdp_reshard_after_forward=2"],
     "proper divisor (> 1) of the FSDP group size 2"),
    (["parallelism=ddp", "parallelism.tensor_parallel_degree=2", "cluster.nproc_per_node=4"],
     "replicate-only data parallel (DDP) does not compose"),
    (["training.seq_len=4096"], "exceeds model.max_seq_len = 2048"),
    (["lr_scheduler.warmup_steps=100"], "lr_scheduler.warmup_steps = 100: must be in [0, training.steps = 40]"),
    (["lr_scheduler.decay_ratio=0.99", "lr_scheduler.warmup_steps=10"], "warmup plus decay steps exceed"),
    (["optimizer.lr=0"], "optimizer.lr = 0.0: must be > 0"),
    (["optimizer.beta2=1.0"], "optimizer.beta2 = 1.0: must be in [0, 1)"),
    (["training.max_norm=-1"], "training.max_norm = -1.0"),
    (["cluster.executor=debug", "parallelism=tp"], "runs one rank in-process but the world size is 2"),
    (["cluster=debug", "parallelism=tp"], "the product of the degrees is 2 but the world size is 1"),
    (["parallelism=tp", "cluster.nnodes=3"], "does not divide the 2 ranks the degrees need"),
    (["data.dataset=text"], "reads local files; give a file, glob or directory"),
    (["data.dataset=json", "data.path=/nonexistent/*.jsonl"], "matches no file"),
    (["data.path=/data/mine.jsonl"], "data.path = '/data/mine.jsonl': would be ignored: data.dataset = 'pydoc_topics' "
                                     "(the default) is the bundled corpus; set data.dataset=json to read it"),
    (["validation.enable=true", "validation.path=/data/held_out"],
     "validation.path = '/data/held_out': would be ignored"),
    (["data.tokenizer_path=/nonexistent.json"], "is neither a tokenizer.json file nor a directory holding one"),
    (["data.tokenizer_vocab_size=100"], "needs >= 258"),
    (["precision=float8", "model.dim=264", "model.n_heads=12", "model.n_kv_heads=12"],
     "model.dim = 264 is not divisible by 16; float8 matmuls need multiples of 16"),
    (["precision=float8", "parallelism=tp", "parallelism.tensor_parallel_degree=8", "model.multiple_of=64"],
     "the ffn hidden size = 704 is not divisible by 16 x tp = 128"),
    (["precision=mxfp8", "model.multiple_of=16"], "the ffn hidden size = 688 is not divisible by 32"),
    (["precision=float8_rowwise", "precision.float8_enable_fsdp_all_gather=true"],
     "works with the tensorwise recipe only, not rowwise"),
    (["precision=mxfp8", "precision.filter_fqns=[output,auto_filter_small_kn]"],
     "'auto_filter_small_kn' is torchao's float8 shape filter; MXFP8 has none"),
    (["precision=float8", "precision.float8_recipe=rowwise_with_gw_hp", "precision.filter_fqns=[auto_filter_small_kn]"],
     "has no thresholds for the rowwise_with_gw_hp recipe"),
    (["precision=float8", "precision.float8_precompute_dynamic_scale_for_fsdp=true"],
     "needs converter=float8 and float8_enable_fsdp_all_gather=true"),
    (["precision.full_bf16=true"], "precision.param_dtype must be bfloat16"),
    (["activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=0"],
     "'op' for the per-op policy or a positive integer N"),
    (["parallelism=tp", "compile.enable=true", "activation_checkpoint.mode=full"],
     "activation_checkpoint.mode = 'full': fails on CPU with compile.enable=true and tensor parallel"),
    (["checkpoint=default", "checkpoint.async_mode=async_with_pinned_mem"], "pinned memory needs CUDA"),
    (["checkpoint=default", "checkpoint.keep_latest_k=-1"], "checkpoint.keep_latest_k = -1: must be >= 0"),
    (["checkpoint=default", "checkpoint.load_step=-2"], "checkpoint.load_step = -2: must be a saved step"),
    (["checkpoint.export_format=safetensors"],
     "checkpoint.export_format = 'safetensors': needs checkpoint.enable=true"),
    (["checkpoint=seed", "checkpoint.enable=false"],
     "checkpoint.create_seed_checkpoint = True: needs checkpoint.enable"),
    (["metrics.log_freq=0"], "metrics.log_freq = 0: must be >= 1"),
    (["metrics.warmup_steps=-1"], "metrics.warmup_steps = -1: must be >= 0"),
    (["model.norm_eps=0"], "model.norm_eps = 0.0: must be > 0"),
    (["model.rope_theta=-1"], "model.rope_theta = -1.0: must be > 0"),
    (["model.ffn_dim_multiplier=0"], "model.ffn_dim_multiplier = 0.0: must be > 0, or null"),
    (["optimizer.eps=0"], "optimizer.eps = 0.0: must be > 0"),
    (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay = -0.1: must be >= 0"),
    (["checkpoint.interval=0"], "checkpoint.interval = 0: must be >= 1"),
    (["cluster.cpu_malloc_mmap_threshold_mib=64"], "glibc accepts 0..32 MiB"),
    (["sweep.objective=final_los"],
     "sweep.objective = 'final_los': not a number summary.json records; did you mean final_loss"),
    (["autotune.budget_minutes=0"], "autotune.budget_minutes = 0.0: must be > 0"),
    (["autotune.drop_slower_than=1.5"], "autotune.drop_slower_than = 1.5: a share of the fastest"),
    (["autotune.tolerance=-0.1"], "autotune.tolerance = -0.1: a share of the fastest: 0 <= it < 1"),
    (["autotune.device_memory_gib=0"], "autotune.device_memory_gib = 0.0: must be > 0"),
    (["profiling.save_traces_folder=/tmp/traces"],
     "profiling.save_traces_folder = '/tmp/traces': a folder name inside the run dir"),
]


# Choice fields are Enums: a value not on the list fails at composition, naming the field and the choices.
# (override, the field's full key, the choices as OmegaConf lists them)
BAD_CHOICES = [
    ("parallelism.pipeline_parallel_schedule=Zigzag", "parallelism.pipeline_parallel_schedule",
     "GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV"),
    ("lr_scheduler.decay_type=step", "lr_scheduler.decay_type", "linear, sqrt, cosine"),
    ("cluster.executor=pbs", "cluster.executor", "local, slurm, debug"),
    ("precision.param_dtype=float16", "precision.param_dtype", "float32, bfloat16"),
    ("precision.converter=int4", "precision.converter", "none, float8, mxfp8"),
    ("precision.float8_recipe=blockwise", "precision.float8_recipe", "tensorwise, rowwise, rowwise_with_gw_hp"),
    ("precision.mx_recipe=mxfp4", "precision.mx_recipe",
     "mxfp8_rceil, mxfp8_rceil_wgrad_with_hp, mxfp8_emulated_rceil"),
    ("compile.backend=tvm", "compile.backend", "inductor, aot_eager, eager"),
    ("activation_checkpoint.mode=some", "activation_checkpoint.mode", "none, full, selective"),
    ("checkpoint.async_mode=later", "checkpoint.async_mode", "disabled, async, async_with_pinned_mem"),
    ("checkpoint.exclude_from_loading=[optimiser]", "checkpoint.exclude_from_loading",
     "model, optimizer, lr_scheduler, dataloader, train_state, rng"),
    ("checkpoint.export_dtype=int8", "checkpoint.export_dtype", "float32, bfloat16, float16"),
    ("checkpoint.export_format=onnx", "checkpoint.export_format", "safetensors, pt"),
    ("checkpoint.hsdp_save_replicas=some", "checkpoint.hsdp_save_replicas", "all, first"),
    ("metrics.wandb_mode=cloud", "metrics.wandb_mode", "online, offline, disabled"),
    ("training.on_nonfinite=ignore", "training.on_nonfinite", "stop, skip"),
    ("model.name=gpt2", "model.name", "llama3, qwen3"),
]


@pytest.mark.parametrize("override,field,choices", BAD_CHOICES, ids=[o for o, _, _ in BAD_CHOICES])
@pytest.mark.quick
def test_bad_choice_is_rejected_at_composition(override, field, choices):
    with pytest.raises(ConfigCompositionException) as exc:
        job_config([override])
    message = str(exc.value.__cause__)
    assert f"expected one of [{choices}]" in message, message
    assert f"full_key: {field}" in message, message


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_config_is_rejected_with_a_clear_message(overrides, message):
    errors = validate(job_config(overrides), cuda=False)
    assert any(message in e for e in errors), errors
    groups = {f.name for f in dataclasses.fields(job_config([]))}
    for error in errors:  # every message starts by naming the field
        assert error.split(" = ")[0].split(".")[0] in groups, error


@pytest.mark.quick
def test_every_error_is_reported_at_once():
    errors = validate(job_config(["training.steps=0", "optimizer.lr=-1", "model.dim=250"]), cuda=False)
    assert len(errors) == 1  # counts are checked first: the others divide by them
    errors = validate(job_config(["optimizer.lr=-1", "model.dim=250", "lr_scheduler.min_lr_factor=2"]), cuda=False)
    assert len(errors) == 3


def test_tokenizer_larger_than_the_embedding_is_rejected():
    from titan_exp.models.llama import check_vocab

    errors = check_vocab(job_config([]).model, tokenizer_vocab=4096)
    assert errors == ["model.vocab_size = 2048: smaller than the tokenizer's vocabulary (4096); "
                      "set it to at least that"]


def test_async_tp_is_accepted_only_with_cuda_and_compile():
    job = job_config(["parallelism=tp", "parallelism.enable_async_tensor_parallel=true"])
    (error,) = validate(job, cuda=True)
    assert "needs compile.enable=true" in error and "CUDA" not in error
    assert validate(job_config(["parallelism=tp", "parallelism.enable_async_tensor_parallel=true",
                                "compile.enable=true"]), cuda=True) == []


def test_mx_recipes_match_torchao():
    from torchao.prototype.moe_training.config import MXFP8TrainingRecipe

    from titan_exp.config import MXRecipe

    assert {r.value for r in MXRecipe} == {r.value for r in MXFP8TrainingRecipe}


def test_types_are_checked_at_compose_time():
    with pytest.raises(ConfigCompositionException) as exc:
        job_config(["training.steps=many"])
    assert isinstance(exc.value.__cause__, ValidationError)
    assert "could not be converted to Integer" in str(exc.value.__cause__)
    assert "full_key: training.steps" in str(exc.value.__cause__)
    with pytest.raises(ConfigCompositionException, match="stpes"):
        compose(["training.stpes=5"])
    with pytest.raises(ConfigCompositionException, match="llama3_8b"):  # lists the options
        compose(["model=llama3_9b"])


def test_cli_help_and_cfg_job():
    help_out = launch_cli(["--help"])
    assert help_out.returncode == 0
    assert "parallelism: 2d, 3d, 3d_ep, 4d, cp, ddp, ep, fsdp, hsdp, pp, single, tp" in help_out.stdout
    assert "data_parallel_shard_degree = -1\n      FSDP shards; -1 = the rest of the world size" in help_out.stdout
    cfg = launch_cli(["--cfg", "job", "parallelism=3d", "model=llama3_8b"])
    assert cfg.returncode == 0
    assert "pipeline_parallel_degree: 2" in cfg.stdout and "dim: 4096" in cfg.stdout
