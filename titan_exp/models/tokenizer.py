"""A tokenizer's files and its BOS/EOS, one rule for training (titan_exp.data.corpus.Tokenizer)
and the Hugging Face export (titan_exp.models.hf): the tokenizer.json a path names, and the special
tokens its tokenizer_config.json names, else the usual spellings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tokenizers

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"  # the bundled BPE's (and Llama 3's)
TOKENIZER_FILE, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
# Tried in order after the spelling tokenizer_config.json names.
BOS_SPELLINGS = ("<s>", "[BOS]", BOS)
EOS_SPELLINGS = ("</s>", "[EOS]", "<|endoftext|>", EOS)


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json a `data.tokenizer_path` names: the file, or the one in a directory
    (the Hugging Face / Llama 3 layout)."""
    path = Path(path)
    return path / TOKENIZER_FILE if path.is_dir() else path


def named_specials(config: Path) -> dict[str, str]:
    """BOS/EOS as a Hugging Face tokenizer_config.json names them (a string, or {"content": ...})."""
    if not config.is_file():
        return {}
    raw = json.loads(config.read_text())
    names = {}
    for key in ("bos", "eos"):
        token = raw.get(f"{key}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            names[key] = token
    return names


def special_ids(tok: tokenizers.Tokenizer, file: Path) -> tuple[int | None, int | None]:
    """The ids of BOS and EOS in `tok` (read from `file`): those the tokenizer_config.json beside
    the file names, else the first usual spelling the vocabulary has; None where it has none."""
    named = named_specials(file.parent / TOKENIZER_CONFIG)

    def first(spellings: tuple[str, ...]) -> int | None:
        return next((i for s in spellings if (i := tok.token_to_id(s)) is not None), None)

    return first((named.get("bos", BOS), *BOS_SPELLINGS)), first((named.get("eos", EOS), *EOS_SPELLINGS))
