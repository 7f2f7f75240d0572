"""Corpus, tokenizer and the packed loader: packing, sharding by rank, resumable position."""

from __future__ import annotations

import json

import pytest
import torch

from titan_exp.config import DataConfig
from titan_exp.data.corpus import Tokenizer, default_corpus, trained_tokenizer
from titan_exp.data.loader import PackedLoader
from titan_exp.data.sources import open_dataset


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(trained_tokenizer(default_corpus(), 2048))


def loader(tokenizer, *, dp_rank=0, dp=1, global_batch=8, local_batch=4, seq_len=32, path=None):
    cfg = DataConfig(dataset="json", path=str(path or default_corpus()))
    return PackedLoader(open_dataset(cfg), tokenizer, text_field="text", seq_len=seq_len,
                        global_batch_size=global_batch, local_batch_size=local_batch, dp_rank=dp_rank, dp_degree=dp)


def test_default_corpus_is_real_text_on_disk():
    docs = [json.loads(line) for line in default_corpus().read_text().splitlines()]
    assert len(docs) > 50 and sum(len(d["text"]) for d in docs) > 300_000
    assert default_corpus() == default_corpus()  # cached by content, stable


def test_tokenizer_round_trip(tokenizer):
    assert tokenizer.vocab_size == 2048
    for text in ["def f(x):\n    return x ** 2", "Ünïcödé ✓ and emoji 🚀", "  leading spaces\ttabs\n\n"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    ids = tokenizer.encode("hello", bos=True, eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id


def test_packing_concatenates_documents_into_shifted_rows(tmp_path, tokenizer):
    docs = ["first document " * 5, "second one", "third " * 20]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    stream = [t for d in docs for t in tokenizer.encode(d, bos=True, eos=True)]
    load = loader(tokenizer, path=path, global_batch=2, local_batch=1, seq_len=8)
    (x0, y0), (x1, y1) = load.next_batch()
    assert x0.shape == (1, 8)
    assert x0[0].tolist() == stream[:8] and y0[0].tolist() == stream[1:9]
    assert x1[0].tolist() == stream[9:17]  # rows are seq_len + 1 tokens, back to back


def test_each_dp_rank_gets_its_slice_of_the_global_batch(tokenizer):
    single = loader(tokenizer, dp=1, local_batch=2)
    ranks = [loader(tokenizer, dp_rank=r, dp=4, local_batch=2) for r in range(4)]
    for _ in range(3):
        whole = torch.cat([x for x, _ in single.next_batch()])
        parts = [torch.cat([x for x, _ in r.next_batch()]) for r in ranks]
        assert all(p.shape == (2, 32) for p in parts)
        assert torch.equal(torch.cat(parts), whole)


def test_position_resumes_exactly_even_across_passes(tokenizer):
    first = loader(tokenizer, global_batch=64, local_batch=64, seq_len=256)
    for _ in range(12):  # more than one pass over the corpus
        first.next_batch()
    assert first.epoch >= 1
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    expected = [first.next_batch() for _ in range(2)]
    second = loader(tokenizer, global_batch=64, local_batch=64, seq_len=256)
    second.load_state_dict(state)
    for want in expected:
        got = second.next_batch()
        assert all(torch.equal(a[0], b[0]) for a, b in zip(want, got))


def test_position_saved_twice_across_a_resume(tmp_path, tokenizer):
    """Save, resume, take batches that come from the token buffer alone (no document read), save
    again, resume again: the second resume continues exactly. (A datasets IterableDataset reports
    its initial state until it is iterated after a load; the soak test found this.)"""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 400}) + "\n" for i in range(40)))
    first = loader(tokenizer, path=path, global_batch=2, local_batch=2, seq_len=16)
    for _ in range(3):
        first.next_batch()
    expected = [first.next_batch() for _ in range(6)]
    second = loader(tokenizer, path=path, global_batch=2, local_batch=2, seq_len=16)
    second.load_state_dict(json.loads(json.dumps(first_state := _state_after(tokenizer, path, 3))))
    assert len(second.buffer) > 2 * 17  # the next batch comes from the buffer
    second.next_batch()
    third = loader(tokenizer, path=path, global_batch=2, local_batch=2, seq_len=16)
    third.load_state_dict(json.loads(json.dumps(second.state_dict())))
    assert third.state_dict()["dataset"] == first_state["dataset"]
    for want in expected[1:]:
        got = third.next_batch()
        assert all(torch.equal(a[0], b[0]) for a, b in zip(want, got))


def _state_after(tokenizer, path, batches):
    load = loader(tokenizer, path=path, global_batch=2, local_batch=2, seq_len=16)
    for _ in range(batches):
        load.next_batch()
    return load.state_dict()
