"""Every Hugging Face directory a run writes holds the run's tokenizer: a real 2-step run exported
at its end (checkpoint.last_save_in_hf), as its evaluation exports (eval.*) and by the command line, each
loaded offline with transformers' AutoTokenizer and AutoModelForCausalLM, whose ids are the run's
tokenizer's and whose config names the same BOS/EOS. A tokenizer that cannot be exported is
refused in one line, before anything is written."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from conftest import run_job

from titan_exp.config import ModelConfig
from titan_exp.data.corpus import Tokenizer, default_corpus, trained_tokenizer
from titan_exp.models import hf

transformers = pytest.importorskip("transformers")

TEXT = "def f(x):\n    return x ** 2  # the square, naïvely\n"


def loaded(folder, run: Tokenizer) -> torch.Tensor:
    """The directory through transformers, offline, checked against the run's tokenizer; the
    logits of TEXT (as the run fed documents: BOS first)."""
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in folder.iterdir()}
    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ids = run.encode(TEXT)
    assert tok.encode(TEXT, add_special_tokens=False) == ids
    assert tok.decode(ids) == TEXT == run.decode(ids)
    assert (tok.bos_token, tok.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert (tok.bos_token_id, tok.eos_token_id) == (run.bos_id, run.eos_id) != (None, None)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    assert (model.config.bos_token_id, model.config.eos_token_id) == (run.bos_id, run.eos_id)
    with torch.no_grad():
        logits = model(torch.tensor([run.encode(TEXT, bos=True)])).logits
    assert logits.shape == (1, len(ids) + 1, model.config.vocab_size) and logits.isfinite().all()
    return logits


def test_every_hf_export_of_a_run_holds_its_tokenizer(tmp_path, capsys):
    """The step-2 model of a real run exported at its end, as its evaluation exports a snapshot
    (the evaluator's export_model) and by the command (its main): each loads with its tokenizer and gives
    the same logits. Without the tokenizer beside the run's config.yaml the command refuses in one
    line and writes nothing; --tokenizer names it."""
    from titan_exp.checkpoint.export import main
    from titan_exp.eval.evaluator import export_model
    from titan_exp.record import RunDir

    run_dir = tmp_path / "run"
    code, summary = run_job(["training.steps=2", "training.seq_len=32", "training.global_batch_size=4",
                             "training.local_batch_size=4", "checkpoint.enable=true", "checkpoint.interval=2",
                             "checkpoint.last_save_in_hf=true"], run_dir)
    assert code == 0 and summary["status"] == "ok", summary
    assert main(["export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "cli")]) == 0
    snapshot = tmp_path / "snapshot" / "step-2"
    shutil.copytree(run_dir / "checkpoints" / "step-2", snapshot)
    export_model(snapshot, RunDir(run_dir), tmp_path / "eval")
    assert not snapshot.exists()  # removed once exported, as the evaluator does

    run = Tokenizer(run_dir / "tokenizer.json")
    end, evaluated, cli = (loaded(d, run) for d in (run_dir / "export" / "hf", tmp_path / "eval", tmp_path / "cli"))
    assert torch.equal(end, evaluated) and torch.equal(end, cli)

    (run_dir / "tokenizer.json").rename(tmp_path / "elsewhere.json")
    with pytest.raises(SystemExit) as refused:
        main(["export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "refused")])
    assert refused.value.code == 2 and not (tmp_path / "refused").exists()
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"python -m titan_exp.checkpoint: error: no tokenizer at {run_dir / 'tokenizer.json'}: give the run's "
        "tokenizer.json (or its directory) with --tokenizer; a Hugging Face export holds it")
    main(["export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "named"),
          "--tokenizer", str(tmp_path / "elsewhere.json")])
    assert torch.equal(loaded(tmp_path / "named", run), end)


@pytest.mark.quick
def test_a_hugging_face_tokenizer_keeps_its_own_specials_and_settings(tmp_path):
    """A tokenizer directory whose tokenizer_config.json names other BOS/EOS and has a chat
    template: the export names the BOS/EOS the run trained with (data.corpus.Tokenizer's) and
    keeps the template."""
    bpe = Tokenizer(trained_tokenizer(default_corpus(), 2048))
    source = tmp_path / "source"
    source.mkdir()
    (source / "tokenizer.json").write_text(trained_tokenizer(default_corpus(), 2048).read_text())
    (source / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|end_of_text|>"}, "eos_token": "<|begin_of_text|>",
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    run = Tokenizer(source)
    assert (run.bos_id, run.eos_id) == (bpe.eos_id, bpe.bos_id)  # the names it gives, swapped
    exported = hf.hf_tokenizer(source, ModelConfig(vocab_size=2048, max_seq_len=96))
    exported.save_pretrained(tmp_path / "out")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out", local_files_only=True)
    assert (tok.bos_token_id, tok.eos_token_id, tok.model_max_length) == (run.bos_id, run.eos_id, 96)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"


@pytest.mark.quick
@pytest.mark.parametrize("where, vocab, message", [
    ("missing.json", 2048, "no tokenizer at {path}; a Hugging Face export holds the run's tokenizer"),
    ("bpe", 1000, "the tokenizer {path} has 2048 tokens, more than the model's vocab_size 1000"),
    ("bad.json", 2048, "{path} is not a tokenizer the tokenizers library reads"),
], ids=["missing", "too-big", "unreadable"])
def test_a_tokenizer_that_cannot_be_exported_is_refused_in_one_line(tmp_path, where, vocab, message):
    path = trained_tokenizer(default_corpus(), 2048) if where == "bpe" else tmp_path / where
    if where == "bad.json":
        path.write_text("{}")
    with pytest.raises(ValueError) as info:
        hf.hf_tokenizer(path, ModelConfig(vocab_size=vocab))
    assert str(info.value).startswith(message.format(path=path)) and "\n" not in str(info.value)


@pytest.mark.quick
def test_an_export_without_transformers_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # Python's own way of making a module unimportable
    with pytest.raises(ValueError, match=r"^a Hugging Face export writes the tokenizer with transformers: transformers "
                                         r"is not installed; pip install 'titan_exp\[hf\]'$"):
        hf.hf_tokenizer(trained_tokenizer(default_corpus(), 2048), ModelConfig(vocab_size=2048))
