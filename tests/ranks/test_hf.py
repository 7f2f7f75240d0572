"""Hugging Face Llama interop against the real `transformers`: a tiny random LlamaForCausalLM made
here is loaded into our model (and into a real tensor-parallel run) with the same logits and
loss, and our export loads back into transformers with the same logits."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import SMALL, run_job

from titan_exp.config import ModelConfig
from titan_exp.config.hf import config_errors, model_fields
from titan_exp.models import hf
from titan_exp.models.llama import Transformer

transformers = pytest.importorskip("transformers")


def tiny_llama(folder, *, tie: bool = False, rope_theta: float = 10000.0, head_dim: int | None = None):
    """A random Llama 3-shaped model (GQA, SwiGLU width not Llama's rule) saved as transformers does;
    its heads `head_dim` wide where given (Qwen3's are wider than hidden_size / heads)."""
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=160, vocab_size=2048, max_position_embeddings=128,
                                      rope_theta=rope_theta, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                                      **({"head_dim": head_dim} if head_dim else {}))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # RMSNorm weights start at 1: make them random too, so a swapped norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def bundled_tokenizer(cfg: ModelConfig):
    """The bundled BPE (2048 tokens) as a Hugging Face directory holds it."""
    from titan_exp.data.corpus import default_corpus, trained_tokenizer

    return hf.hf_tokenizer(trained_tokenizer(default_corpus(), 2048), cfg)


def ours_from(folder) -> tuple[Transformer, ModelConfig]:
    cfg = ModelConfig(**model_fields(json.loads((folder / "config.json").read_text())))
    model = Transformer(cfg)
    hf.load_into([model], folder, cfg)
    return model.eval(), cfg


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.quick
def test_hf_weights_load_into_ours_with_the_same_logits(tmp_path, tie):
    theirs = tiny_llama(tmp_path, tie=tie)
    ours, cfg = ours_from(tmp_path)
    assert cfg.ffn_hidden_dim == 160 and cfg.kv_heads == 2 and cfg.tie_word_embeddings == tie
    tokens = torch.randint(0, 2048, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(ours(tokens), theirs(tokens).logits, atol=1e-4, rtol=0)


@pytest.mark.quick
def test_heads_wider_than_dim_over_heads_load_and_export_with_the_same_logits(tmp_path):
    """A config.json whose head_dim (32) is not hidden_size / heads (16), as Qwen3's: read as
    model.head_dim, same logits; exported, transformers reads it back with the same logits."""
    theirs = tiny_llama(tmp_path / "in", head_dim=32)
    ours, cfg = ours_from(tmp_path / "in")
    assert cfg.head_dim == cfg.head_size == 32 and ours.layers["0"].attention.wq.weight.shape == (4 * 32, 64)
    tokens = torch.randint(0, 2048, (2, 48), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.allclose(ours(tokens), theirs(tokens).logits, atol=1e-4, rtol=0)
    out = hf.save({k: v.detach().clone() for k, v in ours.state_dict().items()}, cfg, tmp_path / "out", "float32",
                  bundled_tokenizer(cfg))
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert back.config.head_dim == 32
    with torch.no_grad():
        assert torch.allclose(back(tokens).logits, ours(tokens), atol=1e-4, rtol=0)


@pytest.mark.quick
def test_a_rope_base_as_this_transformers_saves_it_is_read(tmp_path):
    """transformers 5 writes RoPE's base inside `rope_parameters`; a non-default one loads with the
    same logits, and the control shows the base matters (read as 10000, the logits differ)."""
    theirs = tiny_llama(tmp_path, rope_theta=123456.0)
    ours, cfg = ours_from(tmp_path)
    assert cfg.rope_theta == 123456.0
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(5))
    default = Transformer(dataclasses.replace(cfg, rope_theta=10000.0))
    hf.load_into([default], tmp_path, cfg)
    with torch.no_grad():
        assert torch.allclose(ours(tokens), theirs(tokens).logits, atol=1e-4, rtol=0)
        assert (default.eval()(tokens) - theirs(tokens).logits).abs().max() > 1e-3


def test_rope_scaling_and_other_unread_math_is_refused(tmp_path):
    """A config.json key that changes the math and is not read is refused by validation, named."""
    tiny_llama(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for extra, message in [
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0}},
         "rope_type 'llama3' (RoPE scaling), rope_parameters {'factor': 8.0}"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling {'type': 'linear', 'factor': 2.0}"),
        ({"rope_theta": 10000.0, "rope_parameters": {"rope_theta": 500000.0}},
         "rope_theta 10000.0 at the top but 500000.0"),
        ({"attention_dropout": 0.1}, "attention_dropout 0.1"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**saved, **extra}))
        (error,) = config_errors(ModelConfig(hf_config=str(tmp_path)))
        assert error.startswith(f"model.hf_config = '{tmp_path}': this llama model has {message}"), error


def test_the_rope_permutation_matters(tmp_path):
    """The control: without the q/k permutation the logits differ (the test above can fail)."""
    theirs = tiny_llama(tmp_path)
    ours, cfg = ours_from(tmp_path)
    with torch.no_grad():
        wq = ours.layers["0"].attention.wq.weight
        wq.copy_(hf.to_hf("layers.0.attention.wq.weight", wq, cfg))  # the tensor as stored, unpermuted
        tokens = torch.randint(0, 2048, (1, 32), generator=torch.Generator().manual_seed(2))
        assert (ours(tokens) - theirs(tokens).logits).abs().max() > 1e-2


@pytest.mark.quick
def test_our_export_loads_in_transformers_with_the_same_logits(tmp_path):
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=2048, max_seq_len=128)
    ours = Transformer(cfg)
    ours.init_weights(seed=3)
    out = hf.save({k: v.detach().clone() for k, v in ours.state_dict().items()}, cfg, tmp_path / "hf", "float32",
                  bundled_tokenizer(cfg))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.allclose(theirs(tokens).logits, ours.eval()(tokens), atol=1e-4, rtol=0)


def test_train_from_hf_in_tensor_parallel_and_export_back(tmp_path):
    """A real 2-rank TP run starts from the Hugging Face weights (its first loss is transformers'
    loss on the same batch), trains, and exports a directory transformers loads (whose loss on a
    batch is our model's on the exported weights)."""
    from titan_exp.config import load_job_config
    from titan_exp.data.corpus import Tokenizer
    from titan_exp.data.loader import PackedLoader
    from titan_exp.data.sources import open_dataset

    src = tmp_path / "hf_in"
    theirs = tiny_llama(src, head_dim=32)  # heads wider than dim / heads, split over the TP ranks
    run_dir = tmp_path / "run"
    code, summary = run_job([*SMALL, "training.steps=2", "parallelism=tp", f"model.hf_config={src}",
                             "checkpoint.enable=true", f"checkpoint.initial_load_path={src}",
                             "checkpoint.initial_load_in_hf=true", "checkpoint.last_save_in_hf=true",
                             "checkpoint.interval=100"], run_dir)
    assert code == 0 and summary["status"] == "ok", summary
    job = load_job_config(run_dir / "config.yaml")
    loader = PackedLoader(open_dataset(job.data), Tokenizer(run_dir / "tokenizer.json"), text_field="text",
                          seq_len=job.training.seq_len, global_batch_size=8, local_batch_size=8, dp_rank=0, dp_degree=1)
    (inputs, labels), = loader.next_batch()

    def loss(model_logits):
        return torch.nn.functional.cross_entropy(model_logits.flatten(0, 1), labels.flatten()).item()

    with torch.no_grad():
        assert summary["losses"][0] == pytest.approx(loss(theirs(inputs).logits), abs=1e-5)
        exported = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "export" / "hf").eval()
        ours, _ = ours_from(run_dir / "export" / "hf")
        assert loss(exported(inputs).logits) == pytest.approx(loss(ours(inputs)), abs=1e-5)
        assert loss(exported(inputs).logits) != pytest.approx(summary["losses"][0], abs=1e-3)  # it trained
    # The same from the command line, for any checkpoint of a run: the model's shapes come from its config.yaml.
    import subprocess
    import sys

    from conftest import REPO

    out = subprocess.run([sys.executable, "-m", "titan_exp.checkpoint", "export", str(run_dir), "--format", "hf",
                          "--out", str(tmp_path / "cli_hf")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "cli_hf").eval()
    with torch.no_grad():
        assert torch.equal(again(inputs).logits, exported(inputs).logits)


@pytest.mark.parametrize("config, message", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_what_our_llama_does_not_implement_is_refused(tmp_path, config, message):
    from conftest import job_config

    from titan_exp.validation import validate

    tiny_llama(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **config}))
    errors = validate(job_config([f"model.hf_config={tmp_path}"]), cuda=False)
    prefix = f"model.hf_config = '{tmp_path}': this llama model has"
    assert any(e.startswith(prefix) and message in e for e in errors), errors


def test_a_shape_mismatch_names_the_tensor(tmp_path):
    from titan_exp.checkpoint.manager import preflight
    from titan_exp.config import CheckpointConfig

    tiny_llama(tmp_path / "hf")
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, intermediate_size=160)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()}
    errors = preflight(CheckpointConfig(enable=True, initial_load_path=str(tmp_path / "hf"), initial_load_in_hf=True),
                       tmp_path / "run", shapes, cfg)
    assert errors[0] == (f"checkpoint.initial_load_path: model.embed_tokens.weight (our tok_embeddings.weight) is "
                         f"[2048, 64] there, [4096, 64] in this model; the model's shapes must match "
                         f"(model.hf_config={tmp_path / 'hf'} takes them from its config.json)")


@pytest.mark.quick
def test_a_model_type_it_does_not_read_is_refused_by_name(tmp_path):
    """A Qwen2 directory (biases on q/k/v, which no model of ours has) is not read as a Llama: its
    config.json's model_type is refused, naming the ones titan_exp reads; a launch stops before any
    rank starts, exit 2."""
    import subprocess
    import sys

    from conftest import REPO

    config = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=160, vocab_size=2048,
                                      max_position_embeddings=128, tie_word_embeddings=True)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    (error,) = config_errors(ModelConfig(hf_config=str(tmp_path)))
    assert error == (f"model.hf_config = '{tmp_path}': its model_type is 'qwen2', which titan_exp does not read; "
                     "it reads llama, qwen3, qwen3_moe")
    out = subprocess.run([sys.executable, "launch.py", f"model.hf_config={tmp_path}", "training.steps=1",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "its model_type is 'qwen2'" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "run" / "logs").exists()


@pytest.mark.quick
def test_tensors_loading_would_drop_are_refused_by_name(tmp_path):
    """A directory whose tensors include some no parameter of ours takes (a Qwen3's q_norm, here
    added to a Llama's file) is refused before any rank loads it, naming them; RoPE's cached
    inv_freq is not a weight and is let through."""
    from safetensors.torch import load_file, save_file

    from titan_exp.checkpoint.manager import preflight
    from titan_exp.config import CheckpointConfig

    tiny_llama(tmp_path / "hf")
    cfg, file = ours_from(tmp_path / "hf")[1], tmp_path / "hf" / "model.safetensors"
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()}
    check = CheckpointConfig(enable=True, initial_load_path=str(tmp_path / "hf"), initial_load_in_hf=True)
    assert preflight(check, tmp_path / "run", shapes, cfg) == []
    tensors = load_file(file)
    save_file({**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}, file)
    assert preflight(check, tmp_path / "run", shapes, cfg) == []
    save_file({**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(16),
               "model.layers.1.self_attn.q_norm.weight": torch.ones(16)}, file)
    (error,) = preflight(check, tmp_path / "run", shapes, cfg)
    assert error.startswith(f"checkpoint.initial_load_path: 2 tensor(s) in {tmp_path / 'hf'} that this model has no "
                            "place for, which loading would drop: model.layers.0.self_attn.q_norm.weight, "
                            "model.layers.1.self_attn.q_norm.weight"), error
