"""The published GPU training rows (issue 36), as benchmarks/bench_published.py and its tests read
them: `benchmarks/data/published_gpu.csv` row by row (`Row`; published_gpu.md says where each was
transcribed from), what a row publishes of its throughput (`published`), a row with the job it
was planned as (`Planned`), and what Megatron-Bridge's scripts ran for a row (`recipe`)."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "published_gpu.csv"
# What Megatron-Bridge's performance scripts ran for each of its rows, read at each release's tag
# (benchmarks/data/README.md says how): reported beside the errors (bench_published.recipe_groups),
# and priced where bench_published.ep_overlapped reads it.
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
        return "fp8" if self["dtype"] == "fp8" else self["dtype"] or "bf16"


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
        return {(r["release"], r["model"], r["gpu"], r["precision"].split()[0].rstrip("?")): r for r in csv.DictReader(f)}


def recipe(row: Row) -> dict[str, str] | None:
    """What Megatron-Bridge's scripts ran for `row` at its release's tag (None for other sources). A
    table that states FP8 without its recipe ran the FP8_CS preset, as its layout shows."""
    if row.source != "megatron_bridge":
        return None
    fp8 = row["fp8_recipe"]
    precision = ("nvfp4" if fp8 == "nvfp4" else "fp8_mx" if fp8 in ("mxfp8", "32x32_w_and_act")
                 else "bf16" if row["dtype"] == "bf16" else "fp8_cs")
    return read_recipes().get((row.table.split()[0], row["model"], row["gpu"], precision))
