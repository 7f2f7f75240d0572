"""The GPU cost model against published GPU training measurements, leave-one-source-out.

    python -m benchmarks.published [--rows] [--source torchtitan] [--record DATE]
    python -m benchmarks.published.torchtitan

The rows are benchmarks/data/published_gpu.csv (published_gpu.md says where each was transcribed
from): TorchTitan's Llama 3.1 tables, Megatron-Bridge's performance summary, LLM Foundry's MPT
tables and Megatron-LM's scaling table. Each row becomes the job it describes (jobs.py; what a
source leaves unstated is an assumption named there), is planned on its GPU's spec sheet and
predicted as its source's engine ran it (engines.py, megatron.py). One constant is fitted
(fit.py: compute_scale) on a fitting set declared before any score was seen; each source's rows
are predicted with the constant fitted on the other sources' rows (report.py), scored by table,
by pairs of layouts on one machine and by each technique's published effect (scoring.py).
Rows the model was later changed for leave every score (fit.MOVED_TO_FIT, each with its reason);
rows first planned after a change are held out by declaration. torchtitan.py sets TorchTitan's
H100 tables, memory included, beside the planner. BENCHMARKS.md shows the latest output.
"""
