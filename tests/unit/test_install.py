"""The installed tool: a wheel built from this checkout, installed into a fresh virtual
environment, runs `titan-exp` from a directory with no checkout in it; optional extras say what
to install when missing; the commands the docs name exist."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from conftest import REPO, SMALL, job_config

from titan_exp.validation import validate


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A venv holding titan_exp from its wheel. For torch and the other dependencies, which are not
    what is under test and are too big to install again, it sees the site-packages of the
    interpreter running the tests (a .pth file naming them: the outer virtual environment's when
    the suite runs in one, which --system-site-packages would skip for the base interpreter's), so
    the wheel goes in with --no-deps. A .pth file names directories without running theirs, so an
    editable install of the checkout there stays out of sight."""
    root = tmp_path_factory.mktemp("install")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(root / "dist"), str(REPO)], check=True, capture_output=True, timeout=300)
    wheel = next((root / "dist").glob("titan_exp-*.whl"))
    venv.EnvBuilder(with_pip=False).create(root / "venv")
    bin_dir = root / "venv" / "bin"
    purelib = subprocess.run([str(bin_dir / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    outer = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    (Path(purelib) / "outer_site_packages.pth").write_text("\n".join(outer) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install", "--no-deps",
                    "--no-index", "-q", str(wheel)], check=True, capture_output=True, timeout=300)
    return bin_dir


def test_every_package_of_the_tree_is_in_the_wheel(installed):
    """pyproject lists the packages (conf/ and sweeps/ are mapped into the package): a package
    added to the tree but not to that list would be missing from every install but editable ones."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    site = Path(subprocess.run([str(installed / "python"), "-c", "import titan_exp; print(titan_exp.__file__)"],
                               check=True, capture_output=True, text=True, cwd=installed,
                               env=env).stdout.strip()).parent
    assert site.is_relative_to(installed.parent)  # the wheel's copy, not the checkout
    tree = {p.parent.relative_to(REPO / "titan_exp") for p in (REPO / "titan_exp").rglob("__init__.py")}
    assert {d for d in tree if not (site / d / "__init__.py").is_file()} == set()
    assert (site / "conf" / "config.yaml").is_file() and (site / "sweeps" / "autotune.yaml").is_file()


def test_the_console_script_runs_from_a_wheel_anywhere(installed, tmp_path):
    work = tmp_path / "elsewhere"  # no checkout here: configs must come from the package
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(installed / args[0]), *args[1:]], cwd=work, env=env, capture_output=True,
                              text=True, timeout=300)

    where = run("python", "-c", "import titan_exp; print(titan_exp.__file__)")
    assert where.stdout.startswith(str(installed.parent)), where  # the wheel's copy, not the checkout
    # A preset from the package's conf/, and a run whose rank is a real process of the venv's python.
    out = run("titan-exp", *SMALL, "training.steps=2", "model=debugmodel", "hydra.run.dir=run")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((work / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and len(summary["losses"]) == 2
    # Named sweeps come from the package; the planner writes the user's into ./sweeps.
    assert "parallelism: fsdp,ddp,tp,pp,cp" in run("titan-exp", "+sweep=layouts_2", "--cfg", "hydra").stdout
    planned = run("python", "-m", "titan_exp.perf.plan", "autotune.calibrate=false", "--world", "2", "--top", "2",
                  "--write-sweep", "mine")
    assert planned.returncode == 0 and (work / "sweeps" / "mine.yaml").exists(), planned.stderr[-2000:]
    assert "+plan_layout: mine_0,mine_1" in run("titan-exp", "+sweep=mine", "--cfg", "hydra").stdout
    # The guard and --help work the same from the console script.
    refused = run("titan-exp", "parallelism=fsdpp")
    assert (refused.returncode == 2
            and "parallelism=fsdpp: no such preset in parallelism/ of conf; did you mean fsdp" in refused.stderr)
    assert "titan-exp --cfg job" in run("titan-exp", "--help").stdout


def test_each_commands_help_opens_with_its_whole_first_paragraph():
    """`python -m <command> --help` describes the command by its module's first paragraph, whole
    (the plan's, the report's and the evaluator's had stopped at their first line, mid-sentence)."""
    for module in ("titan_exp.perf.plan", "titan_exp.perf.calibrate", "titan_exp.report", "titan_exp.eval",
                   "titan_exp.data.prepare"):
        out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        description = out.stdout.split("\n\n")[1]  # after the usage
        assert description.rstrip().endswith("."), (module, description)


# The user's docs (CHANGELOG.md names commands as they were, to say what they became).
DOCS = ("README.md", "BENCHMARKS.md", "RELIABILITY.md", "benchmarks/data/README.md",
        *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")))
COMMAND = re.compile(r"python3? (?:-m ([\w.]+)|([\w./-]+\.py))((?:(?!python3? ).)*)")


def doc_commands(text: str) -> list[tuple[str | None, str | None, tuple[str, ...]]]:
    """(module, script, --flags) of each `python -m MODULE ...` and `python SCRIPT.py ...` in a
    markdown text: in code blocks a line each (a trailing backslash continues it), in inline code
    the span's whole text (a span may wrap over lines of prose); a comment ends a command."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
    spans = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    spans += [re.sub(r"\s+", " ", s) for s in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))]
    return [(m[1], m[2], tuple(re.findall(r"(?<![\w=-])(--[a-z][\w-]*)", m[3])))
            for span in spans for m in COMMAND.finditer(span.split(" #")[0])]


@pytest.mark.quick
def with_imported_modules(files: list[Path]) -> list[Path]:
    """`files` and the titan_exp modules they import as modules (`from titan_exp.perf.search import
    run`), where a command may add its flags (run.add_flags)."""
    imported = []
    for f in files:
        for package, names in re.findall(r"^from (titan_exp[\w.]*) import ([\w, ]+)$", f.read_text(), re.M):
            folder = REPO.joinpath(*package.split("."))
            imported += [folder / f"{n.strip()}.py" for n in names.split(",") if (folder / f"{n.strip()}.py").is_file()]
    return [*files, *imported]


def test_the_commands_the_docs_name_exist_with_their_flags():
    """Every module and script a user's doc tells them to run exists, and each --flag given to one
    is in its source (argparse's add_argument; launch.py's are Hydra's), so a rename or a removed
    option cannot leave a doc's command behind."""
    sample = ("Run `python -m titan_exp.perf.plan\n--world 8 --top 3` or\n```bash\n"
              "python benchmarks/bench_published.py --rows  # x --no\n```")
    assert set(doc_commands(sample)) == {(None, "benchmarks/bench_published.py", ("--rows",)),
                                         ("titan_exp.perf.plan", None, ("--world", "--top"))}
    missing, count = [], 0
    for doc in DOCS:
        for module, script, flags in doc_commands((REPO / doc).read_text()):
            count += 1
            if module:
                spec = importlib.util.find_spec(module)
                if spec is None or spec.origin is None:
                    missing.append(f"{doc}: python -m {module}")
                    continue
                origin = Path(spec.origin)
                files = list(origin.parent.rglob("*.py")) if origin.name == "__init__.py" else [origin]
                if not origin.is_relative_to(REPO) or module == "pytest":
                    continue
            elif script.startswith("path/to/"):
                continue
            else:
                files = [REPO / script]
                if not files[0].exists():
                    missing.append(f"{doc}: python {script}")
                    continue
                if script == "launch.py":
                    continue
            source = "".join(f.read_text() for f in with_imported_modules(files))
            missing += [f"{doc}: {module or script} {flag}" for flag in flags if f'"{flag}"' not in source]
    assert count > 100 and not missing, missing


@pytest.mark.parametrize("field, module, extra", [
    ("metrics.enable_wandb", "wandb", "wandb"),
    ("metrics.enable_tensorboard", "tensorboard", "tensorboard"),
    ("eval.enable", "lm_eval", "eval"),
    ("checkpoint.last_save_in_hf", "transformers", "hf"),
])
@pytest.mark.quick
def test_a_feature_whose_extra_is_missing_says_what_to_install(field, module, extra, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # Python's own way of making a module unimportable
    errors = validate(job_config([f"{field}=true"]), cuda=False)
    assert f"{field} = True: {module} is not installed; pip install 'titan_exp[{extra}]'; or set it to false" in errors


def test_the_notebook_says_which_extra_brings_pandas(monkeypatch):
    from titan_exp.extras import require

    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError,
                       match=r"this notebook: pandas is not installed; pip install 'titan_exp\[notebooks\]'"):
        require("pandas", "this notebook")
