"""Where documents come from: the data set a config names, opened as a stream through
`datasets` (local files need no network), and the checks on the data fields and files.
"""

from __future__ import annotations

import codecs
import glob
import json
import os

from titan_exp.config import DataConfig, JobConfig, problem

HUB_ALIASES = {"c4": ("allenai/c4", "en"), "c4_test": ("allenai/c4", "en")}


def open_dataset(cfg: DataConfig):
    """A streaming `datasets.IterableDataset` of documents; local files need no network."""
    import datasets

    if cfg.dataset in ("pydoc_topics", "json"):
        return datasets.load_dataset("json", data_files=cfg.path, split="train", streaming=True)
    if cfg.dataset == "text":
        return datasets.load_dataset(
            "text", data_files=cfg.path, split="train", streaming=True, sample_by="document"
        )
    name, subset = HUB_ALIASES.get(cfg.dataset, (cfg.dataset, None))
    return datasets.load_dataset(name, subset, split="train", streaming=True)


def check(job: JobConfig, cuda: bool) -> list[str]:
    """The fields (cheap: every rank runs it); `data_file_errors` reads the files, once, at launch."""
    e: list[str] = []
    d = job.data
    if d.dataset in ("text", "json") and not d.path:
        e.append(problem("data.path", d.path, f"data.dataset = {d.dataset!r} reads local files; give a file or glob"))
    elif d.dataset in ("text", "json") and not glob.glob(d.path):
        e.append(problem("data.path", d.path, "matches no file; check the path"))
    if d.tokenizer_path is not None and not os.path.isfile(d.tokenizer_path):
        e.append(problem("data.tokenizer_path", d.tokenizer_path, "is not a file; give a tokenizers JSON file or null"))
    if d.tokenizer_path is None and d.tokenizer_vocab_size < 258:
        e.append(problem("data.tokenizer_vocab_size", d.tokenizer_vocab_size,
                         "a byte-level BPE needs >= 258 (256 bytes + BOS/EOS)"))
    return e


HEAD_BYTES = 1 << 16


def data_file_errors(d: DataConfig) -> list[str]:
    """Local data files (data.dataset text/json) that cannot feed training: empty, not UTF-8
    text, or (json) lines that are not objects with the text field. It reads the first 64 KiB of
    every file, so the launcher's data step calls it once (`check`, which every rank and the
    planner run too, only checks that data.path matches files)."""
    e: list[str] = []
    if d.dataset not in ("text", "json") or not d.path:
        return e
    for path in sorted(glob.glob(d.path)):
        try:
            with open(path, "rb") as f:
                head = f.read(HEAD_BYTES)
        except OSError as exc:
            e.append(problem("data.path", d.path, f"{path} cannot be read ({exc.strerror})"))
            continue
        if not head.strip():
            e.append(problem("data.path", d.path, f"{path} is empty; remove it or point data.path elsewhere"))
            continue
        try:
            text = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        except UnicodeDecodeError as exc:
            text = None
            e.append(problem("data.path", d.path, f"{path} is not UTF-8 text (byte {exc.start}); is it a binary or compressed file?"))
        if text is not None and "\x00" in text:
            e.append(problem("data.path", d.path, f"{path} holds NUL bytes: a binary file, not text"))
        elif text is not None and d.dataset == "json":
            for number, line in enumerate(text.splitlines()[:-1] if len(head) == HEAD_BYTES else text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    e.append(problem("data.path", d.path, f"{path} line {number} is not JSON ({exc.msg}); json data is one object per line"))
                    break
                if not isinstance(record, dict) or not isinstance(record.get(d.text_field), str):
                    e.append(problem("data.text_field", d.text_field,
                                     f"{path} line {number} has no string field {d.text_field!r}; "
                                     "set data.text_field to the field that holds the text"))
                    break
    return e
