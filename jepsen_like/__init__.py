"""jepsen_like: a black-box, Jepsen-style harness for DLedger-py.

Offline core (no I/O beyond reading and writing history files):

* :mod:`jepsen_like.history`: the versioned JSONL history format, its
  :class:`~jepsen_like.history.Writer` and validating
  :class:`~jepsen_like.history.Reader`;
* :mod:`jepsen_like.checkers`: linearizability, Kafka-workload anomalies and
  recovery checkers; ``python -m jepsen_like.checkers HISTORY.jsonl`` prints
  a JSON verdict (:mod:`jepsen_like.checkers.tail`: what async mode lost
  after a power loss of a majority).

Against a live cluster: :mod:`jepsen_like.replicas` (every replica serves
the same messages at the same offsets) and :mod:`jepsen_like.lazyfs`, the
FUSE filesystem under each node's data directory for the power-loss and
disk-error nemeses (a separate daemon process per node).

The harness talks to nodes only over HTTP and OS signals and never imports
server internals (see the design map in ``../shared/DESIGN.md``).
"""

from jepsen_like.history import (
    SCHEMA_VERSION,
    FaultWindow,
    History,
    HistoryError,
    Operation,
    Reader,
    Writer,
    parse_history,
    read_history,
)

__all__ = [
    "SCHEMA_VERSION",
    "FaultWindow",
    "History",
    "HistoryError",
    "Operation",
    "Reader",
    "Writer",
    "parse_history",
    "read_history",
]
