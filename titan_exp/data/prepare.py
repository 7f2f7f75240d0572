"""`python -m titan_exp.data.prepare [data overrides] --out DIR [--workers N]`: tokenize a data
set once into a token store (titan_exp.data.tokens) that `data.dataset=tokens data.path=DIR`
trains from. The overrides are launch.py's (data.*, and the tokenizer it would use)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from titan_exp.config import compose_job
from titan_exp.data import tokens
from titan_exp.data.corpus import assets
from titan_exp.data.sources import TOKENS, data_file_errors, describe, hub_errors, open_dataset, source_errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_exp.data.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="launch.py overrides, e.g. data.dataset=parquet data.path=/data")
    parser.add_argument("--out", type=Path, required=True, help="the token store's folder")
    parser.add_argument("--workers", type=int, default=tokens.default_workers(), help="tokenizing processes")
    args = parser.parse_args(argv)
    d, tokenizer = assets(compose_job(args.overrides).data)
    if d.dataset == TOKENS:
        parser.error("data.dataset=tokens is already a token store; name the documents to tokenize")
    errors = source_errors(d, "data") or data_file_errors(d) or hub_errors(d, "data")
    if errors:
        print("python -m titan_exp.data.prepare: refused:\n  - " + "\n  - ".join(errors), file=sys.stderr)
        return 2
    store = tokens.prepare(iter(open_dataset(d)), d.text_field, tokenizer, args.out, workers=args.workers,
                           progress=True, source=describe(d))
    m = store.manifest
    print(f"wrote {args.out}: {m['documents']} documents, {m['tokens']} tokens ({m['dtype']}); train on it with "
          f"data.dataset=tokens data.path={args.out}"
          + (f" data.tokenizer_path={tokenizer}" if d.tokenizer_path else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
