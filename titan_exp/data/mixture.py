"""Data mixtures (`data.mixture`): several sources, each global batch's rows drawn by weight.

Each source is packed into its own stream of rows, as a single source is (titan_exp.data.loader;
a token store's rows are read in place). Global batch b's rows come from sources drawn
independently by weight with a generator seeded by (training.seed, b), so the batch is the same
in every layout and needs no state beyond b. A data-parallel rank keeps its rows of the batch:
from each source the run of that source's rows that falls in its slice, read from the token store
alone when the source is one (a rank reads only its rows). The position is b and each source's
own position, all global, so a run resumes exactly under any other data-parallel degree; the
rows drawn so far per source give `tokens_per_source`.

Why by hand rather than `datasets.interleave_datasets` (whose probabilities and state dict give
exact resume of one interleaved document stream): it mixes documents, so every rank would read
and tokenize every source's documents to find its rows, and a token store is not a `datasets`
stream. Mixing rows keeps a token store's O(rows per rank) reads and counts tokens exactly.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titan_exp.config import DataConfig, JobConfig, SourceConfig, ValidationConfig, problem
from titan_exp.data.prefetch import Prefetch
from titan_exp.data.sources import TOKENS, launch_errors, open_dataset, same_files, source_errors, token_store

logger = logging.getLogger(__name__)

# The data fields a mixture's sources replace: set together with data.mixture, one would be ignored.
SINGLE_SOURCE_FIELDS = ("dataset", "path", "name", "split", "text_field")
# validation.* fields that name one held-out set; a mixture's sources name theirs (validation_path).
SINGLE_VALIDATION_FIELDS = ("dataset", "path", "name")


@dataclass(frozen=True)
class Source:
    """One source of a mixture: its label, its share of the rows, and its documents as a data node."""

    label: str
    weight: float
    data: DataConfig


def label_of(s: SourceConfig) -> str:
    """The source's name in metrics: its label, else its folder's or file's stem, else the data set's name."""
    if s.label:
        return s.label
    if s.path:
        return Path(s.path.rstrip("/*")).stem or s.path
    return (s.dataset or "").replace("/", "_")


def as_data(d: DataConfig, s: SourceConfig) -> DataConfig:
    """The data node that reads source `s` (tokenizer and builder fields kept from `d`)."""
    return dataclasses.replace(d, dataset=s.dataset, path=s.path, name=s.name, split=s.split,
                               text_field=s.text_field, mixture=[])


def sources(d: DataConfig) -> list[Source]:
    """The mixture's sources, in order, each with its normalised weight."""
    total = sum(s.weight for s in d.mixture)
    return [Source(label_of(s), s.weight / total, as_data(d, s)) for s in d.mixture]


def validation_sources(d: DataConfig, v: ValidationConfig) -> list[Source]:
    """Each source's held-out set: its validation_path with the same builder, else its own
    directory's (or hub data set's) validation.split."""
    return [dataclasses.replace(src, data=dataclasses.replace(src.data, path=s.validation_path or s.path,
                                                              split=v.split))
            for s, src in zip(d.mixture, sources(d))]


def check(job: JobConfig, cuda: bool) -> list[str]:
    """A mixture's rules, and each source's fields checked as data's are (named data.mixture[i].*);
    `file_errors` reads the files, once, at launch."""
    d, defaults = job.data, DataConfig()
    if not d.mixture:
        return []
    e = _rules(job, defaults)
    if e:  # the sources themselves are not known well enough to check further
        return e
    for i, (s, v) in enumerate(zip(sources(d), validation_sources(d, job.validation))):
        e += source_errors(s.data, f"data.mixture[{i}]")
        if job.validation.enable and v.data.path != s.data.path:
            e += source_errors(v.data, f"data.mixture[{i}].validation")
        if job.validation.enable and same_files(s.data, v.data):
            e.append(problem(f"data.mixture[{i}].validation_path", d.mixture[i].validation_path,
                             f"validation would read the files training reads ({s.data.path}); give this source's "
                             "held-out files, or make its path a directory of train and validation files"))
    return e


def file_errors(job: JobConfig) -> list[str]:
    """Each source's files or hub data set, and its held-out set's, read once at launch (sources.launch_errors)."""
    held_out = validation_sources(job.data, job.validation)
    return [error for i, (s, v) in enumerate(zip(sources(job.data), held_out))
            for error in launch_errors(s.data, v.data if job.validation.enable else None, f"data.mixture[{i}]")]


def _rules(job: JobConfig, defaults: DataConfig) -> list[str]:
    d = job.data
    e = [problem(f"data.{f}", getattr(d, f), f"would be ignored: data.mixture names the sources; set this field in "
                                           f"each source (data.mixture[i].{f}) or drop data.mixture")
         for f in SINGLE_SOURCE_FIELDS if getattr(d, f) != getattr(defaults, f)]
    for i, s in enumerate(d.mixture):
        if not (math.isfinite(s.weight) and s.weight > 0):
            e.append(problem(f"data.mixture[{i}].weight", s.weight,
                             "must be a positive number: the source's share of "
                             "the rows is its weight over the sum of the weights"))
        if not s.dataset:
            e.append(problem(f"data.mixture[{i}].dataset", s.dataset,
                             "give the source's builder (json, text, parquet, "
                             "csv, arrow), tokens (a token store) or a hub id"))
        elif s.dataset == "pydoc_topics":
            e.append(problem(f"data.mixture[{i}].dataset", s.dataset, "the bundled corpus is not a mixture source; "
                                                                      "give local files or a hub data set"))
    labels = [label_of(s) for s in d.mixture]
    for i, label in enumerate(labels):
        if label in labels[:i]:
            e.append(problem(f"data.mixture[{i}].label", d.mixture[i].label,
                             f"{label!r} names source {labels.index(label)} too; give each source its own label"))
    if job.validation.enable:
        e += [problem(f"validation.{f}", getattr(job.validation, f),
                      "would be ignored: with data.mixture each source "
                      "names its held-out files (data.mixture[i].validation_path)")
              for f in SINGLE_VALIDATION_FIELDS if getattr(job.validation, f) is not None]
        e += [problem(f"data.mixture[{i}].validation_path", s.validation_path,
                      "a token store has no splits: give the held-out set's token store here")
              for i, s in enumerate(d.mixture) if s.dataset == "tokens" and not s.validation_path]
    elif any(s.validation_path for s in d.mixture):
        i = next(i for i, s in enumerate(d.mixture) if s.validation_path)
        e.append(problem(f"data.mixture[{i}].validation_path", d.mixture[i].validation_path,
                         "would be ignored: validation.enable is false; set validation.enable=true or drop it"))
    return e


def absolute(d: DataConfig) -> DataConfig:
    """The sources' paths made absolute (the ranks may start in another directory)."""
    def a(path: str | None) -> str | None:
        return os.path.abspath(os.path.expanduser(path)) if path else path

    return dataclasses.replace(d, mixture=[dataclasses.replace(s, path=a(s.path), validation_path=a(s.validation_path))
                                           for s in d.mixture])


def pretokenized(job: JobConfig, tokenizer: Path) -> JobConfig:
    """data.pretokenize with a mixture: every source not already a token store is tokenized once
    into the cache and read from there, and so are its held-out files when validation is on (a
    store gives the rows its documents would)."""
    d, v = job.data, job.validation
    mixture = []
    for s, held_out in zip(d.mixture, validation_sources(d, v)):
        if s.dataset != TOKENS:
            held_out_store = str(token_store(held_out.data, tokenizer)) if v.enable else None
            s = dataclasses.replace(s, dataset=TOKENS, path=str(token_store(as_data(d, s), tokenizer)), name=None,
                                    split="train", label=label_of(s), validation_path=held_out_store)
        mixture.append(s)
    return dataclasses.replace(job, data=dataclasses.replace(d, mixture=mixture, pretokenize=False))


def open_mixture(mix: list[Source], seed: int) -> "Mixture":
    """The sources opened (streams, or token stores), for data._target_."""
    return Mixture(tuple(s.label for s in mix), tuple(s.weight for s in mix), tuple(open_dataset(s.data) for s in mix),
                   tuple(s.data.text_field for s in mix), seed)


@dataclass(frozen=True)
class Mixture:
    """The opened sources of a mixture, which data._target_ gets as its data set."""

    labels: tuple[str, ...]
    weights: tuple[float, ...]  # normalised
    datasets: tuple[Any, ...]  # each opened by titan_exp.data.sources.open_dataset
    text_fields: tuple[str, ...]
    seed: int


def draw(seed: int, batch: int, weights: tuple[float, ...], rows: int) -> np.ndarray:
    """The source of each row of global batch `batch`: a function of (seed, batch) alone."""
    return np.random.default_rng([seed % 2**64, batch]).choice(len(weights), size=rows, p=np.asarray(weights))


class MixtureLoader:
    """This rank's rows of each global batch of a mixture; the loaders' interface (next_batch,
    state_dict, load_state_dict) and `tokens_per_source`."""

    def __init__(self, mixture: Mixture, loaders: list, *, seq_len: int, global_batch_size: int, local_batch_size: int,
                 dp_rank: int, dp_degree: int, prefetch: bool = True, **_: Any):
        """`loaders`: each source's own loader (data.loader.build_loader's), whose `take` serves its rows."""
        self.mixture, self.loaders = mixture, loaders
        self.seq_len, self.global_batch_size, self.local_batch_size = seq_len, global_batch_size, local_batch_size
        self.rows_per_rank = global_batch_size // dp_degree
        self.first = dp_rank * self.rows_per_rank  # this rank's first row of a global batch
        self.batch = 0  # global batches drawn
        self.rows = [0] * len(self.loaders)  # rows drawn from each source
        self._prefetch = Prefetch(self._cut, prefetch)
        self._state: dict[str, Any] | None = None

    def _cut(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict[str, Any]]:
        """The next batch (this rank's rows, in global order) and the position after it."""
        choice = draw(self.mixture.seed, self.batch, self.mixture.weights, self.global_batch_size)
        end = self.first + self.rows_per_rank
        mine = torch.empty(self.rows_per_rank, self.seq_len + 1, dtype=torch.long)
        for s, loader in enumerate(self.loaders):
            at = np.flatnonzero(choice == s)
            before, upto = np.searchsorted(at, self.first), np.searchsorted(at, end)
            rows = loader.take(len(at), slice(int(before), int(upto)))
            mine[torch.from_numpy(at[before:upto] - self.first)] = rows
            self.rows[s] += len(at)
        self.batch += 1
        return [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(self.local_batch_size)], self._position()

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batch, self._state = self._prefetch.next()
        return batch

    def _position(self) -> dict[str, Any]:
        return {"batch": self.batch,
                "sources": {label: {"rows": n, "position": loader.state_dict()}
                            for label, n, loader in zip(self.mixture.labels, self.rows, self.loaders)}}

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch returned (not after one being prefetched)."""
        return self._state if self._state is not None else self._position()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "sources" not in state:
            raise ValueError("the checkpoint's data position is a single source's, not a mixture's: resume it without "
                             "data.mixture, or start from its model alone (checkpoint.initial_load_model_only=true)")
        self._prefetch.drain()
        self._state = None
        self.batch = state["batch"]
        saved = state["sources"]
        for s, (label, loader) in enumerate(zip(self.mixture.labels, self.loaders)):
            if label in saved:
                self.rows[s] = saved[label]["rows"]
                loader.load_state_dict(saved[label]["position"])
            else:
                logger.warning("data: source %r is new since the checkpoint; it starts at its beginning", label)
        for label in saved.keys() - set(self.mixture.labels):
            logger.warning("data: source %r of the checkpoint is not in data.mixture any more", label)

    def tokens_per_source(self) -> dict[str, int]:
        """Tokens trained on from each source, up to the last batch returned."""
        rows = self.state_dict()["sources"]
        return {label: rows[label]["rows"] * self.seq_len for label in self.mixture.labels}
