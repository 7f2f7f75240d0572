"""Data mixtures (data.mixture, issue 39): rows drawn by weight, the same global batches in every
layout, exact resume under another data-parallel degree, tokens and held-out loss per source."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from titan_exp.config import DataConfig
from titan_exp.data.corpus import Tokenizer, default_corpus, trained_tokenizer
from titan_exp.data.loader import build_loader
from titan_exp.data.mixture import Mixture, draw
from titan_exp.data.sources import open_dataset

DOCS = [f"document {i}: " + "words of the second source " * (2 + i % 7) + f"end {i}." for i in range(40)]
SEQ = 16


@pytest.fixture(scope="module")
def tokenizer_path():
    return trained_tokenizer(default_corpus(), 2048)


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tokenizer_path):
    """A token store of the bundled corpus and a JSON file read as a stream."""
    from titan_exp.data.tokens import prepare

    root = tmp_path_factory.mktemp("mixture")
    (root / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    corpus = DataConfig(dataset="json", path=str(default_corpus()))
    store = prepare(iter(open_dataset(corpus)), "text", tokenizer_path, root / "a", source={})
    return {"a": store, "b": DataConfig(dataset="json", path=str(root / "b.jsonl"))}


def loaders(sources, tokenizer_path, *, dp=1, global_batch=8, local_batch=None, weights=(0.75, 0.25), seed=7):
    """One mixture loader per data-parallel rank."""
    tok = Tokenizer(tokenizer_path)
    mix = Mixture(("a", "b"), weights, (sources["a"], open_dataset(sources["b"])), ("text", "text"), seed)
    return [build_loader(mix, tok, seq_len=SEQ, global_batch_size=global_batch,
                         local_batch_size=local_batch or global_batch // dp, dp_rank=r, dp_degree=dp)
            for r in range(dp)]


def global_batch(ranks) -> torch.Tensor:
    return torch.cat([torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in r.next_batch()]) for r in ranks])


def test_rows_come_from_each_source_in_order_by_weight_the_same_in_every_layout(sources, tokenizer_path):
    """The global batches of one rank and of 4 ranks are the same; source s's rows, in order,
    are that source's own stream; the shares follow the weights; tokens_per_source counts them."""
    batches, g = 30, 8
    (one,), four = loaders(sources, tokenizer_path), loaders(sources, tokenizer_path, dp=4, local_batch=1)
    got = [global_batch([one]) for _ in range(batches)]
    assert all(torch.equal(global_batch(four), want) for want in got)
    choice = np.concatenate([draw(7, b, (0.75, 0.25), g) for b in range(batches)])
    rows = torch.cat(got)
    tok = Tokenizer(tokenizer_path)
    alone = {"a": build_loader(sources["a"], tok, seq_len=SEQ, global_batch_size=1, local_batch_size=1, dp_rank=0,
                               dp_degree=1),
             "b": build_loader(open_dataset(sources["b"]), tok, text_field="text", seq_len=SEQ, global_batch_size=1,
                               local_batch_size=1, dp_rank=0, dp_degree=1, prefetch=False)}
    for s, label in enumerate(("a", "b")):
        mine = rows[torch.from_numpy(choice == s)]
        assert torch.equal(mine, alone[label].take(len(mine), slice(0, len(mine)))), label
    assert 0.65 < (choice == 0).mean() < 0.85  # 240 draws at 3:1
    assert one.tokens_per_source() == {"a": int((choice == 0).sum()) * SEQ, "b": int((choice == 1).sum()) * SEQ}
    assert four[0].tokens_per_source() == one.tokens_per_source()  # global counts on every rank


def test_the_position_resumes_exactly_under_another_data_parallel_degree(sources, tokenizer_path):
    (one,) = loaders(sources, tokenizer_path)
    for _ in range(5):
        one.next_batch()
    state = json.loads(json.dumps(one.state_dict()))  # as the checkpoint keeps it
    assert state["batch"] == 5 and set(state["sources"]) == {"a", "b"}
    want = [global_batch([one]) for _ in range(3)]
    two = loaders(sources, tokenizer_path, dp=2)
    for r in two:
        r.load_state_dict(state)
    assert all(torch.equal(global_batch(two), w) for w in want)
    assert two[1].tokens_per_source() == one.tokens_per_source()
    with pytest.raises(ValueError, match="a single source's, not a mixture's"):
        two[0].load_state_dict({"row": 3})


BAD = [
    (["data.mixture=[{dataset: json, path: A, weight: 3}, {dataset: json, path: B, weight: -1}]"],
     "data.mixture[1].weight = -1.0: must be a positive number"),
    (["data.mixture=[{path: A}]"], "data.mixture[0].dataset = None: give the source's builder"),
    (["data=mixture", "data.mixture.1.path=B"], "data.mixture[0].path = None: data.mixture[0].dataset = 'json' reads"),
    (["data.mixture=[{dataset: json, path: A}]", "data.path=A"], "data.path = 'A': would be ignored: data.mixture"),
    (["data.mixture=[{dataset: json, path: A}, {dataset: json, path: A}]"],
     "data.mixture[1].label = None: 'A' names source 0"),
    (["data.mixture=[{dataset: json, path: NOPE/*.jsonl}]"], "data.mixture[0].path = 'NOPE/*.jsonl': matches no file"),
    (["data.mixture=[{dataset: json}]"],
     "data.mixture[0].path = None: data.mixture[0].dataset = 'json' reads local files"),
    (["data.mixture=[{dataset: tokens, path: A}]", "validation.enable=true"],
     "data.mixture[0].validation_path = None: a token store has no splits"),
    (["data.mixture=[{dataset: json, path: A}]", "validation.enable=true", "validation.path=B"],
     "validation.path = 'B': would be ignored: with data.mixture"),
    (["data.mixture=[{dataset: json, path: A}]", "validation.enable=true"],
     "data.mixture[0].validation_path = None: validation would read the files training reads"),
]


@pytest.mark.quick
@pytest.mark.parametrize("overrides, message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_a_bad_mixture_is_refused_naming_the_field(overrides, message, tmp_path, monkeypatch):
    from conftest import job_config

    from titan_exp.validation import validate

    monkeypatch.chdir(tmp_path)
    for name in ("A", "B"):
        (tmp_path / name).write_text(json.dumps({"text": "a document"}) + "\n")
    errors = validate(job_config(overrides), cuda=False)
    assert any(e.startswith(message) for e in errors), errors


def test_a_mixture_trains_resumes_under_fsdp_and_reports_each_source(tmp_path):
    """The user's path, real ranks: a 3:1 mixture of a JSON file (its held-out file given) and a
    directory of train and validation files. One process trains 4 steps, checkpointing at step 2;
    FSDP 2 continues from that checkpoint with the same losses, held-out losses and token counts,
    and so does FSDP 2 from token stores (data.pretokenize, each source and held-out set prepared
    once). The summary, metrics.jsonl and the sweep report show each source."""
    from conftest import SMALL, run_job

    from titan_exp.report import write_report

    (tmp_path / "b").mkdir()
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[::2]))
    (tmp_path / "a_val.jsonl").write_text("".join(json.dumps({"text": d.upper()}) + "\n" for d in DOCS[:8]))
    (tmp_path / "b" / "train.jsonl").write_text("".join(json.dumps({"body": d[::-1]}) + "\n" for d in DOCS))
    (tmp_path / "b" / "validation.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in DOCS[1::5]))
    mixture = (f"data.mixture=[{{dataset: json, path: {tmp_path}/a.jsonl, weight: 3, "
               f"validation_path: {tmp_path}/a_val.jsonl}},"
               f" {{dataset: json, path: {tmp_path}/b, text_field: body, label: reversed}}]")
    job = [*SMALL, "training.steps=4", mixture, "validation.enable=true", "validation.freq=2", "validation.steps=1",
           "checkpoint=default", "checkpoint.interval=2"]
    code, whole = run_job(job, tmp_path / "sweep" / "0")
    assert code == 0 and whole["status"] == "ok", whole
    code, then = run_job([*job, "parallelism=fsdp", "cluster.nproc_per_node=2", "training.local_batch_size=4",
                          f"checkpoint.initial_load_path={tmp_path}/sweep/0/checkpoints/step-2",
                          "checkpoint.initial_load_model_only=false"], tmp_path / "sweep" / "1")
    assert code == 0 and then["start_step"] == 3, then
    assert then["losses"] == pytest.approx(whole["losses"][2:], abs=1e-5)
    code, stores = run_job([*job, "parallelism=fsdp", "cluster.nproc_per_node=2", "training.local_batch_size=4",
                            "data.pretokenize=true", "checkpoint.enable=false"], tmp_path / "stores")
    assert code == 0 and stores["losses"] == pytest.approx(whole["losses"], abs=1e-5), stores
    assert stores["val_loss_per_source"] == pytest.approx(whole["val_loss_per_source"], abs=1e-5)
    assert stores["tokens_per_source"] == whole["tokens_per_source"]
    assert (tmp_path / "stores" / "config.yaml").read_text().count("dataset: tokens") == 2
    assert then["val_losses"]["4"] == pytest.approx(whole["val_losses"]["4"], abs=1e-5)
    assert then["val_loss_per_source"] == pytest.approx(whole["val_loss_per_source"], abs=1e-5)
    assert set(whole["val_loss_per_source"]) == {"a", "reversed"}
    assert whole["final_val_loss"] == pytest.approx(0.75 * whole["val_loss_per_source"]["a"]
                                                    + 0.25 * whole["val_loss_per_source"]["reversed"])
    tokens = whole["tokens_per_source"]
    assert (then["tokens_per_source"] == tokens and sum(tokens.values()) == 4 * 8 * 64
            and tokens["a"] > tokens["reversed"] > 0)
    records = [json.loads(line) for line in (tmp_path / "sweep" / "0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens/a"] + r["tokens/reversed"] for r in records] == [8 * 64 * s for s in (1, 2, 3, 4)]
    assert [("val_loss/a" in r, "val_loss/reversed" in r) for r in records] == [(False, False), (True, True)] * 2
    for member, overrides in (("0", job), ("1", [*job, "parallelism=fsdp"])):  # as a multirun's Hydra records them
        (tmp_path / "sweep" / member / ".hydra").mkdir()
        (tmp_path / "sweep" / member / ".hydra" / "overrides.yaml").write_text(json.dumps(overrides))
    rows = write_report(tmp_path / "sweep", plots=False)
    assert [r["per_source"]["tokens reversed"] for r in rows] == [tokens["reversed"]] * 2
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert "| tokens a | tokens reversed | val_loss a | val_loss reversed |" in report, report


def test_a_token_store_made_with_another_tokenizer_is_refused_before_any_rank(sources, tmp_path, caplog):
    from conftest import run_job

    store = sources["a"].folder
    code, summary = run_job([f"data.mixture=[{{dataset: tokens, path: {store}}}]", "data.tokenizer_vocab_size=1024"],
                            tmp_path / "run")
    assert code != 0 and summary is None and not (tmp_path / "run").exists()  # nothing written, no rank started
    assert f"data.tokenizer_path = None: is not the tokenizer {store} was prepared with" in caplog.text
