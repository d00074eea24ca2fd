"""``python -m unickpt.demo``: the same as ``unickpt demo`` (also under ``torchrun``)."""

from unickpt.cli.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
