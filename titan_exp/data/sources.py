"""Where documents come from: the data set a config names, opened as a stream through
`datasets` (local files need no network), and the checks on the data fields and files.

`data.dataset` is one of `datasets`' packaged builders for local files (json, text, parquet,
csv, arrow) reading `data.path` (a file, a glob, or a directory whose files are named by split),
the bundled corpus (pydoc_topics: a json directory with train and validation files, made at
launch), or a Hugging Face hub id (`data.name` its subset). The validation set is the same with
the `validation.*` fields laid over it (`validation_source`).
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import json
import logging
import os
import socket
from pathlib import Path
from typing import Iterator

from titan_exp.config import DataConfig, JobConfig, problem
from titan_exp.data.corpus import is_bundled

BUILDERS = ("json", "text", "parquet", "csv", "arrow")  # datasets' packaged builders for local files
TOKENS = "tokens"  # a token store (titan_exp.data.tokens)
BY_EXTENSION = {".json": "json", ".jsonl": "json", ".txt": "text", ".parquet": "parquet", ".csv": "csv",
                ".arrow": "arrow"}
LOCAL = ("pydoc_topics", *BUILDERS, TOKENS)
HUB_ALIASES = {"c4": ("allenai/c4", "en")}
HUB_HOST = "huggingface.co"

logger = logging.getLogger(__name__)


def load_arguments(cfg: DataConfig) -> tuple[tuple, dict]:
    """The arguments `datasets.load_dataset` gets for this source (streaming aside)."""
    if cfg.dataset in LOCAL:
        builder = "json" if cfg.dataset == "pydoc_topics" else cfg.dataset
        # A directory's files are split by their names; files given by name or glob are the split asked for.
        files = {"data_dir": cfg.path} if os.path.isdir(cfg.path or "") else {"data_files": {cfg.split: cfg.path}}
        extra = {"sample_by": "document"} if builder == "text" else {}  # a file is a document, not a line
        return (builder,), {**files, **extra, "split": cfg.split}
    hub_id, subset = HUB_ALIASES.get(cfg.dataset, (cfg.dataset, None))
    return (hub_id, cfg.name or subset), {"split": cfg.split}


def open_dataset(cfg: DataConfig):
    """A streaming `datasets.IterableDataset` of documents (local files need no network), or
    for data.dataset=tokens the token store, opened."""
    if cfg.dataset == TOKENS:
        from titan_exp.data.tokens import TokenStore

        return TokenStore.open(cfg.path)
    import datasets

    args, kwargs = load_arguments(cfg)
    return datasets.load_dataset(*args, streaming=True, **kwargs)


def validation_source(job: JobConfig) -> DataConfig:
    """The validation set: the data node with the validation.* fields laid over it."""
    v, d = job.validation, job.data
    return dataclasses.replace(d, dataset=v.dataset or d.dataset, path=v.path if v.path is not None else d.path,
                               name=v.name if v.name is not None else d.name, split=v.split)


def _files(path: str) -> Iterator[str]:
    if os.path.isdir(path):
        return (str(p) for p in Path(path).rglob("*") if p.is_file() and not p.name.startswith("."))
    return glob.iglob(path)


def local_files(path: str) -> list[str]:
    """The files a local path names: itself, a glob's matches, or a directory's files."""
    return sorted(_files(path))


def describe(d: DataConfig) -> dict:
    """What a token store was made from: the source's fields and, for local files, each file's
    size and time (so changed files make another store)."""
    files = ([(f, os.path.getsize(f), os.path.getmtime(f)) for f in local_files(d.path)]
             if d.dataset in LOCAL and d.path else [])
    return {"dataset": d.dataset, "path": d.path, "name": d.name, "split": d.split, "text_field": d.text_field,
            "files": files}


def source_errors(cfg: DataConfig, prefix: str) -> list[str]:
    """Fields of one source that are missing, or that would be ignored (named, with why)."""
    e: list[str] = []
    if cfg.dataset == TOKENS:
        from titan_exp.data.tokens import problem_with

        if not cfg.path or (why := problem_with(cfg.path)):
            e.append(problem(f"{prefix}.path", cfg.path,
                             f"not a token store: {why if cfg.path else 'give its folder'}"))
    if cfg.dataset in BUILDERS and not cfg.path:
        e.append(problem(f"{prefix}.path", cfg.path,
                         f"{'data' if prefix == 'validation' else prefix}.dataset = {cfg.dataset!r} "
                         "reads local files; give a file, glob or directory"))
    elif cfg.dataset in BUILDERS and next(_files(cfg.path), None) is None:  # every rank: the first file, not a listing
        e.append(problem(f"{prefix}.path", cfg.path, "matches no file; check the path"))
    if cfg.dataset not in LOCAL and cfg.path:
        e.append(problem(f"{prefix}.path", cfg.path,
                         f"would be ignored: {cfg.dataset!r} is a hub data set, which reads its own files; "
                         f"for local files set data.dataset to one of {', '.join(BUILDERS)}"))
    if cfg.dataset == "pydoc_topics" and cfg.path and not is_bundled(cfg.path):
        builder = BY_EXTENSION.get(Path(cfg.path.rstrip("/*")).suffix.lower())
        fix = (f"set data.dataset={builder} to read it (the builder its extension names)" if builder else
               f"set data.dataset to the builder that reads it ({', '.join(BUILDERS)}; {TOKENS} for a token store)")
        e.append(problem(f"{prefix}.path", cfg.path, f"would be ignored: data.dataset = 'pydoc_topics' (the default) "
                                                     f"is the bundled corpus; {fix}"))
    if cfg.dataset in LOCAL and cfg.name:
        e.append(problem(f"{prefix}.name", cfg.name, f"would be ignored: local files ({cfg.dataset}) have no subsets; "
                                                     "name is for hub data sets"))
    if cfg.dataset == "text" and cfg.text_field != "text":
        e.append(problem("data.text_field", cfg.text_field,
                         "would be ignored: the text builder's field is always 'text'"))
    return e


def same_files(train: DataConfig, held_out: DataConfig) -> bool:
    """Whether the held-out set would read the very files training reads (a directory's splits
    are other files; a token store has no splits)."""
    return held_out.path == train.path and (held_out.dataset == TOKENS or (held_out.dataset in BUILDERS
                                                                           and not os.path.isdir(held_out.path or "")))


def check(job: JobConfig, cuda: bool) -> list[str]:
    """The fields (cheap: every rank runs it); `data_file_errors` reads the files, once, at launch."""
    d = job.data
    e = [] if d.mixture else source_errors(d, "data")  # a mixture's sources: titan_exp.data.mixture.check
    if job.validation.enable and not d.mixture:
        v = validation_source(job)
        e += [x for x in source_errors(v, "validation") if x not in e]
        if same_files(d, v):
            e.append(problem("validation.path", job.validation.path,
                             f"validation would read data.path ({d.path}), the files training reads; give held-out "
                             "files in validation.path, or make data.path a directory of train and validation files"))
    if d.tokenizer_path is not None and not (os.path.isfile(d.tokenizer_path)
                                             or os.path.isfile(os.path.join(d.tokenizer_path, "tokenizer.json"))):
        e.append(problem("data.tokenizer_path", d.tokenizer_path,
                         "is neither a tokenizer.json file nor a directory holding one; give one of those, or null"))
    if d.tokenizer_path is None and d.tokenizer_vocab_size < 258:
        e.append(problem("data.tokenizer_vocab_size", d.tokenizer_vocab_size,
                         "a byte-level BPE needs >= 258 (256 bytes + BOS/EOS)"))
    return e


def hub_errors(cfg: DataConfig, prefix: str) -> list[str]:
    """A hub data set, asked about once at launch: that it exists with this subset and split,
    and has the text field. Without a network it says so at once (offline mode reads the cache)."""
    if cfg.dataset in LOCAL:
        return []
    hub_id, subset = HUB_ALIASES.get(cfg.dataset, (cfg.dataset, None))
    offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes")
                  for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))
    if not offline:
        try:
            socket.getaddrinfo(HUB_HOST, 443)
        except OSError as exc:
            return [problem(f"{prefix}.dataset", cfg.dataset,
                            f"is a hub data set and {HUB_HOST} cannot be reached from here ({exc.strerror or exc}); "
                            "run where there is a network, set HF_DATASETS_OFFLINE=1 to use a cached copy, or train "
                            f"on local files (data.dataset={'|'.join(BUILDERS)} data.path=...)")]
    import datasets

    try:
        info = datasets.load_dataset_builder(hub_id, cfg.name or subset).info
    except Exception as exc:  # noqa: BLE001 - the hub's own reason, whatever it is
        return [problem(f"{prefix}.dataset", cfg.dataset,
                        f"cannot be opened ({type(exc).__name__}: {str(exc).splitlines()[0]})")]
    e = []
    if info.splits and cfg.split not in info.splits:
        e.append(problem(f"{prefix}.split", cfg.split,
                         f"is not a split of {hub_id}; choose from {', '.join(info.splits)}"))
    if info.features and cfg.text_field not in info.features:
        e.append(problem("data.text_field", cfg.text_field,
                         f"{hub_id} has no such field; choose from {', '.join(info.features)}"))
    return e


def token_store(d: DataConfig, tokenizer: Path) -> Path:
    """The cache's token store of source `d` (keyed by the data, its files' sizes and times, and
    the tokenizer), tokenized into it the first time it is asked for."""
    from titan_exp.cache import cache_dir
    from titan_exp.data import tokens

    source = describe(d)
    folder = cache_dir() / "tokens" / tokens.cache_key(source, tokenizer)
    if tokens.problem_with(folder) is None:
        logger.info("data: the token store %s of %s %s is ready", folder, d.dataset, d.path or d.name or "")
    else:
        logger.info("data: tokenizing %s %s once into %s", d.dataset, d.path or d.name or "", folder)
        tokens.prepare(iter(open_dataset(d)), d.text_field, tokenizer, folder, source=source,
                       workers=tokens.default_workers(), progress=True)
    return folder


def pretokenized(job: JobConfig, tokenizer: Path) -> JobConfig:
    """data.pretokenize: the job reading a token store of its data, made once into the cache.
    Validation keeps reading the documents (its own fields pinned to what data's were)."""
    d = job.data
    if d.dataset == TOKENS:
        return job
    folder = token_store(d, tokenizer)
    held_out = validation_source(job)  # pinned before data's fields change
    validation = dataclasses.replace(job.validation, dataset=held_out.dataset, path=held_out.path, name=held_out.name)
    return dataclasses.replace(job, data=dataclasses.replace(d, dataset=TOKENS, path=str(folder), pretokenize=False),
                               validation=validation)


def launch_errors(d: DataConfig, held_out: DataConfig | None, prefix: str = "data") -> list[str]:
    """What the launcher reads once of a source (`prefix` names it): its files or its hub data set,
    and the same of its held-out set (None: validation is off)."""
    hub = hub_errors(d, prefix)
    e = data_file_errors(d, prefix) + hub
    if held_out is not None:
        where = "validation" if prefix == "data" else f"{prefix}.validation"
        same_hub = hub and held_out.dataset == d.dataset  # already said: unreachable, or no such data set
        e += data_file_errors(held_out, where) + ([] if same_hub else hub_errors(held_out, where))
    return e


HEAD_BYTES = 1 << 16


def store_errors(d: DataConfig, tokenizer: Path, vocab_size: int) -> list[str]:
    """A token store made with another tokenizer, or a vocabulary the model cannot hold."""
    from titan_exp.data.tokens import TokenStore, file_sha, problem_with

    if d.dataset != TOKENS or problem_with(d.path):
        return []
    manifest = TokenStore.open(d.path).manifest
    e = []
    if manifest["tokenizer_sha"] != file_sha(tokenizer):
        e.append(problem("data.tokenizer_path", d.tokenizer_path, f"is not the tokenizer {d.path} was prepared with "
                                                                  f"(sha {manifest['tokenizer_sha']}); give that one"))
    if manifest["vocab_size"] > vocab_size:
        e.append(problem("model.vocab_size", vocab_size,
                         f"smaller than the token store's vocabulary ({manifest['vocab_size']})"))
    return e


def data_file_errors(d: DataConfig, prefix: str = "data") -> list[str]:
    """Local data files that cannot feed training: empty, not UTF-8 text, or (json) lines that
    are not objects with the text field, read from the first 64 KiB of every named file; then,
    for every builder and directory, the first record as `datasets` reads it must have the text
    field. The launcher's data step calls it once (`check`, which every rank and the planner run
    too, only checks that the path matches files)."""
    if d.dataset not in BUILDERS or not d.path:
        return []
    e = _text_file_errors(d, prefix) if d.dataset in ("text", "json") and not os.path.isdir(d.path) else []
    return e or _first_record_errors(d, prefix)


def _first_record_errors(d: DataConfig, prefix: str) -> list[str]:
    try:
        record = next(iter(open_dataset(d)))
    except StopIteration:
        return [problem(f"{prefix}.path", d.path, f"holds no records for split {d.split!r}")]
    except Exception as exc:  # noqa: BLE001 - datasets' own reason, whatever the format's reader raised
        return [problem(f"{prefix}.path", d.path,
                        f"cannot be read as {d.dataset} split {d.split!r} "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")]
    if not isinstance(record.get(d.text_field), str):
        return [problem("data.text_field", d.text_field, f"the records of {d.path} have no string field "
                                                         f"{d.text_field!r}; choose from {', '.join(record)}")]
    return []


def _text_file_errors(d: DataConfig, prefix: str) -> list[str]:
    e: list[str] = []
    for path in local_files(d.path):
        try:
            with open(path, "rb") as f:
                head = f.read(HEAD_BYTES)
        except OSError as exc:
            e.append(problem(f"{prefix}.path", d.path, f"{path} cannot be read ({exc.strerror})"))
            continue
        if not head.strip():
            e.append(problem(f"{prefix}.path", d.path, f"{path} is empty; remove it or point data.path elsewhere"))
            continue
        try:
            text = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        except UnicodeDecodeError as exc:
            text = None
            e.append(problem(f"{prefix}.path", d.path,
                             f"{path} is not UTF-8 text (byte {exc.start}); is it a binary or compressed file?"))
        if text is not None and "\x00" in text:
            e.append(problem(f"{prefix}.path", d.path, f"{path} holds NUL bytes: a binary file, not text"))
        elif text is not None and d.dataset == "json":
            for number, line in enumerate(text.splitlines()[:-1] if len(head) == HEAD_BYTES else text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    e.append(problem(f"{prefix}.path", d.path,
                                     f"{path} line {number} is not JSON ({exc.msg}); json data is one object per line"))
                    break
                if not isinstance(record, dict) or not isinstance(record.get(d.text_field), str):
                    e.append(problem("data.text_field", d.text_field,
                                     f"{path} line {number} has no string field {d.text_field!r}; "
                                     "set data.text_field to the field that holds the text"))
                    break
    return e
