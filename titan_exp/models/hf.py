"""Hugging Face Llama, Qwen3 and Qwen3-MoE weights: our parameter names and RoPE layout as theirs
and back, and
reading / writing a Hugging Face model directory (its config.json is titan_exp.config.hf's; the
tokenizer it holds is the run's, saved by transformers).

Two differences besides the names. Our attention rotates consecutive pairs (x[2i], x[2i+1]), as
Meta's Llama does; `transformers` rotates the two halves of each head (rotate_half). The same
model therefore has the rows of each q/k head in another order: `to_hf` and `from_hf` permute
them (the permutation of transformers' own convert_llama_weights_to_hf), and Qwen3's QK-norm
weights, one head wide, the same way. A tied model has no `lm_head.weight` in Hugging Face's
files; a Qwen3-MoE holds each routed expert's matrices apart, where ours stacks them.

Loading goes tensor by tensor, the way `Transformer.init_weights` does: every rank reads the
full tensors of its own parameters from the (memory-mapped) safetensors files, converts them and
keeps its shard, so it works for every layout, pipeline stages included.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from titan_exp import extras
from titan_exp.config import JobConfig, ModelConfig, problem
from titan_exp.config.hf import CONFIG, hf_config
from titan_exp.models.tokenizer import special_ids, tokenizer_file

if TYPE_CHECKING:  # torch and transformers are imported where they are used
    import torch
    from transformers import PreTrainedTokenizerBase

INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"

# ours -> theirs; {i} is the block number.
_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.attention.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.attention.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.moe.router.gate.weight": "model.layers.{i}.mlp.gate.weight",
}
# Routed experts: ours one (experts, ...) tensor each, theirs a matrix per expert {j} (as Qwen3-MoE's
# files on the Hub hold them, and transformers saves them).
_EXPERTS = {
    "layers.{i}.moe.experts.w1": "model.layers.{i}.mlp.experts.{j}.gate_proj.weight",
    "layers.{i}.moe.experts.w3": "model.layers.{i}.mlp.experts.{j}.up_proj.weight",
    "layers.{i}.moe.experts.w2": "model.layers.{i}.mlp.experts.{j}.down_proj.weight",
}


def unsupported(m: ModelConfig) -> str | None:
    """What in `m` no Hugging Face model titan_exp reads or writes can hold (Llama, Qwen3, and
    Qwen3-MoE: experts on a softmax router without shared experts or scaling), or None."""
    parts = ["multi-head latent attention (model.kv_lora_rank > 0)"] if m.mla else []
    if m.is_moe:
        parts += [what for what, bad in (
            ("routed experts without QK-norm (model.qk_norm=false; Qwen3-MoE is the MoE it reads)", not m.qk_norm),
            (f"a {m.score_func} router (model.score_func; Qwen3-MoE's is softmax)", m.score_func != "softmax"),
            ("shared experts (model.n_shared_experts > 0)", m.n_shared_experts > 0),
            (f"model.route_scale = {m.route_scale} (Qwen3-MoE's is 1)", m.route_scale != 1.0)) if bad]
    if not parts:
        return None
    return "a model with " + (f"{', '.join(parts[:-1])} and {parts[-1]}" if len(parts) > 1 else parts[0])


def check(job: JobConfig, cuda: bool) -> list[str]:
    """Hugging Face import and export of a model none of its classes can hold, refused; an export
    of routing with a load-balancing bias (Qwen3-MoE has none: its routing would differ); and an
    export without transformers, which writes its tokenizer (the `hf` extra)."""
    what, k, e = unsupported(job.model), job.checkpoint, []
    if k.last_save_in_hf and (why := extras.missing("transformers")):
        e.append(problem("checkpoint.last_save_in_hf", True, f"{why}; or set it to false"))
    if k.last_save_in_hf and what is None and job.model.is_moe and job.model.load_balance_coeff is not None:
        e.append(problem("checkpoint.last_save_in_hf", True, "Qwen3-MoE routes without DeepSeek-V3's load-balancing "
                         "bias, so the export would route otherwise; set model.load_balance_coeff=null (balance with "
                         "model.aux_loss_coeff) or checkpoint.last_save_in_hf=false"))
    if what is None:
        return e
    if job.model.hf_config is not None:
        e.append(problem("model.hf_config", job.model.hf_config,
                         f"Hugging Face import reads Llama, Qwen3 and Qwen3-MoE models; {what} starts from its "
                         "own init"))
    if k.initial_load_in_hf:
        e.append(problem("checkpoint.initial_load_in_hf", True, f"Hugging Face loading reads Llama, Qwen3 and "
                         f"Qwen3-MoE weights; {what} starts from its own init or a DCP checkpoint"))
    if k.last_save_in_hf:
        e.append(problem("checkpoint.last_save_in_hf", True, f"Hugging Face export writes Llama, Qwen3 and Qwen3-MoE "
                         f"models; {what} keeps its DCP checkpoint (or checkpoint.export_format)"))
    return e


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(\d+)") + "$")


_TO_HF = [(_pattern(ours), theirs) for ours, theirs in _NAMES.items()]
_EXPERTS_TO_HF = [(_pattern(ours), theirs) for ours, theirs in _EXPERTS.items()]


def _rename(name: str, table: list[tuple[re.Pattern, str]]) -> str | None:
    for pattern, template in table:
        if m := pattern.match(name):
            return template.replace("{i}", m.group(1)) if m.groups() else template
    return None


def hf_name(name: str) -> str:
    if (theirs := _rename(name, _TO_HF)) is None:
        raise KeyError(f"{name!r} has no Hugging Face counterpart")
    return theirs


def hf_names(name: str, cfg: ModelConfig) -> list[str]:
    """The Hugging Face tensors our parameter `name` is: one, or a routed-expert tensor's one per expert."""
    if name.endswith("moe.expert_bias"):  # a buffer Qwen3-MoE has not (it starts at zero; hf.check)
        return []
    if (per_expert := _rename(name, _EXPERTS_TO_HF)) is not None:
        return [per_expert.replace("{j}", str(j)) for j in range(cfg.n_experts)]
    return [hf_name(name)]


def _heads(name: str, cfg: ModelConfig) -> int | None:
    """Heads of a q/k projection (whose rows RoPE pairs up), 1 for a QK-norm's weight (one head's
    width, in the same order), None for every other tensor."""
    if name.endswith("attention.wq.weight"):
        return cfg.n_heads
    if name.endswith("attention.wk.weight"):
        return cfg.kv_heads
    if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1
    return None


def to_hf(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Our tensor `name` in Hugging Face's layout: q/k rows of each head from pairs to halves."""
    if (heads := _heads(name, cfg)) is None:
        return t
    return t.reshape(heads, cfg.head_size // 2, 2, -1).transpose(1, 2).reshape(t.shape)


def from_hf(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The inverse of `to_hf` (`name` is ours)."""
    if (heads := _heads(name, cfg)) is None:
        return t
    return t.reshape(heads, 2, cfg.head_size // 2, -1).transpose(1, 2).reshape(t.shape)


# Reading and writing a Hugging Face model directory.

class HFWeights:
    """The tensors of a Hugging Face model directory, by Hugging Face name, read lazily from its
    safetensors file(s) (one, or shards listed in model.safetensors.index.json)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder).expanduser()
        if (self.folder / INDEX).is_file():
            self.where = json.loads((self.folder / INDEX).read_text())["weight_map"]
        elif (self.folder / WEIGHTS).is_file():
            from safetensors import safe_open

            with safe_open(self.folder / WEIGHTS, framework="pt") as f:
                self.where = {k: WEIGHTS for k in f.keys()}
        else:
            raise FileNotFoundError(f"{self.folder} has neither {WEIGHTS} nor {INDEX}")
        self._open: dict[str, Any] = {}

    def _file(self, name: str):
        from safetensors import safe_open

        file = self.where[name]
        if file not in self._open:
            self._open[file] = safe_open(self.folder / file, framework="pt")
        return self._open[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)


def _sources(name: str, cfg: ModelConfig, weights: HFWeights) -> list[str]:
    """The Hugging Face tensors our parameter `name` comes from (a tied output is the embedding)."""
    theirs = hf_names(name, cfg)
    if name == "output.weight" and cfg.tie_word_embeddings and theirs[0] not in weights.where:
        return [hf_name("tok_embeddings.weight")]
    return theirs


def _read(name: str, cfg: ModelConfig, weights: HFWeights) -> torch.Tensor:
    """Our parameter `name`, whole, from a Hugging Face directory: its tensor in our layout, or a
    routed-expert tensor stacked from one matrix per expert."""
    import torch

    theirs = [weights.get(n) for n in _sources(name, cfg, weights)]
    return torch.stack(theirs) if _rename(name, _EXPERTS_TO_HF) else from_hf(name, theirs[0], cfg)


# Tensors a Hugging Face directory may hold that no parameter takes, without changing the model:
# RoPE's cached inverse frequencies (recomputed from rope_theta).
UNREAD = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def shape_errors(folder: str | Path, cfg: ModelConfig, shapes: dict[str, torch.Size]) -> list[str]:
    """Our parameters (name -> shape, the whole model's) that the directory lacks or holds in
    another shape, each named; then its tensors that no parameter takes, which loading would drop."""
    weights = HFWeights(folder)
    errors, read = [], set()
    for name, shape in shapes.items():
        sources = _sources(name, cfg, weights)
        each = tuple(shape[1:]) if len(sources) > 1 or _rename(name, _EXPERTS_TO_HF) else tuple(shape)
        read.update(sources)
        for theirs in sources:
            if theirs not in weights.where:
                errors.append(f"{theirs} (our {name}) is not in {weights.folder}")
            elif weights.shape(theirs) != each:
                errors.append(f"{theirs} (our {name}) is {list(weights.shape(theirs))} there, {list(each)} in this "
                              "model")
    tied_head = {hf_name("output.weight")} if cfg.tie_word_embeddings else set()  # the embedding's copy
    dropped = sorted(n for n in weights.where if n not in read | tied_head and not UNREAD.search(n))
    if dropped:
        errors.append(f"{len(dropped)} tensor(s) in {weights.folder} that this model has no place for, which "
                      f"loading would drop: {', '.join(dropped[:4])}{', ...' if len(dropped) > 4 else ''}")
    return errors


def load_into(parts: list[torch.nn.Module], folder: str | Path, cfg: ModelConfig) -> None:
    """Every parameter of these model parts from a Hugging Face directory, each cut to this
    rank's shard (as init_weights cuts its draws)."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    from titan_exp.models.llama import canonical_name

    weights = HFWeights(folder)
    with torch.no_grad():
        for part in parts:
            for name, param in part.named_parameters():
                full = _read(canonical_name(name), cfg, weights).to(param.dtype)
                if isinstance(param, DTensor):
                    full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.copy_(full)


def hf_tokenizer(path: str | Path, cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer at `path` (a tokenizer.json, or a directory holding one) as transformers
    loads it, for a Hugging Face directory of the model `cfg`: the BOS/EOS the run trained with
    (titan_exp.models.tokenizer's rule), the rest of the tokenizer_config.json beside it when there
    is one (a chat template), `cfg.max_seq_len` long at most. ValueError, in one line, when it
    cannot be: no tokenizer there, transformers missing, a vocabulary the model cannot hold."""
    file = tokenizer_file(path)
    if not file.is_file():
        raise ValueError(f"no tokenizer at {file}; a Hugging Face export holds the run's tokenizer")
    if why := extras.missing("transformers"):
        raise ValueError(f"a Hugging Face export writes the tokenizer with transformers: {why}")
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    try:
        raw = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ValueError(f"{file} is not a tokenizer the tokenizers library reads ({exc})") from exc
    if raw.get_vocab_size() > cfg.vocab_size:
        raise ValueError(f"the tokenizer {file} has {raw.get_vocab_size()} tokens, more than the model's "
                         f"vocab_size {cfg.vocab_size}")
    bos, eos = (None if i is None else raw.id_to_token(i) for i in special_ids(raw, file))
    return PreTrainedTokenizerFast.from_pretrained(file.parent, tokenizer_file=str(file), bos_token=bos, eos_token=eos,
                                                   model_max_length=cfg.max_seq_len)


def save(tensors: dict[str, torch.Tensor], cfg: ModelConfig, out: Path, dtype: str,
         tokenizer: PreTrainedTokenizerBase) -> Path:
    """Our full state dict as a Hugging Face Llama directory (config.json with the tokenizer's
    BOS/EOS ids, model.safetensors, the tokenizer as transformers saves it: tokenizer.json,
    tokenizer_config.json), written to a temporary folder and renamed into place."""
    import shutil

    from safetensors.torch import save_file

    theirs = dict(_theirs(tensors, cfg))
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(theirs, tmp / WEIGHTS, metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    config = hf_config(cfg, dtype, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return out


def _theirs(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors Hugging Face stores, by its names: a tied model's output is its embedding, not
    stored twice; a routed-expert tensor is one matrix per expert; the load-balancing bias, which
    Qwen3-MoE has not, is left out when it is zero (hf.check refuses an export that trained one)."""
    for k, v in tensors.items():
        if k == "output.weight" and cfg.tie_word_embeddings:
            continue
        if k.endswith("moe.expert_bias"):
            if v.any():
                raise ValueError(f"{k} is not zero: Qwen3-MoE routes without a bias, so the export would route "
                                 "otherwise")
            continue
        names = hf_names(k, cfg)
        if len(names) > 1 or _rename(k, _EXPERTS_TO_HF):
            yield from zip(names, (e.contiguous() for e in v.unbind(0)))
        else:
            yield names[0], to_hf(k, v, cfg).contiguous()
