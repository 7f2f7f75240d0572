"""Data loading per step, per rank, against the data-parallel degree: the streaming loader
(every rank tokenizes the whole global batch, so the global batch is the same in every layout)
and the token store (every rank reads its own rows of the same global batch).

    python -m benchmarks.bench_loader [--global-batch 64] [--seq-len 1024] [--steps 6]
    python -m benchmarks.bench_loader --mixture [--global-batch 8] [--seq-len 256] [--steps 30]

One rank of each degree is simulated in this process (rank 0 of dp = 1..64; the others do the
same work); the bundled corpus, its BPE, prefetch off so the work is timed, not hidden.
Prints milliseconds per step of each, and their ratio.

--mixture (issue 39): a 3:1 mixture of two sources (the corpus twice, under two labels) against
the one source, from token stores and streaming, one rank reading the whole batch (the most a
rank reads), beside a step of the debug model at that batch (fp32, this process's threads):
the mixture's extra cost per step from token stores, as a share of that step (target <= 1 %).
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

from titan_exp.config import DataConfig
from titan_exp.data.corpus import Tokenizer, default_corpus, trained_tokenizer
from titan_exp.data.loader import PackedLoader
from titan_exp.data.sources import open_dataset
from titan_exp.data.tokens import TokenLoader, prepare


def per_step_ms(make, steps: int) -> float:
    loader = make()
    loader.next_batch()  # opening the data set, the first reads
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loader.next_batch()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def model_step_ms(global_batch: int, seq_len: int, steps: int) -> float:
    """A debug-model training step (forward, backward, AdamW) at this batch, fp32, median ms."""
    import torch

    from titan_exp.config import ModelConfig
    from titan_exp.models.llama import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig())
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, ModelConfig().vocab_size, (global_batch, seq_len + 1))
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        if i:  # the first step is warm-up
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def mixture_table(args, store, source: DataConfig, tokenizer) -> None:
    from titan_exp.data.loader import build_loader
    from titan_exp.data.mixture import Mixture

    common = dict(seq_len=args.seq_len, global_batch_size=args.global_batch, local_batch_size=args.global_batch,
                  dp_rank=0, dp_degree=1, prefetch=False)
    print(f"\nglobal batch {args.global_batch} x {args.seq_len}; one rank reads it all; median of {args.steps} steps")
    print("| sources | one source ms/step | 3:1 mixture of two ms/step | mixture - one, ms |")
    print("|---|---|---|---|")
    extra = {}
    for name, opened in (("token stores", lambda: store), ("streaming", lambda: open_dataset(source))):
        one = per_step_ms(lambda: build_loader(opened(), tokenizer, text_field="text", **common), args.steps)
        mixed = per_step_ms(lambda: build_loader(Mixture(("a", "b"), (0.75, 0.25), (opened(), opened()),
                                                         ("text", "text"), 0), tokenizer, **common), args.steps)
        extra[name] = mixed - one
        print(f"| {name} | {one:.3f} | {mixed:.3f} | {mixed - one:+.3f} |")
    step = model_step_ms(args.global_batch, args.seq_len, 5)
    print(f"\ndebug-model step at {args.global_batch} x {args.seq_len} (fp32, {torch_threads()} threads): "
          f"{step:.1f} ms; the mixture's extra cost from token stores: "
          f"{100 * extra['token stores'] / step:.3f} % of it (target <= 1 %)")


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--global-batch", type=int, default=None, help="64; 8 with --mixture")
    parser.add_argument("--seq-len", type=int, default=None, help="1024; 256 with --mixture")
    parser.add_argument("--steps", type=int, default=None, help="6; 30 with --mixture")
    parser.add_argument("--mixture", action="store_true", help="a mixture against one source, beside a model step")
    args = parser.parse_args()
    defaults = (8, 256, 30) if args.mixture else (64, 1024, 6)
    args.global_batch, args.seq_len, args.steps = (v if v is not None else d for v, d in
                                                   zip((args.global_batch, args.seq_len, args.steps), defaults))
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
        if args.mixture:
            mixture_table(args, store, source, tokenizer)
            return
        print("| dp | rows per rank | streaming ms/step | token store ms/step | streaming / store |")
        print("|---|---|---|---|---|")
        for dp in (1, 2, 4, 8, 16, 32, 64):
            common = dict(seq_len=args.seq_len, global_batch_size=args.global_batch,
                          local_batch_size=args.global_batch // dp, dp_rank=0, dp_degree=dp)
            streaming = per_step_ms(lambda: PackedLoader(open_dataset(source), tokenizer, text_field="text",
                                                         prefetch=False, **common), args.steps)
            stored = per_step_ms(lambda: TokenLoader(store, **common), args.steps)
            print(f"| {dp} | {args.global_batch // dp} | {streaming:.2f} | {stored:.3f} | {streaming / stored:.0f}x |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
