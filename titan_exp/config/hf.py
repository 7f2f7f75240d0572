"""A Hugging Face `config.json` as our ModelConfig and back: `model.hf_config` takes the shapes
from one, and an export writes one (the weights are titan_exp.models.hf's)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from titan_exp.config.fields import problem
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


MODEL_TYPES = ("llama",)  # the config.json model_types titan_exp reads


def model_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields a Hugging Face LlamaConfig sets. Raises ValueError for another
    model_type (read as a Llama, its own layers would be dropped) and for what our Llama does not
    implement (biases, RoPE scaling, attention dropout, another activation). A head_dim other
    than hidden_size / num_attention_heads is kept as model.head_dim."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"its model_type is {model_type!r}, which titan_exp does not read; it reads "
                         f"{', '.join(MODEL_TYPES)}")
    unsupported = [k for k in ("attention_bias", "mlp_bias") if config.get(k)]
    theta = rope_theta(config, unsupported)
    if config.get("attention_dropout"):
        unsupported.append(f"attention_dropout {config['attention_dropout']}")
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act {config['hidden_act']}")
    if unsupported:
        raise ValueError(f"this Llama has {', '.join(unsupported)}, which titan_exp's Llama does not implement")
    return {
        "dim": dim,
        "n_layers": config["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": None if config.get("head_dim") in (None, dim // heads) else config["head_dim"],
        "vocab_size": config["vocab_size"],
        "intermediate_size": config["intermediate_size"],
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "max_seq_len": config.get("max_position_embeddings", 2048),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
    }


def with_hf_config(model: ModelConfig) -> ModelConfig:
    """`model` with the shapes of its `hf_config` (unchanged when there is none, or it cannot be
    read: the check says why)."""
    if model.hf_config is None or not config_file(model.hf_config).is_file():
        return model
    try:
        fields = model_fields(json.loads(config_file(model.hf_config).read_text()))
    except (ValueError, KeyError, json.JSONDecodeError):
        return model
    return dataclasses.replace(model, **fields)


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
        return [problem("model.hf_config", model.hf_config, f"{path} has no {exc}; is it a Llama config?")]
    except ValueError as exc:
        return [problem("model.hf_config", model.hf_config, str(exc))]
    return []


def hf_config(cfg: ModelConfig, dtype: str, *, bos_token_id: int | None, eos_token_id: int | None) -> dict[str, Any]:
    """A LlamaConfig for `cfg`, as transformers writes config.json, with its tokenizer's BOS/EOS ids."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "mlp_bias": False,
        "torch_dtype": dtype,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }
