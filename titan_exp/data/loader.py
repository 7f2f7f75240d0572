"""A resumable loader of packed token sequences, sharded by data-parallel rank.

Documents are tokenized as BOS + text + EOS, concatenated, and cut into rows of seq_len + 1
tokens (inputs are the first seq_len, labels the last seq_len). Each optimizer step consumes
`global_batch_size` consecutive rows of that one stream; data-parallel rank r keeps rows
[r * G/dp, (r+1) * G/dp) and splits them into gradient-accumulation microbatches.

Why every rank reads the whole stream rather than every dp-th document: the global batch is then
the same for every layout (1 rank, FSDP 2, HSDP 2x2, ...), so losses are comparable across
layouts to float tolerance, and a checkpoint can resume under another data-parallel degree
without skipping or repeating data. The cost is dp-fold tokenization; a token store
(titan_exp.data.tokens, `data.pretokenize=true`) gives the same batches at O(rows per rank).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Iterator

import torch

from titan_exp.config import JobConfig, problem
from titan_exp.data.corpus import Tokenizer
from titan_exp.data.mixture import Mixture, MixtureLoader
from titan_exp.data.prefetch import Prefetch
from titan_exp.data.tokens import TokenLoader, TokenStore
from titan_exp.parallel.dims import ParallelDims

logger = logging.getLogger(__name__)


def check_batch(job: JobConfig, dims: ParallelDims, cuda: bool) -> list[str]:
    """The global batch splits evenly into local batches over the data-parallel ranks."""
    t = job.training
    gbs = job.global_batch_at(dims.world_size)
    if gbs < 1:
        return [problem("training.global_batch_size", t.global_batch_size,
                        "must be >= 1, or -1 for local_batch_size x dp")]
    if gbs % (t.local_batch_size * dims.dp):
        return [problem("training.global_batch_size", gbs,
                        f"must be a multiple of local_batch_size x dp = {t.local_batch_size} x {dims.dp}; "
                        "the quotient is the number of gradient accumulation steps")]
    return []


def build_loader(dataset, tokenizer: Tokenizer, **kwargs: Any):
    """data._target_'s default: a TokenLoader for a token store (data.dataset=tokens), a
    MixtureLoader for a mixture (data.mixture), else a PackedLoader that tokenizes the documents as
    it goes. A token store's loader and a PackedLoader of the same documents give the same batches."""
    if isinstance(dataset, TokenStore):
        return TokenLoader(dataset, **kwargs)
    if isinstance(dataset, Mixture):
        each = [build_loader(ds, tokenizer, **{**kwargs, "text_field": field, "prefetch": False})
                for ds, field in zip(dataset.datasets, dataset.text_fields)]
        return MixtureLoader(dataset, each, **kwargs)
    return PackedLoader(dataset, tokenizer, **kwargs)


class PackedLoader:
    def __init__(
        self,
        dataset,
        tokenizer: Tokenizer,
        *,
        text_field: str,
        seq_len: int,
        global_batch_size: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        prefetch: bool = True,
    ):
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.text_field = text_field
        self.seq_len = seq_len
        self.rows_per_rank = global_batch_size // dp_degree
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        # Position: the dataset's own iteration state, the pass over it, and the tokens already
        # read but not yet cut into a row. Together they make resumption exact.
        self.epoch = 0
        self.buffer: list[int] = []
        self._docs: Iterator[dict] | None = None
        self._loaded: dict | None = None  # the dataset state last loaded, until a document is read
        # Prefetch: the next batch is cut (documents read and tokenized) by a background thread
        # while the step runs; the position handed out is the one after the batch returned.
        self._prefetch = Prefetch(self._cut, prefetch)
        self._state: dict[str, Any] | None = None

    def _next_doc(self) -> dict:
        if self._docs is None:
            self._docs = iter(self.dataset)
            self._loaded = None  # from here on the dataset reports its own position
        try:
            return next(self._docs)
        except StopIteration:
            self.epoch += 1
            logger.info("data: starting pass %d over the data set", self.epoch)
            self.dataset.set_epoch(self.epoch)
            self._docs = iter(self.dataset)
            return next(self._docs)

    def _rows(self, n: int) -> torch.Tensor:
        row = self.seq_len + 1
        while len(self.buffer) < n * row:
            text = self._next_doc()[self.text_field]
            self.buffer.extend(self.tokenizer.encode(text, bos=True, eos=True))
        out = torch.tensor(self.buffer[: n * row], dtype=torch.long).view(n, row)
        del self.buffer[: n * row]
        return out

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of the next global batch, as (inputs, labels) microbatches."""
        batch, self._state = self._prefetch.next()
        return batch

    def take(self, n: int, keep: slice) -> torch.Tensor:
        """Rows `keep` of the stream's next `n` rows (each seq_len + 1 tokens); the position moves by n."""
        return self._rows(n)[keep]

    def _cut(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict[str, Any]]:
        """The next batch and the position after it."""
        mine = self.take(self.global_batch_size,
                         slice(self.dp_rank * self.rows_per_rank, (self.dp_rank + 1) * self.rows_per_rank))
        return [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(self.local_batch_size)], self._position()

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch returned (not after one being prefetched)."""
        return self._state if self._state is not None else self._position()

    def _position(self) -> dict[str, Any]:
        # Between load_state_dict and the first document read after it, a datasets
        # IterableDataset reports its initial state, not the loaded one; steps served from the
        # buffer alone read no document, so the loaded state is what is still true.
        dataset = self._loaded if self._loaded is not None else self.dataset.state_dict()
        # A copy: the prefetching thread moves on while this position waits for a checkpoint.
        return {"dataset": copy.deepcopy(dataset), "epoch": self.epoch, "buffer": list(self.buffer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._prefetch.drain()
        self._state = None
        self.epoch = state["epoch"]
        self.buffer = list(state["buffer"])
        self.dataset.set_epoch(self.epoch)
        self.dataset.load_state_dict(state["dataset"])
        self._docs = None
        self._loaded = state["dataset"]
