"""Optional dependencies: which pip extra brings each one, and the message when it is missing.

The core install trains, sweeps and reports; wandb, TensorBoard, the notebook's pandas, lm-eval and
transformers (which writes a Hugging Face export's tokenizer) come with `pip install 'titan_exp[wandb]'`,
`[tensorboard]`, `[notebooks]`, `[eval]`, `[hf]` (or `[all]`). A config that asks for one that is not
installed fails at validation, before anything starts.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

EXTRA_OF = {"wandb": "wandb", "tensorboard": "tensorboard", "pandas": "notebooks", "lm_eval": "eval",
            "transformers": "hf"}


def missing(module: str) -> str | None:
    """What to install when `module` is not importable, else None (nothing is imported)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module blocked in sys.modules
        found = False
    return None if found else f"{module} is not installed; pip install 'titan_exp[{EXTRA_OF[module]}]'"


def require(module: str, feature: str) -> ModuleType:
    """`module`, imported, or an ImportError that says which extra brings it."""
    if (why := missing(module)) is not None:
        raise ImportError(f"{feature}: {why}")
    return importlib.import_module(module)
