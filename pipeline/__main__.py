"""``python -m pipeline analyze RUNS_DIR [--out DIR] [--master URL]``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in ("analyze",):
        print("usage: python -m pipeline analyze RUNS_DIR [--out DIR] [--master URL]")
        return 2
    from pipeline.analyze import main as analyze_main

    return analyze_main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
