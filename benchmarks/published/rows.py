"""The published GPU training rows (issue 36), as benchmarks/published and its tests read
them: `benchmarks/data/published_gpu.csv` row by row (`Row`; published_gpu.md says where each was
transcribed from), what a row publishes of its throughput (`published`), a row with the job it
was planned as (`Planned`), and what Megatron-Bridge's scripts ran for a row (`recipe`)."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data" / "published_gpu.csv"
# What Megatron-Bridge's performance scripts ran for each of its rows, read at each release's tag
# (benchmarks/data/README.md says how): reported beside the errors (report.recipe_groups),
# and priced where predict.ep_overlapped reads it.
RECIPES = DATA.with_name("published_recipes.csv")


@dataclass
class Row:
    source: str
    table: str
    label: str
    cells: dict[str, str]  # the CSV row, as read

    def __getitem__(self, key: str) -> str:
        return self.cells[key]

    @property
    def key(self) -> str:
        return f"{self.source} | {self.table[:60]} | {self.label}"

    def num(self, key: str, default: float | None = None) -> float | None:
        value = self[key]
        return float(value) if value not in ("", None) else default

    @property
    def precision(self) -> str:
        """bf16, fp8 or fp4 (`scaling`'s kind)."""
        kind = scaling(self)
        return "bf16" if kind == "bf16" else "fp4" if kind == "nvfp4" else "fp8"


def known_regression(row: Row) -> bool:
    """Whether the row's source footnotes it as a known performance regression (its note says so)."""
    return "known performance regression" in row["note"]


def read_rows() -> list[Row]:
    with DATA.open() as f:
        return [Row(r["source"], r["table"], r["row_label"], r) for r in csv.DictReader(f)]


@dataclass
class Planned:
    row: Row
    job: object | None
    why_not: str | None


def published(row: Row) -> tuple[str, float]:
    """What a row publishes of its throughput: tokens/s/GPU, else MFU (a share of the bf16 peak)."""
    if row["tokens_per_s_per_gpu"]:
        return "tokens/s", float(row["tokens_per_s_per_gpu"])
    if row["mfu"]:
        return "mfu", float(row["mfu"]) / 100
    return "tflops", float(row["tflops_per_gpu"])


@lru_cache(maxsize=None)
def read_recipes() -> dict[tuple[str, str, str, str], dict[str, str]]:
    """RECIPES by (release, model, GPU, precision: bf16, fp8_cs, fp8_mx or nvfp4; a "?" in the file
    marks a precision its table leaves unstated, read from its layout)."""
    with RECIPES.open() as f:
        return {(r["release"], r["model"], r["gpu"], r["precision"].split()[0].rstrip("?")): r
                for r in csv.DictReader(f)}


# A row's float8 recipe as the data set writes it -> as Megatron-Bridge's recipes name it. Its 25.09
# tables print the footnote's granularity in place of a recipe for their values in parentheses:
# "32x32" (GB200, B200) the MXFP8 blocks their recipes at v0.1.0rc3 ran (an fp8_mx block), "128x128
# weights, 1x128 activations" (H100) DeepSeek's blockwise scaling (RECIPES, benchmarks/data/README.md).
SCALINGS = {"nvfp4": "nvfp4", "mxfp8": "fp8_mx", "32x32_w_and_act": "fp8_mx", "128x128_w_1x128_act": "fp8_blockwise"}


def scaling(row: Row) -> str:
    """A row's precision as Megatron-Bridge's recipes name them: bf16, fp8_cs (per-tensor current
    scaling, and a bare "FP8": the FP8_CS preset, as its layout shows), fp8_mx, fp8_blockwise or
    nvfp4. A Megatron-Bridge table that states no precision (25.09's) ran FP8: its footnote sets the
    values in parentheses apart by their finer scaling granularity, and its recipes at v0.1.0rc3 hold
    every one of its layouts under fp8_cs and fp8_mx (RECIPES; its rc3 scripts' default, delayed
    scaling, is per-tensor as well, priced here as current scaling). Another source's unstated
    precision (Megatron-LM's README) is bf16."""
    fp8 = row["fp8_recipe"]
    if fp8 in SCALINGS:
        return SCALINGS[fp8]
    return "bf16" if row["dtype"] == "bf16" or not (row["dtype"] or row.source == "megatron_bridge") else "fp8_cs"


def recipe(row: Row) -> dict[str, str] | None:
    """What Megatron-Bridge's scripts ran for `row` at its release's tag (None for other sources)."""
    if row.source != "megatron_bridge":
        return None
    return read_recipes().get((row.table.split()[0], row["model"], row["gpu"], scaling(row)))
