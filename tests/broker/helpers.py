"""Feeding a BrokerState entries the way a node does: consecutive indexes,
each entry's ``pos`` the end of the previous one."""

from __future__ import annotations

from dataclasses import dataclass, field

from broker_adapter import BrokerState
from dledger.core.types import Entry, EntryType


@dataclass
class Log:
    entries: list[Entry] = field(default_factory=list)
    term: int = 1

    @property
    def end(self) -> int:
        return self.entries[-1].end_pos if self.entries else 0

    def add(self, data: bytes, type: EntryType = EntryType.NORMAL) -> Entry:
        e = Entry(len(self.entries) + 1, self.term, type, data, self.end)
        self.entries.append(e)
        return e

    def noop(self) -> Entry:
        return self.add(b"", EntryType.NOOP)


class Feed:
    """A log and a state fed with every entry as it is added."""

    def __init__(self, name: str = "test") -> None:
        self.log = Log()
        self.state = BrokerState(name)

    def __call__(self, data: bytes) -> object:
        return self.state.apply(self.log.add(data))


def replay(entries: list[Entry], name: str = "test") -> tuple[BrokerState, list[object]]:
    st = BrokerState(name)
    return st, [st.apply(e) for e in entries]


def all_messages(st: BrokerState) -> dict[tuple[str, int], list[object]]:
    """Every retained message of every queue, read back in pages."""
    out: dict[tuple[str, int], list[object]] = {}
    for name in st.topic_names():
        for q in st.topic(name).queues:
            msgs: list[object] = []
            off = q.min_offset
            while off < q.max_offset:
                r = st.read(name, q.queue, off, max_messages=7, max_bytes=300)
                msgs.extend(r.messages)
                assert r.next_offset > off
                off = r.next_offset
            out[(name, q.queue)] = msgs
    return out
