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


@pytest.mark.quick
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


@pytest.mark.quick
def test_each_dp_rank_gets_its_slice_of_the_global_batch(tokenizer):
    single = loader(tokenizer, dp=1, local_batch=2)
    ranks = [loader(tokenizer, dp_rank=r, dp=4, local_batch=2) for r in range(4)]
    for _ in range(3):
        whole = torch.cat([x for x, _ in single.next_batch()])
        parts = [torch.cat([x for x, _ in r.next_batch()]) for r in ranks]
        assert all(p.shape == (2, 32) for p in parts)
        assert torch.equal(torch.cat(parts), whole)


@pytest.mark.quick
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


# ---- Your own data (#14): every local format through `datasets`, splits, checks, tokenizers ----

DOCS = [f"document {i}: " + "some words of text " * (3 + i % 5) + f"and its end {i}." for i in range(24)]


def write_formats(root, docs) -> dict[str, str]:
    """The same documents as each local builder reads them: data.dataset -> data.path."""
    import pyarrow as pa
    import pyarrow.csv
    import pyarrow.parquet

    root.mkdir(parents=True, exist_ok=True)
    table = pa.table({"text": docs, "id": list(range(len(docs)))})
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    pa.parquet.write_table(table, root / "docs.parquet")
    pa.csv.write_csv(table, root / "docs.csv")
    with pa.ipc.new_stream(str(root / "docs.arrow"), table.schema) as writer:  # the arrow builder's stream format
        writer.write_table(table)
    (root / "text").mkdir(exist_ok=True)
    for i, d in enumerate(docs):  # the text builder: a directory, one document per file
        (root / "text" / f"doc{i:03d}.txt").write_text(d)
    return {"json": str(root / "docs.jsonl"), "parquet": str(root / "docs.parquet"), "csv": str(root / "docs.csv"),
            "arrow": str(root / "docs.arrow"), "text": str(root / "text")}


def stream(source: DataConfig, tokenizer, batches=3) -> list[list[int]]:
    load = PackedLoader(open_dataset(source), tokenizer, text_field=source.text_field, seq_len=16,
                        global_batch_size=4, local_batch_size=4, dp_rank=0, dp_degree=1)
    return [load.next_batch()[0][0].tolist() for _ in range(batches)]


def test_every_local_format_gives_the_same_token_stream(tmp_path, tokenizer):
    paths = write_formats(tmp_path, DOCS)
    expected = stream(DataConfig(dataset="json", path=paths["json"]), tokenizer)
    assert expected[0][0][0] == tokenizer.bos_id
    for builder in ("parquet", "csv", "arrow", "text"):
        assert stream(DataConfig(dataset=builder, path=paths[builder]), tokenizer) == expected, builder


def test_a_directory_splits_by_file_name(tmp_path, tokenizer):
    """data.path a directory of train.* and validation.* files: data.split picks; a file given by
    name is whatever split is asked for."""
    import pyarrow as pa
    import pyarrow.parquet

    pa.parquet.write_table(pa.table({"text": DOCS[:12]}), tmp_path / "train.parquet")
    pa.parquet.write_table(pa.table({"text": DOCS[12:]}), tmp_path / "validation.parquet")
    split = stream(DataConfig(dataset="parquet", path=str(tmp_path), split="validation"), tokenizer, batches=1)
    named = stream(DataConfig(dataset="parquet", path=str(tmp_path / "validation.parquet"), split="validation"),
                   tokenizer, batches=1)
    train = stream(DataConfig(dataset="parquet", path=str(tmp_path)), tokenizer, batches=1)
    assert split == named != train
    assert tokenizer.decode(split[0][0][1:4]) in DOCS[12]


@pytest.mark.parametrize("overrides, message", [
    (["data.dataset=parquet"],
     "data.path = None: data.dataset = 'parquet' reads local files; give a file, glob or directory"),
    (["data.dataset=csv", "data.path=/nonexistent/*.csv"], "data.path = '/nonexistent/*.csv': matches no file"),
    (["data.dataset=allenai/c4", "data.path=/data/c4"],
     "data.path = '/data/c4': would be ignored: 'allenai/c4' is a hub data set, which reads its own files"),
    (["data.dataset=json", "data.path={docs}", "data.name=en"],
     "data.name = 'en': would be ignored: local files (json) have no subsets"),
    (["data.dataset=text", "data.path={docs}", "data.text_field=body"],
     "data.text_field = 'body': would be ignored: the text builder's field is always 'text'"),
    (["data.dataset=json", "data.path={docs}", "validation.enable=true"],
     "validation.path = None: validation would read data.path"),
    (["data.tokenizer_path={tmp}"], "is neither a tokenizer.json file nor a directory holding one"),
])
def test_a_field_that_would_be_ignored_or_is_missing_is_refused(overrides, message, tmp_path):
    from conftest import job_config

    from titan_exp.validation import validate

    (tmp_path / "docs.jsonl").write_text('{"text": "a"}\n')
    fill = {"docs": tmp_path / "docs.jsonl", "tmp": tmp_path}
    errors = validate(job_config([o.format(**fill) for o in overrides]), cuda=False)
    assert any(message.format(**fill) in e for e in errors), errors


def test_a_missing_text_field_names_the_fields_there_are(tmp_path):
    from titan_exp.data.sources import data_file_errors

    paths = write_formats(tmp_path, DOCS[:3])
    (error,) = data_file_errors(DataConfig(dataset="parquet", path=paths["parquet"], text_field="body"))
    assert error == ("data.text_field = 'body': the records of " + paths["parquet"]
                     + " have no string field 'body'; choose from text, id")


def test_a_hub_data_set_without_a_network_says_so_at_once(monkeypatch):
    from titan_exp.data import sources

    monkeypatch.setattr(sources, "HUB_HOST", "hub.invalid")  # what no network looks like, whatever CI's is
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    (error,) = sources.hub_errors(DataConfig(dataset="c4"), "data")
    assert error.startswith("data.dataset = 'c4': is a hub data set and hub.invalid cannot be reached from here")
    assert "HF_DATASETS_OFFLINE=1" in error and "data.dataset=json|text|parquet|csv|arrow" in error


def hf_tokenizer_dir(root, specials: dict | None):
    """A Hugging Face tokenizer directory: tokenizer.json with its own special tokens, and
    tokenizer_config.json naming BOS/EOS (as Llama 3's does), if `specials`."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<start>", "<stop>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(DOCS, trainer=trainer)
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    if specials:
        (root / "tokenizer_config.json").write_text(json.dumps(specials))
    return root


def test_a_tokenizer_directory_honours_its_named_bos_and_eos(tmp_path):
    named = Tokenizer(hf_tokenizer_dir(tmp_path / "named",
                                       {"bos_token": "<start>", "eos_token": {"content": "<stop>"}}))
    plain = Tokenizer(hf_tokenizer_dir(tmp_path / "plain", None) / "tokenizer.json")
    ids = named.encode("hello", bos=True, eos=True)
    assert (ids[0], ids[-1]) == (named._tok.token_to_id("<start>"), named._tok.token_to_id("<stop>"))
    assert (plain.bos_id, plain.eos_id) == (plain._tok.token_to_id("<s>"), plain._tok.token_to_id("</s>"))


def test_my_parquet_files_and_tokenizer_train_with_a_held_out_loss(tmp_path):
    """The user's path end to end: parquet train files in a directory, held-out parquet files, a
    Hugging Face tokenizer directory; a real launch, its rank a real process."""
    import pyarrow as pa
    import pyarrow.parquet
    from conftest import SMALL, run_job

    (tmp_path / "data").mkdir()
    (tmp_path / "held_out").mkdir()
    for i in range(2):
        pa.parquet.write_table(pa.table({"body": DOCS[i::2] * 4}), tmp_path / "data" / f"part-{i}.parquet")
    pa.parquet.write_table(pa.table({"body": [d.upper() for d in DOCS]}), tmp_path / "held_out" / "val.parquet")
    tokenizer = hf_tokenizer_dir(tmp_path / "tok", {"bos_token": "<start>", "eos_token": "<stop>"})
    run_dir = tmp_path / "run"
    code, summary = run_job([*SMALL, "training.steps=3", "model.vocab_size=512", "data.dataset=parquet",
                             f"data.path={tmp_path / 'data'}", "data.text_field=body",
                             f"data.tokenizer_path={tokenizer}", "validation.enable=true", "validation.freq=2",
                             f"validation.path={tmp_path / 'held_out'}"],
                            run_dir)
    assert code == 0 and summary["status"] == "ok", summary
    assert list(summary["val_losses"]) == ["2", "3"] and summary["final_val_loss"] == summary["val_losses"]["3"]
    assert (run_dir / "tokenizer_config.json").exists()  # the ranks used its BOS/EOS
    assert [json.loads(line).get("val_loss") is not None
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [False, True, True]


# ---- The token store (titan_exp.data.tokens): the same batches at O(rows per rank) ----

@pytest.fixture(scope="module")
def store(tmp_path_factory, tokenizer):
    from titan_exp.data.tokens import prepare

    cfg = DataConfig(dataset="json", path=str(default_corpus()))
    path = trained_tokenizer(default_corpus(), 2048)
    return prepare(iter(open_dataset(cfg)), "text", path, tmp_path_factory.mktemp("store"), source={}, workers=2)


def token_loader(store, *, dp_rank=0, dp=1, global_batch=64, local_batch=64, seq_len=256):
    from titan_exp.data.tokens import TokenLoader

    return TokenLoader(store, seq_len=seq_len, global_batch_size=global_batch, local_batch_size=local_batch,
                       dp_rank=dp_rank, dp_degree=dp)


@pytest.mark.quick
def test_the_token_store_serves_the_streaming_batches_across_passes(store, tokenizer):
    """Prepared over 2 processes, in order: the same rows as the streaming loader, pass after
    pass (128k tokens, 16k per batch), and each of 4 ranks its slice of them."""
    assert store.manifest["dtype"] == "uint16" and store.manifest["documents"] > 50
    streaming = loader(tokenizer, global_batch=64, local_batch=64, seq_len=256)
    ranks = [token_loader(store, dp_rank=r, dp=4, local_batch=8) for r in range(4)]
    passes = 0
    for _ in range(20):
        (want, labels), = streaming.next_batch()
        got = torch.cat([x for r in ranks for x, _ in r.next_batch()])
        assert torch.equal(got, want)
        passes = streaming.epoch
    assert passes >= 2


def test_the_token_store_resumes_under_another_data_parallel_degree(store):
    one = token_loader(store, global_batch=8, local_batch=8, seq_len=64)
    for _ in range(5):
        one.next_batch()
    state = json.loads(json.dumps(one.state_dict()))
    assert state == {"row": 40}  # the position is one integer, the next global row
    want = torch.cat([x for x, _ in one.next_batch()])
    halves = [token_loader(store, dp_rank=r, dp=2, global_batch=8, local_batch=4, seq_len=64) for r in range(2)]
    for h in halves:
        h.load_state_dict(state)
    assert torch.equal(torch.cat([x for h in halves for x, _ in h.next_batch()]), want)


def test_prepare_writes_a_store_from_parquet_that_launch_checks(tmp_path):
    """`python -m titan_exp.data.prepare` as a user runs it; a store whose manifest is missing
    (a prepare that died) or made with another tokenizer is refused, naming why."""
    import subprocess
    import sys

    from conftest import REPO, job_config

    from titan_exp.data.sources import store_errors
    from titan_exp.validation import validate

    paths = write_formats(tmp_path / "src", DOCS)
    out = subprocess.run([sys.executable, "-m", "titan_exp.data.prepare", "data.dataset=parquet",
                          f"data.path={paths['parquet']}", "--out", str(tmp_path / "store"), "--workers", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["documents"] == len(DOCS) and manifest["source"]["dataset"] == "parquet"
    job = job_config(["data.dataset=tokens", f"data.path={tmp_path / 'store'}"])
    assert validate(job, cuda=False) == []
    other = hf_tokenizer_dir(tmp_path / "tok", None) / "tokenizer.json"
    (error,) = store_errors(job.data, other, 4096)
    assert error.startswith("data.tokenizer_path = None: is not the tokenizer") and "was prepared with" in error
    (tmp_path / "store" / "manifest.json").unlink()
    errors = validate(job_config(["data.dataset=tokens", f"data.path={tmp_path / 'store'}"]), cuda=False)
    assert any("data.path" in e and "not a token store: no manifest.json there" in e for e in errors), errors


def test_pretokenize_trains_like_the_stream_under_fsdp(reference, tmp_path):
    """data.pretokenize=true: the launcher prepares the store once into the cache and two FSDP
    ranks read their own rows; the losses and held-out loss are the single process's (which
    streamed and tokenized as it went)."""
    from conftest import SMALL, VALIDATION, run_job

    code, summary = run_job([*SMALL, *VALIDATION, "data.pretokenize=true", "parallelism=fsdp",
                             "cluster.nproc_per_node=2", "training.local_batch_size=4"], tmp_path / "run")
    assert code == 0 and summary["status"] == "ok", summary
    assert summary["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    assert summary["val_losses"] == pytest.approx(reference["val_losses"], abs=1e-5)
    resolved = (tmp_path / "run" / "config.yaml").read_text()
    assert "dataset: tokens" in resolved and "/tokens/" in resolved
