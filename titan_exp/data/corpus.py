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
from titan_exp.files import atomic_write

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def default_corpus() -> Path:
    """The documentation topics as one JSON document per line, in a fixed shuffled order."""
    from pydoc_data.topics import topics

    docs = [{"title": k, "text": v} for k, v in sorted(topics.items())]
    random.Random(0).shuffle(docs)
    payload = "".join(json.dumps(d) + "\n" for d in docs)
    path = cache_dir() / f"pydoc_topics-{_digest(payload)}.jsonl"
    if not path.exists():
        atomic_write(path, payload)
    return path


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


class Tokenizer:
    """A `tokenizers` tokenizer with the BOS/EOS conventions the loader needs."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        self.bos_id = self._special(BOS, ("<s>", "[BOS]"))
        self.eos_id = self._special(EOS, ("</s>", "[EOS]", "<|endoftext|>"))

    def _special(self, name: str, fallbacks: tuple[str, ...]) -> int | None:
        for candidate in (name, *fallbacks):
            token_id = self._tok.token_to_id(candidate)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        head = [self.bos_id] if bos and self.bos_id is not None else []
        tail = [self.eos_id] if eos and self.eos_id is not None else []
        return head + ids + tail

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)
