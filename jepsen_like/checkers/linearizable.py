"""Linearizability of each queue as a log object (Wing-Gong / Lowe search).

Theory of operation
-------------------
Model. Every queue (``key`` = ``"topic/queue"``) is a log: ``append(value)
-> offset`` (a produce; ``ok`` carries the acknowledged offset) and
``read(offset) -> [[offset, value], ...]`` (a ``read`` or ``final_read`` with
``consistency == "linearizable"``; ``[]`` means nothing at ``offset`` yet).
A read whose result reaches the end of the log (``Operation.reached_end``)
also fixes the log length; an empty result means nothing at ``offset`` yet;
a read with ``end=false`` bounds it from below (the log held an entry past
the last one returned when the read took effect). A result that is not a
contiguous run from the requested offset (``0`` and ``2`` without ``1``, or
starting elsewhere), or an empty one with ``end=false``, fits no state of a
log: the key is invalid without a search, the read alone is the window.
Committed reads and polls do not take part (the
queue checker looks at them).

* ``ok`` ops took effect once, between invoke and completion.
* ``fail`` ops did not take effect and are dropped.
* ``info`` produces may or may not have taken effect, at any time after
  their invoke, at an offset nobody acknowledged; ``info`` reads carry no
  information and are dropped.
* Closed world: every append to a queue is in the history, so an
  acknowledged offset must be reachable by appends that are recorded.

P-compositionality: linearizability is local, so every key is checked on
its own.

Search (Lowe's just-in-time linearization of Wing & Gong). Calls and
returns of ``ok`` ops form a doubly linked list sorted by time (calls
before returns at equal times, which only ever adds concurrency). A call
before the first remaining return is a candidate; linearizing it runs the
model and removes the call and its return from the list. ``info`` produces
live in a side list: one is a candidate once its invoke is not later than
the first remaining return. When the main list is empty every ``ok`` op is
linearized and the leftover ``info`` ops simply never happened. On a dead
end the search backtracks (undoing the model step). Configurations already
seen are not explored twice. The memo key is (ok ops linearized, info ops
linearized, model state): the ok set as ``(k, rest)`` with ops ``0..k-1``
all done (small, since the linearized set is mostly a prefix), the model
state interned in a trie of appended values, so equal logs always get equal
ids (no hash collisions: the memo never hides a linearization).

Reductions (each removes only branches that cannot succeed, or that are
equivalent to one still explored; ``tests/jepsen`` checks the search
against brute force):

* an ``ok`` append needs ``len(log) == offset``; so at most one ``ok``
  append fits at any point;
* no append may put a value at an offset where a linearizable read saw a
  different one (that read could then never be linearized);
* an ``info`` append may not take an offset some ``ok`` append acknowledged,
  and when its value is unique among the key's appends and a read saw it at
  offset ``q``, it can only go to ``q``;
* a read that fits now is linearized now, and never tried later: it does
  not change the state and no pending op has to precede it, so if any
  completion exists, one exists with the read first (partial-order
  reduction: with it, only ``info`` appends are real choices);
* ``info`` appends whose value no read returned are interchangeable: only
  the earliest-invoked unused one is tried at each point.

Cost: with those, a linearizable history is checked in about one step per
op; exponential in the worst case (many concurrent ``info`` appends whose
values were read, or of equal values). ``python -m jepsen_like.bench``
(check only, one core; reading the file costs about half as much again):
the default *contended* profile (3 keys, 12 clients per key, 12 % info,
head reads of 2-8 entries with ``end=false`` when more follow, info effects
landing after the client gave up; mean overlap 20 ops): 50,000 ops 1.2 s,
100,000 3.3 s, 200,000 7.4 s; 100,000 ops with 20 % info and 24 clients
per key (overlap 43) 4.9 s. The *legacy* profile (16 keys, 20 clients,
5 % info, reads of 8): 25,000 ops 0.7 s, 50,000 1.4 s, 100,000 3.1 s,
200,000 6.8 s, 400,000 17 s. The memo's big-int keys make the per-key cost
grow slightly faster than linearly (about x2.2 per doubling). The budget
(``max_states`` explored and ``max_seconds`` per key) bounds the search:
when spent, the key's verdict is ``unknown`` — never ``valid`` or
``invalid`` by guess.

Smallest failing window. After a violation the search reports the op it
was stuck at (the first return it could never pass at its deepest point),
and a shrinker looks for a small subset of ops that is still not
linearizable in a *relaxed* model: log entries not explained by the subset
are "fillers" that may hold any value not appended only by the subset.
Every subset that fails the relaxed model proves the whole key fails (the
relaxed model is weaker), so the reported window is a real explanation. It
grows a window around the stuck op (ops sharing its values or offsets
first, then by distance in time) until the relaxed check fails, then drops
ops one at a time while it still fails, within a bounded number of checks.
A violation that only the closed-world assumption explains (an offset that
no recorded produce can fill) has no relaxed window; nor does one that
hinges on which of several ``info`` produces of one read value happened
(the relaxed model lets fillers carry such values, to stay weaker than the
truth). ``window`` is then ``None`` and ``note`` says so.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from jepsen_like.history import History, Operation, Value

Verdict = Literal["valid", "invalid", "unknown"]

_INF: Final = 1 << 62


@dataclass(frozen=True, slots=True)
class LinConfig:
    """Budget and shrinking knobs (per key)."""

    max_states: int = 2_000_000
    max_seconds: float | None = 60.0
    shrink: bool = True
    shrink_checks: int = 300
    shrink_states: int = 50_000
    shrink_seconds: float = 5.0


@dataclass(frozen=True, slots=True)
class KeyResult:
    key: str
    verdict: Verdict
    ops: int
    states: int
    elapsed_s: float
    reason: str | None = None
    stuck_at: dict[str, Any] | None = None
    window: list[dict[str, Any]] | None = None
    note: str | None = None
    explanation: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "key": self.key,
            "verdict": self.verdict,
            "ops": self.ops,
            "states": self.states,
            "elapsed_s": round(self.elapsed_s, 6),
        }
        for name in ("reason", "stuck_at", "window", "note", "explanation"):
            v = getattr(self, name)
            if v is not None:
                out[name] = v
        return out


class _Op:
    """An op as the search sees it."""

    __slots__ = (
        "anon",
        "append",
        "bad",
        "call",
        "id",
        "max_len",
        "min_len",
        "offset",
        "pairs",
        "req",
        "ret",
        "src",
        "value",
    )

    def __init__(self, src: Operation, append: bool) -> None:
        self.src = src
        self.id = 0
        self.append = append
        self.call = src.invoke_ns
        self.ret = src.complete_ns if src.status == "ok" else None
        self.value: Value | None = src.value
        self.offset: int | None = src.offset if append and src.status == "ok" else None
        self.pairs: tuple[tuple[int, Value], ...] = () if append else src.results
        self.max_len: int | None = None
        self.min_len: int | None = None
        self.bad: str | None = None
        self.req: int | None = None
        self.anon = False
        if not append:
            start = src.offset if src.offset is not None else 0
            last = start - 1
            for off, _ in src.results:
                if off != last + 1:
                    self.bad = (
                        f"the result starts at offset {off}, not at the requested {start}"
                        if last < start
                        else f"offset {off} follows {last} in the result "
                        f"(a log read returns a contiguous run from offset {start})"
                    )
                    break
                last = off
            if not src.results:
                self.max_len = start
            elif src.reached_end:
                self.max_len = last + 1
            if src.end is False:
                # "There is more": the log held an entry past the last one returned.
                self.min_len = last + 2
                if self.max_len is not None and self.min_len > self.max_len and self.bad is None:
                    self.bad = (
                        f"an empty result at offset {start} that says the log goes on (end=false)"
                    )


def participants(ops: Iterable[Operation]) -> list[_Op]:
    """The ops of one key that the log model constrains."""
    out: list[_Op] = []
    for op in ops:
        if op.f == "produce" and op.status in ("ok", "info"):
            out.append(_Op(op, True))
        elif (
            op.f in ("read", "final_read")
            and op.status == "ok"
            and op.consistency == "linearizable"
        ):
            out.append(_Op(op, False))
    out.sort(key=lambda o: (o.call, o.src.invoke_index))
    for i, o in enumerate(out):
        o.id = i
    # An info append whose value is unique among appends and was read at q
    # can only sit at q.
    counts: dict[Value, int] = {}
    for o in out:
        if o.append and o.value is not None:
            counts[o.value] = counts.get(o.value, 0) + 1
    seen_at: dict[Value, set[int]] = {}
    for o in out:
        for off, v in o.pairs:
            seen_at.setdefault(v, set()).add(off)
    for o in out:
        if o.append and o.offset is None and o.value is not None:
            where = seen_at.get(o.value)
            if where is None:
                o.anon = True
            elif counts[o.value] == 1 and len(where) == 1:
                o.req = next(iter(where))
    return out


class _Anon:
    """The value of an info append nobody read: which one it was is irrelevant."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<anon>"


_ANON: Final = _Anon()
_CONFLICT: Final = _Anon()


# --------------------------------------------------------------------------- models


class _LogModel:
    """The full (closed-world) log: a list of values plus interned state ids.

    ``observed`` maps an offset to the value a linearizable read saw there:
    an append of anything else at that offset makes that read impossible.
    """

    __slots__ = ("claimed", "ids", "log", "observed", "trie")

    pure_reads = True  # a read never changes the state

    def __init__(self, claimed: set[int], observed: dict[int, Value | _Anon]) -> None:
        self.log: list[Value | _Anon] = []
        self.ids: list[int] = [0]
        self.trie: dict[tuple[int, Value | _Anon], int] = {}
        self.claimed = claimed
        self.observed = observed

    def length(self) -> int:
        return len(self.log)

    def apply(self, op: _Op) -> bool:
        log = self.log
        n = len(log)
        if op.append:
            if op.offset is not None:
                if n != op.offset:
                    return False
            elif n in self.claimed or (op.req is not None and op.req != n):
                return False
            value: Value | _Anon | None = _ANON if op.anon else op.value
            assert value is not None
            seen = self.observed.get(n)
            if seen is not None and seen != value:
                return False
            k = (self.ids[-1], value)
            sid = self.trie.get(k)
            if sid is None:
                sid = len(self.trie) + 1
                self.trie[k] = sid
            log.append(value)
            self.ids.append(sid)
            return True
        if op.bad is not None:
            return False
        if op.max_len is not None and n > op.max_len:
            return False
        if op.min_len is not None and n < op.min_len:
            return False
        return all(off < n and log[off] == v for off, v in op.pairs)

    def undo(self, op: _Op) -> None:
        if op.append:
            self.log.pop()
            self.ids.pop()

    def key(self) -> int:
        return self.ids[-1]

    def blocks_info(self) -> bool:
        return len(self.log) in self.claimed


class _RelaxedModel:
    """Open-world log for shrinking: unexplained entries are fillers.

    A filler may hold any value except one that only the checked subset
    appends. Fillers are created lazily, when an op needs the offset taken.
    """

    __slots__ = ("claimed", "forbidden", "known", "n", "undo_log")

    pure_reads = False  # a read may pin fillers

    def __init__(self, claimed: set[int], forbidden: set[Value]) -> None:
        self.n = 0
        self.known: dict[int, Value] = {}
        self.claimed = claimed
        self.forbidden = forbidden
        self.undo_log: list[tuple[int, list[int]]] = []

    def length(self) -> int:
        return self.n

    def apply(self, op: _Op) -> bool:
        if op.append:
            value = op.value
            assert value is not None
            if op.offset is not None:
                k = op.offset
                if self.n > k:
                    return False
            else:
                k = op.req if op.req is not None else self.n
                if k < self.n or (op.req is None and k in self.claimed):
                    return False
            self.undo_log.append((self.n, [k]))
            self.known[k] = value
            self.n = k + 1
            return True
        if op.bad is not None:
            return False
        n = self.n
        added: list[int] = []
        good = True
        for off, v in op.pairs:
            cur = self.known.get(off)
            if cur is not None and off < n:
                if cur != v:
                    good = False
                    break
                continue
            if v in self.forbidden:
                good = False
                break
            self.known[off] = v
            added.append(off)
            n = max(n, off + 1)
        if good and op.min_len is not None:
            n = max(n, op.min_len)  # fillers past the result: "there is more"
        if good and op.max_len is not None and n > op.max_len:
            good = False
        if not good:
            for off in added:
                del self.known[off]
            return False
        self.undo_log.append((self.n, added))
        self.n = n
        return True

    def undo(self, op: _Op) -> None:
        old_n, added = self.undo_log.pop()
        for off in added:
            del self.known[off]
        self.n = old_n

    def key(self) -> tuple[int, frozenset[tuple[int, Value]]]:
        return (self.n, frozenset(self.known.items()))

    def blocks_info(self) -> bool:
        return self.n in self.claimed


# --------------------------------------------------------------------------- search


@dataclass(slots=True)
class _Outcome:
    verdict: Verdict
    states: int
    reason: str | None = None
    stuck: _Op | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _compact(bits: int) -> tuple[int, int]:
    """(k, rest) with bits 0..k-1 all set: a far smaller memo key than ``bits``
    for long histories, where the linearized ok ops are mostly a prefix."""
    k = (~bits & (bits + 1)).bit_length() - 1
    return (k, bits >> k)


def _search(
    ops: Sequence[_Op],
    model: _LogModel | _RelaxedModel,
    max_states: int,
    deadline: float | None,
) -> _Outcome:
    ok_ops = [o for o in ops if o.ret is not None]
    info_ops = sorted((o for o in ops if o.ret is None), key=lambda o: (o.call, o.id))
    # Entries 1..n, head 0, tail n + 1.
    events: list[tuple[int, int, int]] = []
    for i, o in enumerate(ok_ops):
        assert o.ret is not None
        events.append((o.call, 0, i))
        events.append((o.ret, 1, i))
    events.sort()
    n = len(events)
    tail = n + 1
    is_call = [False] * (n + 2)
    ent_op: list[_Op | None] = [None] * (n + 2)
    ent_time = [0] * (n + 2)
    ret_of = [0] * (n + 2)  # call entry -> its return entry
    ent_bit = [0] * (n + 2)  # call entry -> its op's bit among ok ops
    call_entry = [0] * len(ok_ops)
    for e, (t, kind, i) in enumerate(events, start=1):
        is_call[e] = kind == 0
        ent_op[e] = ok_ops[i]
        ent_time[e] = t
        if kind == 0:
            call_entry[i] = e
            ent_bit[e] = 1 << i
        else:
            ret_of[call_entry[i]] = e
    nxt = list(range(1, n + 3))
    prv = list(range(-1, n + 1))
    info_call = [o.call for o in info_ops]
    n_info = len(info_ops)
    # Not-yet-linearized info ops, by index (= call order), in two sorted
    # lists: only the first unused anonymous one is ever a candidate, so the
    # scan at a return skips the others without looking at them.
    pending_named = [k for k, o in enumerate(info_ops) if not o.anon]
    pending_anon = [k for k, o in enumerate(info_ops) if o.anon]
    pure_reads = model.pure_reads

    # Memo key: (ok ops linearized, info ops linearized, model state). The ok
    # set is stored as (k, rest) with ops 0..k-1 all done: mostly a prefix.
    memo: set[tuple[tuple[int, int], int, Any]] = set()
    # Frames: (is_info, entry or info index, frontier time, forced).
    stack: list[tuple[bool, int, int, bool]] = []
    bits = 0  # ok ops linearized, by index in ok_ops (call order)
    ibits = 0  # info ops linearized, by index in info_ops
    states = 0
    depth = 0
    best_depth = -1
    stuck: _Op | None = None
    e = nxt[0]
    in_info = False
    frontier = 0
    i = 0
    while True:
        if nxt[0] == tail:
            return _Outcome("valid", states)
        dead = False
        if not in_info:
            if is_call[e]:
                op = ent_op[e]
                assert op is not None
                if model.apply(op):
                    nb = bits | ent_bit[e]
                    mk = (_compact(nb), ibits, model.key())
                    # A read that fits now can go now: it changes nothing and no
                    # pending op must precede it, so if any completion exists one
                    # exists with the read first (partial-order reduction).
                    forced = pure_reads and not op.append
                    if mk not in memo:
                        memo.add(mk)
                        states += 1
                        if states >= max_states:
                            return _Outcome("unknown", states, f"state budget {max_states} spent")
                        if (
                            deadline is not None
                            and states & 1023 == 0
                            and time.monotonic() > deadline
                        ):
                            return _Outcome("unknown", states, "time budget spent")
                        stack.append((False, e, 0, forced))
                        bits = nb
                        depth += 1
                        r = ret_of[e]
                        nxt[prv[e]] = nxt[e]
                        prv[nxt[e]] = prv[e]
                        nxt[prv[r]] = nxt[r]
                        prv[nxt[r]] = prv[r]
                        e = nxt[0]
                        continue
                    model.undo(op)
                    if forced:
                        dead = True  # this configuration plus the read already failed
                if not dead:
                    e = nxt[e]
                    continue
            else:
                in_info = True
                frontier = ent_time[e]
                i = 0
                if depth > best_depth:
                    best_depth = depth
                    stuck = ent_op[e]
        if not dead and n_info and not model.blocks_info():
            found = False
            # Symmetry: unread info appends are interchangeable, so only the
            # earliest-invoked unused one is worth trying (it is eligible
            # wherever a later-invoked one is).
            anon = pending_anon[0] if pending_anon else n_info
            j = bisect.bisect_left(pending_named, i)
            while True:
                cand = pending_named[j] if j < len(pending_named) else n_info
                if i <= anon < cand:
                    cand = anon
                else:
                    j += 1
                if cand >= n_info or info_call[cand] > frontier:
                    break
                i = cand
                op = info_ops[i]
                if model.apply(op):
                    nib = ibits | (1 << i)
                    mk = (_compact(bits), nib, model.key())
                    if mk not in memo:
                        memo.add(mk)
                        states += 1
                        if states >= max_states:
                            return _Outcome("unknown", states, f"state budget {max_states} spent")
                        if (
                            deadline is not None
                            and states & 1023 == 0
                            and time.monotonic() > deadline
                        ):
                            return _Outcome("unknown", states, "time budget spent")
                        stack.append((True, i, frontier, False))
                        ibits = nib
                        (pending_anon if op.anon else pending_named).remove(i)
                        found = True
                        break
                    model.undo(op)
                i += 1
            if found:
                in_info = False
                e = nxt[0]
                continue
        # Backtrack; past forced frames, whose alternatives cannot succeed.
        while True:
            if not stack:
                return _Outcome("invalid", states, stuck=stuck)
            was_info, ref, fr, forced = stack.pop()
            if was_info:
                op = info_ops[ref]
                model.undo(op)
                bisect.insort(pending_anon if op.anon else pending_named, ref)
                ibits &= ~(1 << ref)
                in_info = True
                frontier = fr
                i = ref + 1
            else:
                op2 = ent_op[ref]
                assert op2 is not None
                model.undo(op2)
                bits &= ~ent_bit[ref]
                depth -= 1
                r = ret_of[ref]
                nxt[prv[r]] = r
                prv[nxt[r]] = r
                nxt[prv[ref]] = ref
                prv[nxt[ref]] = ref
                in_info = False
                e = nxt[ref]
            if not forced:
                break


def _observed(ops: Iterable[_Op]) -> dict[int, Value | _Anon]:
    """Offset -> the value linearizable reads saw there (``_CONFLICT`` if they disagree:
    no append can satisfy both; an unread ``_ANON`` value never fits a seen offset)."""
    out: dict[int, Value | _Anon] = {}
    for o in ops:
        for off, v in o.pairs:
            if out.setdefault(off, v) != v:
                out[off] = _CONFLICT
    return out


def _claimed(ops: Iterable[_Op]) -> set[int]:
    return {o.offset for o in ops if o.append and o.offset is not None}


def _relaxed_check(
    subset: Sequence[_Op], all_ops: Sequence[_Op], max_states: int, deadline: float | None
) -> Verdict:
    inside = {id(o) for o in subset}
    outside_values = {o.value for o in all_ops if o.append and id(o) not in inside}
    # An info append without a fixed offset is only ever placed at the end of
    # the log, never after fillers; so that this cannot make the model
    # stricter than the truth, its value stays available to fillers.
    loose = {o.value for o in subset if o.append and o.offset is None and o.req is None}
    forbidden = {
        o.value
        for o in subset
        if o.append
        and o.value is not None
        and o.value not in outside_values
        and o.value not in loose
    }
    model = _RelaxedModel(_claimed(subset), forbidden)
    return _search(subset, model, max_states, deadline).verdict


def _related(a: _Op, b: _Op) -> bool:
    va = {a.value} if a.append else {v for _, v in a.pairs}
    vb = {b.value} if b.append else {v for _, v in b.pairs}
    oa = {a.offset} if a.append else {o for o, _ in a.pairs}
    ob = {b.offset} if b.append else {o for o, _ in b.pairs}
    oa.discard(None)
    ob.discard(None)
    return bool(va & vb) or bool(oa & ob)


def _shrink(
    ops: Sequence[_Op], stuck: _Op | None, cfg: LinConfig
) -> tuple[list[_Op] | None, str | None]:
    if not ops:
        return None, None
    deadline = time.monotonic() + cfg.shrink_seconds
    anchor = stuck if stuck is not None else ops[-1]
    a_mid = (anchor.call + (anchor.ret if anchor.ret is not None else anchor.call)) // 2

    def distance(o: _Op) -> tuple[int, int]:
        if o is anchor:
            return (0, 0)
        rel = 1 if _related(o, anchor) else 2
        end = o.ret if o.ret is not None else _INF
        if o.call <= a_mid <= end:
            d = 0
        else:
            d = min(abs(o.call - a_mid), abs(end - a_mid))
        return (rel, d)

    ranked = sorted(ops, key=distance)
    checks = 0
    size = min(8, len(ranked))
    window: list[_Op] | None = None
    while True:
        cand = ranked[:size]
        checks += 1
        if _relaxed_check(cand, ops, cfg.shrink_states, deadline) == "invalid":
            window = cand
            break
        if size >= len(ranked) or checks >= cfg.shrink_checks or time.monotonic() > deadline:
            break
        size = min(len(ranked), size * 2)
    if window is None:
        if size >= len(ranked) and checks < cfg.shrink_checks and time.monotonic() <= deadline:
            return None, (
                "no subset fails on its own: the violation rests on the closed-world "
                "assumption (an acknowledged offset or observed log length that no recorded "
                "produce can account for) or on which info produces of a read value happened"
            )
        return None, "shrink budget spent before a failing window was found"
    # Drop reads first (cheap explanations keep the appends), latest first.
    order = sorted(window, key=lambda o: (o.append, -o.call))
    for o in order:
        if checks >= cfg.shrink_checks or time.monotonic() > deadline:
            break
        if len(window) <= 1:
            break
        trial = [x for x in window if x is not o]
        checks += 1
        if _relaxed_check(trial, ops, cfg.shrink_states, deadline) == "invalid":
            window = trial
    window.sort(key=lambda o: (o.call, o.id))
    return window, None


def describe(op: Operation) -> str:
    """One op in words: ``read #12 (process 3) at offset 4 -> [[4, 'a']] end=false``."""
    when = f"#{op.invoke_index}"
    if op.f == "produce":
        if op.status == "ok":
            return f"produce {when} (process {op.process}) of {op.value!r} acknowledged at offset {op.offset}"
        return f"produce {when} (process {op.process}) of {op.value!r} ({op.status}: may have happened)"
    res = [list(r) for r in op.results]
    if len(res) > 6:
        shown = f"{res[:3]} ... {res[-2:]} ({len(res)} entries)"
    else:
        shown = str(res)
    end = "" if op.end is None else f" end={'true' if op.end else 'false'}"
    return (
        f"{op.consistency} {op.f} {when} (process {op.process}) at offset {op.offset} -> "
        f"{shown}{end}"
    )


def _explain(stuck: _Op | None, window: Sequence[_Op] | None) -> str:
    out = "no order of the operations fits one append-only log"
    if stuck is not None:
        out += f"; the search could never get past {describe(stuck.src)}"
    if window:
        out += "; these operations alone already conflict: " + "; ".join(
            describe(o.src) for o in window[:8]
        )
        if len(window) > 8:
            out += f"; and {len(window) - 8} more"
    return out


def check_key(key: str, ops: Iterable[Operation], config: LinConfig | None = None) -> KeyResult:
    """Decide linearizability of one key's ops (others are ignored)."""
    cfg = config or LinConfig()
    start = time.monotonic()
    parts = participants(op for op in ops if op.key == key)
    bad = next((o for o in parts if o.bad is not None), None)
    if bad is not None:
        # Impossible in every state of a log: no search needed, the read is the window.
        assert bad.bad is not None
        return KeyResult(
            key=key,
            verdict="invalid",
            ops=len(parts),
            states=0,
            elapsed_s=time.monotonic() - start,
            stuck_at=bad.src.to_json(),
            window=[bad.src.to_json()],
            explanation=f"{describe(bad.src)}: {bad.bad}; no state of a log gives that result",
        )
    deadline = None if cfg.max_seconds is None else start + cfg.max_seconds
    outcome = _search(parts, _LogModel(_claimed(parts), _observed(parts)), cfg.max_states, deadline)
    window_json: list[dict[str, Any]] | None = None
    note = None
    stuck_json = outcome.stuck.src.to_json() if outcome.stuck is not None else None
    explanation = None
    if outcome.verdict == "invalid":
        window = None
        if cfg.shrink:
            window, note = _shrink(parts, outcome.stuck, cfg)
            if window is not None:
                window_json = [o.src.to_json() for o in window]
        explanation = _explain(outcome.stuck, window)
    return KeyResult(
        key=key,
        verdict=outcome.verdict,
        ops=len(parts),
        states=outcome.states,
        elapsed_s=time.monotonic() - start,
        reason=outcome.reason,
        stuck_at=stuck_json,
        window=window_json,
        note=note,
        explanation=explanation,
    )


def check(history: History, config: LinConfig | None = None) -> dict[str, Any]:
    """Check every key; the verdict is invalid if any key is, else unknown if any is."""
    results = [check_key(k, ops, config) for k, ops in sorted(history.by_key().items())]
    verdicts = {r.verdict for r in results}
    verdict: Verdict = (
        "invalid" if "invalid" in verdicts else "unknown" if "unknown" in verdicts else "valid"
    )
    return {
        "checker": "linearizable",
        "verdict": verdict,
        "keys_checked": len(results),
        "invalid_keys": [r.key for r in results if r.verdict == "invalid"],
        "unknown_keys": [r.key for r in results if r.verdict == "unknown"],
        "keys": {r.key: r.to_json() for r in results},
    }
