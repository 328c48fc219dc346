"""``python -m jepsen_like.checkers HISTORY.jsonl``: print the verdict as JSON.

Exit status: 0 valid, 1 invalid, 2 unknown, 3 unreadable or malformed history.
"""

from __future__ import annotations

import argparse
import json
import sys

from jepsen_like.checkers import LinConfig, QueueConfig, RecoveryConfig, check
from jepsen_like.history import HistoryError

EXIT = {"valid": 0, "invalid": 1, "unknown": 2}
_LIN = LinConfig()
_QUEUE = QueueConfig()
_REC = RecoveryConfig()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jepsen_like.checkers", description=__doc__)
    p.add_argument("history", help="a JSONL history written by jepsen_like")
    p.add_argument(
        "--max-states",
        type=int,
        default=_LIN.max_states,
        help="linearizability: states explored per key before 'unknown'",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=_LIN.max_seconds,
        help="linearizability: seconds per key before 'unknown'",
    )
    p.add_argument("--no-shrink", action="store_true", help="skip the failing-window search")
    p.add_argument("--max-examples", type=int, default=_QUEUE.max_examples)
    p.add_argument("--bucket-ms", type=int, default=_REC.bucket_ms)
    p.add_argument("--gap-threshold-ms", type=int, default=_REC.gap_threshold_ms)
    p.add_argument("--no-timeline", action="store_true", help="leave the per-bucket timeline out")
    p.add_argument("--indent", type=int, default=None)
    p.add_argument(
        "--human",
        action="store_true",
        help="the summary table, reasons and VERDICT line instead of JSON",
    )
    args = p.parse_args(argv)
    try:
        result = check(
            args.history,
            lin=LinConfig(
                max_states=args.max_states,
                max_seconds=args.max_seconds,
                shrink=not args.no_shrink,
            ),
            queue_config=QueueConfig(max_examples=args.max_examples),
            recovery_config=RecoveryConfig(
                bucket_ms=args.bucket_ms, gap_threshold_ms=args.gap_threshold_ms
            ),
        )
    except HistoryError as e:
        if args.human:
            print(f"VERDICT ERROR: malformed history: {e}", file=sys.stderr)
        else:
            print(json.dumps({"verdict": "error", "error": str(e), "line": e.line}))
        return 3
    except OSError as e:
        if not args.human:
            print(json.dumps({"verdict": "error", "error": str(e), "line": 0}))
        else:
            print(f"VERDICT ERROR: {e}", file=sys.stderr)
        return 3
    if args.human:
        from jepsen_like.summary import render

        print(render(result, args.history))
        return EXIT[result["verdict"]]
    if args.no_timeline:
        result["checkers"]["recovery"].pop("timeline", None)
    try:
        print(json.dumps(result, indent=args.indent))
    except BrokenPipeError:  # e.g. piped into head
        sys.stderr.close()
    return EXIT[result["verdict"]]


if __name__ == "__main__":
    sys.exit(main())
