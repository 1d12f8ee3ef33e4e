"""``python -m autopar``: the autopar command line (see autopar/cli/main.py)."""

from autopar.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
