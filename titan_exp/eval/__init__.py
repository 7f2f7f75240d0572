"""Downstream evaluation with lm-evaluation-harness on exported checkpoints (`eval.*`,
`pip install 'titan_exp[eval]'`).

Every `eval.freq` steps and at the last step every rank writes the model (DCP, model only) and rank
0 starts `python -m titan_exp.eval`, a process of its own, which turns it into a Hugging Face
Llama directory and scores it with lm-eval while training goes on:

    <run dir>/eval/checkpoints/step-N/   the model at step N as DCP wrote it; removed once exported
    <run dir>/eval/step-N/               that model for transformers: config.json, model.safetensors,
                                         tokenizer.json, tokenizer_config.json (lm-eval's `hf` model)
    <run dir>/eval/step-N/results.json   {"eval": {task: {metric: value}}, "lm_eval": lm-eval's record}
    <run dir>/eval/step-N/eval.log       the evaluator's output

Modules: `tasks` (which tasks exist, and lm-eval's results as {task: {metric: value}}),
`evaluator` (the separate process), `runner` (the trainer's side: snapshot, start, poll, await).
"""

from __future__ import annotations

import re
from pathlib import Path

from titan_exp import extras
from titan_exp.config import JobConfig, problem
from titan_exp.models import hf

DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def check(job: JobConfig, cuda: bool) -> list[str]:
    """The eval fields' rules (which tasks exist is the launcher's `evaluation` preflight step:
    looking them up reads lm-eval's task index, seconds a rank need not spend)."""
    ev = job.eval
    if not ev.enable:
        if ev.tasks:
            return [problem("eval.tasks", list(ev.tasks), "set while eval.enable is false, so nothing would "
                            "evaluate them; set eval.enable=true, or leave eval.tasks out")]
        return []
    e: list[str] = []
    if why := extras.missing("lm_eval"):
        e.append(problem("eval.enable", True, f"{why}; or set it to false"))
    if not ev.tasks:
        e.append(problem("eval.tasks", [], "name at least one lm-eval task, e.g. eval.tasks=[hellaswag], or one of "
                         "your own with eval.include_path"))
    if ev.include_path is not None and not Path(ev.include_path).expanduser().is_dir():
        e.append(problem("eval.include_path", ev.include_path, "not a directory; give the directory that holds your "
                         "task YAMLs"))
    if ev.limit is not None and ev.limit < 1:
        e.append(problem("eval.limit", ev.limit, "must be >= 1 (documents per task), or null for all"))
    if ev.device is not None and not DEVICE.match(ev.device):
        e.append(problem("eval.device", ev.device, "choose cpu, cuda or cuda:N, or null for rank 0's device"))
    elif ev.device is not None and ev.device.startswith("cuda") and not cuda:
        e.append(problem("eval.device", ev.device, "this machine has no GPU; use cpu, or null"))
    if what := hf.unsupported(job.model):
        e.append(problem("eval.enable", True, "lm-eval loads the model from its Hugging Face export, which "
                         f"cannot be written for {what}; set it to false"))
    return e
