"""The Llama 3 model: parameter and FLOP counts by hand, RoPE against the complex formulation; the
Qwen3 presets against the published config.json files and model cards."""

from __future__ import annotations

import pytest
import torch
from conftest import job_config

from titan_exp.config.hf import model_fields
from titan_exp.models.llama import Transformer, apply_rope, flops_per_token, rope_tables

pytestmark = pytest.mark.quick


def test_debugmodel_flops_per_token_by_hand():
    cfg = job_config(["model=debugmodel"]).model  # dim 256, 6 layers, 16 heads, 8 kv heads, vocab 2048
    head_dim, hidden = 16, 768  # 2/3 * 4 * 256 = 682 -> rounded up to 768
    assert cfg.ffn_hidden_dim == hidden
    per_layer = 256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * hidden + 2 * 256  # wq wo, wk wv, w1 w2 w3, 2 norms
    non_embedding = 6 * per_layer + 256 + 2048 * 256  # + final norm + output
    attention = 6 * 6 * 16 * (2 * head_dim) * 128  # 6 * layers * heads * 2 * head_dim * seq_len
    assert flops_per_token(cfg, seq_len=128) == 6 * non_embedding + attention == 33_836_544


def test_param_count_matches_the_module():
    for overrides in ([], ["model.tie_word_embeddings=true"], ["model=llama3_100m"],
                      ["model=qwen3_0.6b", "model.n_layers=2"], ["model=qwen3_30b_a3b", "model.n_layers=1"]):
        cfg = job_config(overrides).model
        with torch.device("meta"):
            model = Transformer(cfg)
        assert cfg.num_params == sum(p.numel() for p in model.parameters())


def test_rope_matches_the_complex_formulation():
    x = torch.randn(2, 10, 4, 16)
    cos, sin = rope_tables(16, 10, 500000.0)
    freqs = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))  # e^{i * angle}
    ref = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * freqs[None, :, None, :]).flatten(-2)
    torch.testing.assert_close(apply_rope(x, cos, sin), ref)


def test_init_is_deterministic_and_causal():
    cfg = job_config(["model.n_layers=2"]).model
    models = []
    for _ in range(2):
        with torch.device("meta"):
            model = Transformer(cfg)
        model.to_empty(device="cpu")
        model.init_weights(seed=7)
        models.append(model)
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.equal(a, b), name
    tokens = torch.randint(0, cfg.vocab_size, (1, 12))
    changed = tokens.clone()
    changed[0, 8] = (changed[0, 8] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = models[0](tokens), models[0](changed)
    assert torch.equal(a[0, :8], b[0, :8])  # no position sees the future
    assert not torch.equal(a[0, 8:], b[0, 8:])


def test_context_parallel_chunks_attend_through_torchs_causal_bias_not_a_mask(monkeypatch):
    """Each of a CP rank's two chunks attends to the keys before its end through torch's
    lower-right causal bias, which SDPA runs fused on a GPU (a boolean mask over the sequence
    cannot be, and it is kept for the backward); the result is causal attention over the whole
    sequence (one CP rank here: its chunks are the two halves)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.attention.bias import CausalBias

    from titan_exp.models.llama import causal_attention
    from titan_exp.parallel.context import ContextParallel

    seen, dispatch = [], CausalBias._dispatch  # what SDPA calls for a causal bias
    monkeypatch.setattr(CausalBias, "_dispatch", staticmethod(lambda *a, **k: (
        seen.append(k["attn_mask"]), dispatch(*a, **k))[1]))
    q, k, v = (torch.randn(2, 16, 4, 8, requires_grad=True) for _ in range(3))
    ones, zeros = torch.ones(16, 4), torch.zeros(16, 4)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cp = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",)).get_group()
        out = ContextParallel(cp, 0, 1, 16).attention(q, k, v, ones, zeros, lambda x, c, s: x)
        out.sum().backward()  # the all-gather's backward reduce-scatters over the group
    finally:
        dist.destroy_process_group()
    assert [(type(m), m.seq_len_q, m.seq_len_kv) for m in seen] == [(CausalBias, 8, 8), (CausalBias, 8, 16)]
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    reference = causal_attention(q, k, v)
    reference.sum().backward()
    torch.testing.assert_close(out, reference)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want)


# Qwen/Qwen3-*'s config.json: hidden_size, num_hidden_layers, num_attention_heads,
# num_key_value_heads, intermediate_size, tie_word_embeddings, and for the MoE ones
# moe_intermediate_size (128 experts, 8 a token); then the model card's parameters in billions,
# as it rounds them: total, non-embedding (without the embedding and output matrices), activated.
QWEN3 = {
    "qwen3_0.6b": ((1024, 28, 16, 8, 3072, True, None), ("0.6", "0.44", None)),
    "qwen3_1.7b": ((2048, 28, 16, 8, 6144, True, None), ("1.7", "1.4", None)),
    "qwen3_4b": ((2560, 36, 32, 8, 9728, True, None), ("4.0", "3.6", None)),
    "qwen3_8b": ((4096, 36, 32, 8, 12288, False, None), ("8.2", "6.95", None)),
    "qwen3_14b": ((5120, 40, 40, 8, 17408, False, None), ("14.8", "13.2", None)),
    "qwen3_32b": ((5120, 64, 64, 8, 25600, False, None), ("32.8", "31.2", None)),
    "qwen3_30b_a3b": ((2048, 48, 32, 4, 6144, False, 768), ("30.5", "29.9", 3.3)),
    "qwen3_235b_a22b": ((4096, 94, 64, 4, 12288, False, 1536), ("235", "234", 22)),
}


def published_config(preset: str) -> dict:
    """The preset's published config.json, the fields that shape the model."""
    (dim, layers, heads, kv_heads, ffn, tied, expert), _ = QWEN3[preset]
    config = {"model_type": "qwen3", "hidden_size": dim, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": 128, "intermediate_size": ffn, "vocab_size": 151936,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
              "tie_word_embeddings": tied, "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False}
    if expert:
        config |= {"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8,
                   "moe_intermediate_size": expert, "norm_topk_prob": True, "decoder_sparse_step": 1,
                   "mlp_only_layers": [], "router_aux_loss_coef": 0.001}
    return config


def transformers_params(config: dict) -> int:
    """Parameters of transformers' Qwen3 (Qwen3-MoE) built from `config` on the meta device (a
    tied output matrix counted once)."""
    import transformers

    moe = config["model_type"] == "qwen3_moe"
    hf = (transformers.Qwen3MoeConfig if moe else transformers.Qwen3Config)(**config)
    with torch.device("meta"):
        model = (transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM)(hf)
    return sum(p.numel() for p in model.parameters())


def billions(n: int, as_written: str) -> str:
    return f"{n / 1e9:.{len(as_written.partition('.')[2])}f}"


@pytest.mark.parametrize("preset", sorted(QWEN3))
def test_qwen3_presets_are_the_published_models(preset):
    """model=qwen3_*: the fields importing its config.json sets (model.hf_config), the parameters
    of transformers' model of it, and the model card's totals (the MoE's activated ones within 2 %:
    the card's 3.3B for 30B-A3B is 3.35B)."""
    job = job_config([f"model={preset}"])
    cfg, config = job.model, published_config(preset)
    fields = model_fields(config)
    assert cfg.head_size == (fields.pop("head_dim") or cfg.dim // cfg.n_heads) == 128
    assert {k: getattr(cfg, k) for k in fields} == fields
    assert cfg.num_params == transformers_params(config)
    total, non_embedding, active = QWEN3[preset][1]
    matrices = cfg.vocab_size * cfg.dim * (1 if cfg.tie_word_embeddings else 2)
    assert (billions(cfg.num_params, total), billions(cfg.num_params - matrices, non_embedding)) == (
        total, non_embedding)
    assert cfg.active_params / 1e9 == pytest.approx(active or float(total), rel=0.02)
    assert (job.precision.name, job.training.seq_len) == ("bf16", 4096)  # TorchTitan's Qwen3 settings
