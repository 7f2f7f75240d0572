"""A pre-tokenized token store: the documents tokenized once, into one flat file of token ids
that every rank reads at only its own rows.

    python -m titan_exp.data.prepare [data overrides] --out DIR [--workers N]
    python launch.py data.dataset=tokens data.path=DIR
    python launch.py data.pretokenize=true ...      # prepared once into the cache, keyed by data and tokenizer

    DIR/tokens.bin      every document as BOS + ids + EOS, back to back (uint16 when the vocabulary fits, else uint32)
    DIR/docs.bin        the index: uint64 offset of each document's first token
    DIR/manifest.json   what it was made from (source, tokenizer hash), dtype and counts; written last

The stream is the one PackedLoader builds from the same documents, so a run gets the same
batches from either. Row r of the stream is tokens [r (L+1), (r+1)(L+1)) of the file repeated
end to end (a pass ends mid-row, as the streaming loader's buffer carries over), so the global
batch is the same in every layout. A rank reads only its rows of each global batch from the
memory-mapped file: its data work is O(rows per rank) whatever the data-parallel degree, and
its position is one integer, the next global row, which resumes under any other degree.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from titan_exp.files import atomic_write

TOKENS_FILE, DOCS_FILE, MANIFEST_FILE = "tokens.bin", "docs.bin", "manifest.json"
FORMAT = 1


def file_sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


@dataclass(frozen=True)
class TokenStore:
    """A prepared folder, opened (memory-mapped, nothing read yet)."""

    folder: Path
    manifest: dict[str, Any]

    @classmethod
    def open(cls, folder: str | Path) -> "TokenStore":
        folder = Path(folder)
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
        return cls(folder, manifest)

    @property
    def tokens(self) -> np.ndarray:
        return np.memmap(self.folder / TOKENS_FILE, dtype=self.manifest["dtype"], mode="r")

    @property
    def n_tokens(self) -> int:
        return self.manifest["tokens"]


def problem_with(folder: str | Path) -> str | None:
    """Why `folder` is not a complete token store, or None."""
    folder = Path(folder)
    if not (folder / MANIFEST_FILE).is_file():
        return (f"no {MANIFEST_FILE} there (a store being written, or not a store: "
                "python -m titan_exp.data.prepare makes one)")
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    if manifest.get("format") != FORMAT:
        return f"its format {manifest.get('format')} is not {FORMAT}; prepare it again"
    size = (folder / TOKENS_FILE).stat().st_size if (folder / TOKENS_FILE).is_file() else -1
    if size != manifest["tokens"] * np.dtype(manifest["dtype"]).itemsize:
        return (f"{TOKENS_FILE} holds {size} bytes, not the {manifest['tokens']} tokens its manifest lists; "
                "prepare it again")
    if manifest["tokens"] < 2:
        return "it holds fewer than 2 tokens"
    return None


# Preparing.

_worker_tokenizer = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    from titan_exp.data.corpus import Tokenizer

    _worker_tokenizer = Tokenizer(tokenizer_path)


def _encode(texts: list[str]) -> list[list[int]]:
    return [_worker_tokenizer.encode(t, bos=True, eos=True) for t in texts]


def _chunks(docs: Iterator[dict], text_field: str, size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for doc in docs:
        chunk.append(doc[text_field])
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def prepare(docs: Iterator[dict], text_field: str, tokenizer_path: str | Path, out: str | Path, *,
            source: dict[str, Any], workers: int = 1, progress: bool = False, chunk: int = 64) -> TokenStore:
    """Tokenize `docs` (in order, over `workers` processes) into a token store at `out`. The
    manifest is written last, so a folder without one is never taken as a store."""
    import multiprocessing

    from titan_exp.data.corpus import Tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_FILE).unlink(missing_ok=True)
    vocab = Tokenizer(tokenizer_path).vocab_size
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32
    n_tokens, offsets = 0, []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(unit=" docs", desc=f"tokenizing into {out}")
    pool = (multiprocessing.get_context("fork").Pool(workers, _init_worker, (str(tokenizer_path),)) if workers > 1
            else None)
    if pool is None:
        _init_worker(str(tokenizer_path))
    try:
        encoded = (pool.imap(_encode, _chunks(docs, text_field, chunk)) if pool is not None
                   else map(_encode, _chunks(docs, text_field, chunk)))
        with open(out / TOKENS_FILE, "wb") as f:
            for batch in encoded:
                for ids in batch:
                    offsets.append(n_tokens)
                    f.write(np.asarray(ids, dtype=dtype).tobytes())
                    n_tokens += len(ids)
                if bar is not None:
                    bar.update(len(batch))
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        if bar is not None:
            bar.close()
    np.asarray(offsets, dtype=np.uint64).tofile(out / DOCS_FILE)
    manifest = {"format": FORMAT, "source": source, "tokenizer_sha": file_sha(Path(tokenizer_path)),
                "vocab_size": vocab, "dtype": np.dtype(dtype).name, "tokens": n_tokens, "documents": len(offsets)}
    atomic_write(out / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")
    return TokenStore.open(out)


# Reading.

class TokenLoader:
    """This rank's rows of each global batch, read from a token store; PackedLoader's interface
    (next_batch, state_dict, load_state_dict)."""

    def __init__(self, store: TokenStore, *, seq_len: int, global_batch_size: int, local_batch_size: int,
                 dp_rank: int, dp_degree: int, **_: Any):
        self.store, self.tokens, self.n = store, store.tokens, store.n_tokens
        self.row_len = seq_len + 1
        self.global_batch_size = global_batch_size
        self.rows_per_rank = global_batch_size // dp_degree
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.row = 0  # the next global batch's first row

    def _span(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the file repeated end to end."""
        start %= self.n
        if start + length <= self.n:
            return self.tokens[start:start + length]
        return np.take(self.tokens, np.arange(start, start + length) % self.n)

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        first = self.dp_rank * self.rows_per_rank
        rows = self.take(self.global_batch_size, slice(first, first + self.rows_per_rank))
        return [(mb[:, :-1], mb[:, 1:]) for mb in rows.split(self.local_batch_size)]

    def take(self, n: int, keep: slice) -> torch.Tensor:
        """Rows `keep` of the next `n` global rows, read alone; the position moves by n."""
        span = self._span((self.row + keep.start) * self.row_len, (keep.stop - keep.start) * self.row_len)
        self.row += n
        return torch.from_numpy(span.astype(np.int64)).view(keep.stop - keep.start, self.row_len)

    def state_dict(self) -> dict[str, Any]:
        return {"row": self.row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.row = int(state["row"])


def cache_key(source: dict[str, Any], tokenizer_path: str | Path) -> str:
    """The cache folder name of the store `data.pretokenize` makes for this source and tokenizer."""
    blob = json.dumps(source, sort_keys=True) + file_sha(Path(tokenizer_path))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_workers() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0))
