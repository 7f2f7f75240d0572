"""Data loading per step, per rank, against the data-parallel degree: the streaming loader
(every rank tokenizes the whole global batch, so the global batch is the same in every layout)
and the token store (every rank reads its own rows of the same global batch).

    python benchmarks/bench_loader.py [--global-batch 64] [--seq-len 1024] [--steps 6]

One rank of each degree is simulated in this process (rank 0 of dp = 1..64; the others do the
same work); the bundled corpus, its BPE, prefetch off so the work is timed, not hidden.
Prints milliseconds per step of each, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TITAN_EXP_CACHE", tempfile.mkdtemp(prefix="bench_loader_cache_"))

from titan_exp.config import DataConfig  # noqa: E402
from titan_exp.data.corpus import Tokenizer, default_corpus, trained_tokenizer  # noqa: E402
from titan_exp.data.loader import PackedLoader  # noqa: E402
from titan_exp.data.sources import open_dataset  # noqa: E402
from titan_exp.data.tokens import TokenLoader, prepare  # noqa: E402


def per_step_ms(make, steps: int) -> float:
    loader = make()
    loader.next_batch()  # opening the data set, the first reads
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loader.next_batch()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    corpus = default_corpus()
    tok_path = trained_tokenizer(corpus, 2048)
    tokenizer = Tokenizer(tok_path)
    source = DataConfig(dataset="json", path=str(corpus))
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        store = prepare(iter(open_dataset(source)), "text", tok_path, Path(folder), source={}, workers=2)
        prep_s = time.perf_counter() - start
        print(f"global batch {args.global_batch} x {args.seq_len} tokens; the store: {store.n_tokens} tokens, "
              f"prepared in {prep_s:.1f} s over 2 processes")
        print("| dp | rows per rank | streaming ms/step | token store ms/step | streaming / store |")
        print("|---|---|---|---|---|")
        for dp in (1, 2, 4, 8, 16, 32, 64):
            common = dict(seq_len=args.seq_len, global_batch_size=args.global_batch, local_batch_size=args.global_batch // dp,
                          dp_rank=0, dp_degree=dp)
            streaming = per_step_ms(lambda: PackedLoader(open_dataset(source), tokenizer, text_field="text",
                                                         prefetch=False, **common), args.steps)
            stored = per_step_ms(lambda: TokenLoader(store, **common), args.steps)
            print(f"| {dp} | {args.global_batch // dp} | {streaming:.2f} | {stored:.3f} | {streaming / stored:.0f}x |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
