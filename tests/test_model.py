"""The Llama 3 model: parameter and FLOP counts by hand, RoPE against the complex formulation."""

from __future__ import annotations

import pytest
import torch

from conftest import job_config
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
    for overrides in ([], ["model.tie_word_embeddings=true"], ["model=llama3_100m"]):
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
