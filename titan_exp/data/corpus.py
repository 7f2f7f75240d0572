"""Assets every run needs before its ranks start: the default corpus and a tokenizer.

Nothing here touches the network. The default corpus is the Python documentation topics that
every CPython install carries (`pydoc_data.topics`), written once to a JSONL file; the default
tokenizer is a byte-level BPE trained on it with `tokenizers`. Both are cached under
$TITAN_EXP_CACHE (default ~/.cache/titan_exp), keyed by a hash of what they were made from, and
written atomically so concurrent launches never see half a file.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from titan_exp.cache import cache_dir
from titan_exp.config import DataConfig
from titan_exp.files import atomic_write
from titan_exp.models.tokenizer import BOS, EOS, special_ids, tokenizer_file


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# Standard-library modules whose docstrings are the bundled held-out set: text like the
# training corpus (Python's documentation), never in it.
HELD_OUT_MODULES = ("builtins", "collections", "itertools", "functools", "re", "json", "pathlib", "string",
                    "textwrap", "random", "statistics", "heapq", "bisect", "math", "os", "shutil", "typing",
                    "dataclasses", "enum", "argparse", "logging", "datetime", "decimal", "fractions")


def _held_out_docs() -> list[dict]:
    import importlib
    import inspect

    docs = []
    for name in HELD_OUT_MODULES:
        module = importlib.import_module(name)
        parts = [inspect.getdoc(module) or ""]
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if not attr.startswith("_") and getattr(obj, "__module__", None) == name and (doc := inspect.getdoc(obj)):
                parts.append(f"{attr}\n{doc}")
        docs.append({"title": name, "text": "\n\n".join(p for p in parts if p)})
    return docs


BUNDLED_PREFIX = "pydoc_topics-"  # the bundled corpus's folder in the cache: pydoc_topics-<digest>


def is_bundled(path: str | None) -> bool:
    """Whether `path` is the bundled corpus's folder, which the launcher sets as data.path for
    data.dataset=pydoc_topics."""
    name = Path(path).name if path else ""
    return name.startswith(BUNDLED_PREFIX) and name[len(BUNDLED_PREFIX):].isalnum()


def default_corpus() -> Path:
    """The bundled data set's training file: Python's documentation topics as one JSON document
    per line, in a fixed shuffled order. Beside it, validation.jsonl holds the docstrings of some
    standard-library modules, held out; the folder is what `data.dataset=pydoc_topics` reads."""
    from pydoc_data.topics import topics

    docs = [{"title": k, "text": v} for k, v in sorted(topics.items())]
    random.Random(0).shuffle(docs)
    train = "".join(json.dumps(d) + "\n" for d in docs)
    validation = "".join(json.dumps(d) + "\n" for d in _held_out_docs())
    folder = cache_dir() / f"{BUNDLED_PREFIX}{_digest(train + validation)}"
    folder.mkdir(parents=True, exist_ok=True)
    # train last: it marks the folder done
    for name, payload in (("validation.jsonl", validation), ("train.jsonl", train)):
        if not (folder / name).exists():
            atomic_write(folder / name, payload)
    return folder / "train.jsonl"


def trained_tokenizer(corpus: Path, vocab_size: int) -> Path:
    """A byte-level BPE trained on `corpus` (JSONL with a 'text' field), cached by content."""
    text = corpus.read_text()
    path = cache_dir() / f"bpe-{vocab_size}-{_digest(text)}.json"
    if path.exists():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    docs = (json.loads(line)["text"] for line in text.splitlines())
    tok.train_from_iterator(docs, trainer=trainer)
    atomic_write(path, tok.to_str())
    return path


def assets(d: DataConfig) -> tuple[DataConfig, Path]:
    """The data node with the bundled corpus's folder filled in (data.dataset=pydoc_topics), and
    the tokenizer file the run uses: data.tokenizer_path's, or the BPE trained on the corpus."""
    import dataclasses

    bundled = d.dataset == "pydoc_topics" and not d.mixture  # a mixture names its own sources
    corpus = default_corpus() if bundled or not d.tokenizer_path else None
    if bundled:
        d = dataclasses.replace(d, path=str(corpus.parent))  # its train and validation files
    return d, (tokenizer_file(d.tokenizer_path) if d.tokenizer_path
               else trained_tokenizer(corpus, d.tokenizer_vocab_size))


class Tokenizer:
    """A `tokenizers` tokenizer with the BOS/EOS the loader adds: those its tokenizer_config.json
    names when it has one beside it, else the usual spellings (titan_exp.models.tokenizer's rule,
    the one the Hugging Face export writes)."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        file = tokenizer_file(path)
        self._tok = HFTokenizer.from_file(str(file))
        self.vocab_size = self._tok.get_vocab_size()
        self.bos_id, self.eos_id = special_ids(self._tok, file)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        head = [self.bos_id] if bos and self.bos_id is not None else []
        tail = [self.eos_id] if eos and self.eos_id is not None else []
        return head + ids + tail

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)
