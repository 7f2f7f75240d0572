"""A Hugging Face `config.json` (Llama, Qwen3, Qwen3-MoE) as our ModelConfig and back:
`model.hf_config` takes the shapes from one, and an export writes one (the weights are
titan_exp.models.hf's)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from titan_exp.config.fields import AuxLoss, ModelFamily, ScoreFunc, problem
from titan_exp.config.model import ModelConfig

CONFIG = "config.json"


def config_file(path: str | Path) -> Path:
    path = Path(path).expanduser()
    return path / CONFIG if path.is_dir() else path


def rope_theta(config: dict[str, Any], unsupported: list[str]) -> float:
    """RoPE's base from either layout: transformers 5 writes it inside `rope_parameters` (with a
    `rope_type`), transformers 4 at the top with an optional `rope_scaling`. Anything that changes
    the rotation besides the base (a rope_type other than default, scaling factors) is added to
    `unsupported`: loaded unread, it would give other logits without a word."""
    rope = dict(config.get("rope_parameters") or {})
    top = config.get("rope_theta")
    theta = rope.pop("rope_theta", top if top is not None else 10000.0)
    if top is not None and float(top) != float(theta):
        unsupported.append(f"rope_theta {top} at the top but {theta} in rope_parameters")
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type != "default":
        unsupported.append(f"rope_type {rope_type!r} (RoPE scaling)")
    if rope:
        unsupported.append(f"rope_parameters {rope}")
    if config.get("rope_scaling"):
        unsupported.append(f"rope_scaling {config['rope_scaling']}")
    return float(theta)


# The config.json model_types titan_exp reads, and the architecture each is exported as.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
MODEL_TYPES = tuple(ARCHITECTURES)


def model_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields a Hugging Face Llama, Qwen3 or Qwen3-MoE config.json sets (every
    field that shapes the model, so nothing of a preset it is given with stays). Raises
    ValueError for another model_type (read as a Llama, its own layers would be dropped) and for
    what titan_exp does not implement (biases, RoPE scaling, attention dropout, another
    activation, a sliding window, experts on other than every layer from some block on). A
    head_dim other than hidden_size / num_attention_heads is kept as model.head_dim."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"its model_type is {model_type!r}, which titan_exp does not read; it reads "
                         f"{', '.join(MODEL_TYPES)}")
    unsupported = [k for k in ("attention_bias", "mlp_bias") if config.get(k)]
    theta = rope_theta(config, unsupported)
    if config.get("attention_dropout"):
        unsupported.append(f"attention_dropout {config['attention_dropout']}")
    if config.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act {config['hidden_act']}")
    if config.get("use_sliding_window"):
        unsupported.append(f"use_sliding_window true (sliding_window {config.get('sliding_window')})")
    if windowed := sorted({t for t in config.get("layer_types") or [] if t != "full_attention"}):
        unsupported.append(f"layer_types {windowed}")
    moe = _moe_fields(config, unsupported) if model_type == "qwen3_moe" else {"n_experts": 0}
    if unsupported:
        raise ValueError(f"this {model_type} model has {', '.join(unsupported)}, which titan_exp does not implement")
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    return {
        "name": ModelFamily.llama3 if model_type == "llama" else ModelFamily.qwen3,
        "dim": dim,
        "n_layers": config["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": None if config.get("head_dim") in (None, dim // heads) else config["head_dim"],
        "qk_norm": model_type != "llama",
        "kv_lora_rank": 0,
        "q_lora_rank": 0,
        "vocab_size": config["vocab_size"],
        "intermediate_size": config["intermediate_size"],
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "max_seq_len": config.get("max_position_embeddings", 2048),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        **moe,
    }


def _moe_fields(config: dict[str, Any], unsupported: list[str]) -> dict[str, Any]:
    """A Qwen3-MoE's experts: softmax router, top-k, optionally renormalized, no shared expert, no
    bias; the Switch load-balancing loss at its router_aux_loss_coef. Dense blocks only first
    (mlp_only_layers 0..k-1, decoder_sparse_step 1), as our MoE places them."""
    n_layers = config["num_hidden_layers"]
    step = config.get("decoder_sparse_step", 1)
    dense = sorted(config.get("mlp_only_layers") or [])
    if step != 1:
        unsupported.append(f"decoder_sparse_step {step} (experts every {step} blocks)")
    if dense != list(range(len(dense))) or len(dense) >= n_layers:
        unsupported.append(f"mlp_only_layers {dense} (dense blocks other than the first ones)")
    experts = config.get("num_experts", config.get("num_local_experts"))
    return {
        "n_experts": experts,
        "top_k": config["num_experts_per_tok"],
        "moe_hidden_dim": config["moe_intermediate_size"],
        "n_shared_experts": 0,
        "n_dense_layers": len(dense),
        "score_func": ScoreFunc.softmax,
        "route_norm": bool(config.get("norm_topk_prob", False)),
        "route_scale": 1.0,
        "load_balance_coeff": None,
        "aux_loss": AuxLoss.switch,
        "aux_loss_coeff": float(config.get("router_aux_loss_coef", 0.0)),
    }


def model_type(cfg: ModelConfig) -> str:
    """The Hugging Face model_type `cfg` is exported as: qwen3 (qwen3_moe) with QK-norm, else llama."""
    if cfg.qk_norm:
        return "qwen3_moe" if cfg.is_moe else "qwen3"
    return "llama"


def with_hf_config(model: ModelConfig) -> ModelConfig:
    """`model` with the shapes of its `hf_config` and, as its flavor, the name of the directory
    holding it (unchanged when there is none, or it cannot be read: the check says why)."""
    if model.hf_config is None or not config_file(model.hf_config).is_file():
        return model
    try:
        fields = model_fields(json.loads(config_file(model.hf_config).read_text()))
    except (ValueError, KeyError, json.JSONDecodeError):
        return model
    return dataclasses.replace(model, **fields, flavor=config_file(model.hf_config).parent.name)


def config_errors(model: ModelConfig) -> list[str]:
    """What is wrong with model.hf_config (for validation)."""
    if model.hf_config is None:
        return []
    path = config_file(model.hf_config)
    if not path.is_file():
        return [problem("model.hf_config", model.hf_config,
                        f"no {CONFIG} there; give a Hugging Face model directory or its config.json")]
    try:
        model_fields(json.loads(path.read_text()))
    except json.JSONDecodeError as exc:
        return [problem("model.hf_config", model.hf_config, f"{path} is not JSON ({exc.msg})")]
    except KeyError as exc:
        return [problem("model.hf_config", model.hf_config, f"{path} has no {exc}; is it a Llama or Qwen3 config?")]
    except ValueError as exc:
        return [problem("model.hf_config", model.hf_config, str(exc))]
    return []


def hf_config(cfg: ModelConfig, dtype: str, *, bos_token_id: int | None, eos_token_id: int | None) -> dict[str, Any]:
    """The config.json of `cfg` (a Llama, Qwen3 or Qwen3-MoE: model_type), as transformers writes
    one, with its tokenizer's BOS/EOS ids."""
    kind = model_type(cfg)
    config = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "intermediate_size": cfg.ffn_hidden_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": dtype,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }
    if kind == "llama":
        return config | {"mlp_bias": False}
    config |= {"use_sliding_window": False, "sliding_window": None, "attention_dropout": 0.0}
    if kind == "qwen3_moe":
        config |= {"num_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k,
                   "moe_intermediate_size": cfg.expert_hidden_dim, "norm_topk_prob": cfg.route_norm,
                   "decoder_sparse_step": 1, "mlp_only_layers": list(range(cfg.n_dense_layers)),
                   "router_aux_loss_coef": cfg.aux_loss_coeff, "output_router_logits": False}
    return config
