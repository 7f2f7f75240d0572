"""`python -m titan_exp ...`: the same as `titan-exp ...` (titan_exp.cli)."""

from titan_exp.cli import main

main()
