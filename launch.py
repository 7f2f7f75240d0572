"""`python launch.py [group=option ...] [key=value ...]` in a checkout: the same as the installed
`titan-exp ...` console script (titan_exp/cli.py, where the entry point lives)."""

from titan_exp.cli import main

if __name__ == "__main__":
    main()
