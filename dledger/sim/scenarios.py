"""Scripted nemeses for bugs that need one precise sequence of faults.

A scenario replaces the random nemesis of :class:`~dledger.sim.cluster.Simulation`
(clients keep running as usual): it is called before every step and drives
the cluster through its phases by watching the real nodes' state. Timing
within each phase comes from the seed, so 30 seeds are 30 different runs.

``conf-replay`` (issue #12 bug 1): voters {1,2,3} and learners {4,5}; the
leader promotes 4 and 5; every node crashes at once; 1 and 2 restart with a
slow replay (one costly entry per Ready, so ticks run long before they reach
the promotions); the network splits {1,2} | {3,4,5}. A node that campaigns
(or honours TimeoutNow) before applying a committed membership change uses
the old voter set: {1,2} elect a leader under {1,2,3} while {3,4,5} elect
one under {1..5}, and both commit different entries at one index.

``learner-vote`` (issue #12 bug 2): voters {1,2} and learner 3; the leader
promotes 3 while its messages to 3 are lost; the other voter applies the
promotion; the leader dies for good. The survivor needs 3's vote, and 3,
still a learner in its own view, must answer it: if it ignores (pre-)votes
no leader is ever elected (a liveness violation in the quiet phase).

``lost-rewrite`` (issue #12 bug 6, ``flush="async"``): the leader is cut
off alone and appends entries nobody else gets; they reach its disk. The
others elect a new leader and commit other entries at those indexes. After
the heal the old leader replaces its tail with the new leader's entries (in
the page cache only) and acknowledges them, then loses power: it comes back
with its old tail, while the new leader still believes it holds the new
one. The heartbeat's commit index covers those indexes; a follower that
commits it without checking the term there applies entries no leader
committed.

``lost-majority`` (issue #20, ``flush="async"``): both followers of a
3-voter cluster lose power at once while the leader is cut off; they come
back with a shorter log than the old leader's commit index, elect a leader
and write past it. After the heal the old leader must find that the new
history differs below its commit index and stop (``ReplicaDiverged``, then
it is rebuilt): answering the new leader's probes with its own commit index
unchecked makes the new leader believe it holds entries it does not, and the
replicas never converge.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dledger.sim.cluster import Simulation
    from dledger.sim.world import Host


class _Script:
    interval_s = 0.002

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.rng = random.Random(sim.seed ^ 0x5C1)
        self.phase = 0
        self.next_check = 0.0

    def __call__(self) -> None:
        sim = self.sim
        if sim.now < self.next_check:
            return
        self.next_check = sim.now + self.interval_s
        self.step()

    def step(self) -> None:
        raise NotImplementedError

    def leader(self) -> Host | None:
        h = self.sim._leader()
        if h is None or not h.node.leader_ready():
            return None
        return h


class ConfReplay(_Script):
    def __init__(self, sim: Simulation) -> None:
        super().__init__(sim)
        self.writes_before = self.rng.randrange(40, 70)
        self.writes_after = 0
        self.conf_index = 0

    def step(self) -> None:
        sim = self.sim
        lead = self.leader()
        if self.phase == 0:
            if lead is not None and sim.stats["acked"] >= self.writes_before:
                sim.spawn_client(lead, sim.client_conf(lead, "promote", 4))
                self.phase = 1
                self.next_check = sim.now + 0.05
        elif self.phase == 1:
            if lead is not None and lead.node._raft.config.is_voter(4):
                if lead.node._raft.config.is_voter(5):
                    self.writes_after = sim.stats["acked"] + self.rng.randrange(3, 15)
                    self.conf_index = lead.node._raft.log.applied
                    self.phase = 2
                elif lead.node._raft._pending_conf_index <= lead.node._raft.log.applied:
                    sim.spawn_client(lead, sim.client_conf(lead, "promote", 5))
                    self.next_check = sim.now + 0.05
            elif (
                lead is not None
                and lead.node._raft._pending_conf_index <= lead.node._raft.log.applied
            ):
                sim.spawn_client(lead, sim.client_conf(lead, "promote", 4))
                self.next_check = sim.now + 0.05
        elif (
            self.phase == 2
            and sim.stats["acked"] >= self.writes_after
            and all(st._durable[4].commit >= self.conf_index for st in sim.storages.values())
        ):
            # Every node knows durably that both promotions committed.
            sim.trace("scenario: full restart, 1 and 2 replay slowly, split {1,2}|{3,4,5}")
            for nid in sorted(sim.hosts):
                sim.crash(nid, -1.0, drop_in_flight=True)
            for nid in sorted(sim.storages):
                sim._spawn(nid, slow=nid in (1, 2))
            sim.cut([{1, 2}, {3, 4, 5}])
            self.phase = 3


class LearnerVote(_Script):
    def __init__(self, sim: Simulation) -> None:
        super().__init__(sim)
        self.writes_before = self.rng.randrange(3, 20)
        self.old_leader = 0

    def step(self) -> None:
        sim = self.sim
        learner = 3
        if self.phase == 0:
            lead = self.leader()
            if lead is not None and sim.stats["acked"] >= self.writes_before:
                self.old_leader = lead.nid
                sim.spawn_client(lead, sim.client_conf(lead, "promote", learner))
                # From now on nothing the leader sends reaches the learner.
                sim.blocked.add((lead.nid, learner))
                self.phase = 1
        elif self.phase == 1:
            lead = sim._leader()
            if lead is None or lead.nid != self.old_leader:
                sim.blocked.clear()  # the promotion did not go through: start over
                self.phase = 0
                return
            survivor = 3 - self.old_leader
            h = sim.hosts.get(survivor)
            if h is not None and h.node._raft is not None and h.node._raft.config.is_voter(learner):
                sim.trace(f"scenario: leader {self.old_leader} dies for good")
                sim.keep_down.add(self.old_leader)
                sim.crash(self.old_leader, -1.0)
                sim.blocked.clear()
                self.phase = 2


class Figure8(_Script):
    """Raft figure 8, five voters: leader X gets a big entry ``i`` onto one
    follower A only, dies; D is elected among the rest, writes its no-op at
    ``i`` (a later term) durably and dies before sending it; X and A return
    and one of them leads a still later term. It must not count ``i`` (an
    earlier term's entry) as committed once a majority holds it: D could
    still win with its later-term ``i``. The big entry travels without the
    new leader's no-op (max_msg_bytes is small), which is what lets a leader
    that counts old-term entries commit it alone."""

    interval_s = 0.0

    def __init__(self, sim: Simulation) -> None:
        super().__init__(sim)
        self.writes_before = self.rng.randrange(3, 15)
        self.x = self.a = self.d = self.index = 0
        self.deadline = 0.0

    def step(self) -> None:
        sim = self.sim
        if self.phase == 0:
            lead = self.leader()
            if lead is None or sim.stats["acked"] < self.writes_before:
                return
            r = lead.node._raft
            if r.log.committed != r.log.last_index():
                return
            self.x = lead.nid
            others = [v for v in r.config.voters if v != self.x]
            self.a = self.rng.choice(others)
            for o in others:
                if o != self.a:
                    sim.blocked.add((self.x, o))
                    sim.blocked.add((self.a, o))
                    sim.blocked.add((o, self.a))
            self.index = r.log.last_index() + 1
            sim.trace(f"scenario: n{self.x} writes {self.index} onto n{self.a} only")
            sim.spawn_client(lead, sim.client_write(lead, bytes(range(100))))
            self.deadline = sim.now + 0.2
            self.phase = 1
        elif self.phase == 1:
            ha = sim.hosts.get(self.a)
            if ha is None or sim.now > self.deadline:
                self.phase = 9  # did not set up: give up
                sim.blocked.clear()
                return
            ra = ha.node._raft
            if ra is not None and ra.log.last_index() >= self.index:
                sim.crash(self.x, -1.0, drop_in_flight=True)
                sim.cut([{self.a}])
                sim.trace(f"scenario: n{self.x} died, n{self.a} cut off")
                self.phase = 2
        elif self.phase == 2:
            lead = sim._leader()
            if lead is None or lead.nid in (self.x, self.a):
                return
            # Elected: nothing it sends from now on arrives.
            self.d = lead.nid
            sim.reset.add((self.d, sim.incarnation[self.d]))
            self.phase = 3
        elif self.phase == 3:
            st = sim.storages[self.d]
            r = sim.hosts[self.d].node._raft if self.d in sim.hosts else None
            if r is None:
                self.phase = 9
                return
            if st.durable_last()[0] >= self.index and st.durable_last()[1] == r.term:
                sim.crash(self.d, -1.0, drop_in_flight=True)
                sim.blocked.clear()
                sim._spawn(self.x)
                sim.trace(f"scenario: n{self.d} died after writing {self.index}@t{r.term}")
                self.deadline = sim.now + 0.6
                self.phase = 4
        elif self.phase == 4 and sim.now > self.deadline:
            sim._spawn(self.d)
            self.phase = 5


class StaleSnapshot(_Script):
    """A follower cut off while the leader snapshots and compacts comes back,
    installs the leader's snapshot, and dies right away with its
    acknowledgement lost; it restarts at once, and the leader (which never
    heard the acknowledgement) sends the same snapshot again. The restarted
    follower already holds it (its commit index is the snapshot's): it must
    acknowledge and ignore it, never install it again."""

    def __init__(self, sim: Simulation) -> None:
        super().__init__(sim)
        self.f = 0
        self.held = 0
        self.deadline = 0.0

    def step(self) -> None:
        sim = self.sim
        if self.phase == 0:
            lead = self.leader()
            if lead is None or sim.stats["acked"] < 5:
                return
            r = lead.node._raft
            self.f = self.rng.choice([v for v in r.config.voters if v != lead.nid])
            snap = sim.storages[self.f].snapshot()
            self.held = snap.meta.index if snap is not None else 0
            sim.cut([{self.f}])
            sim.trace(f"scenario: n{self.f} cut off while the leader snapshots")
            self.deadline = sim.now + self.rng.uniform(0.15, 0.4)
            self.phase = 1
        elif self.phase == 1 and sim.now > self.deadline:
            sim.blocked.clear()
            sim.clients_paused = True  # no newer snapshot meanwhile
            self.deadline = sim.now + 1.0
            self.phase = 2
        elif self.phase == 2:
            snap = sim.storages[self.f].snapshot()
            if snap is not None and snap.meta.index > self.held:
                lead = sim._leader()
                if lead is not None:
                    sim.blocked.add((self.f, lead.nid))
                sim.trace(f"scenario: n{self.f} installed {snap.meta.index}; dies, ack lost")
                sim.crash(self.f, 0.002, drop_in_flight=True)
                self.deadline = sim.now + 0.1
                self.phase = 3
            elif sim.now > self.deadline:
                sim.clients_paused = False
                self.phase = 0
        elif self.phase == 3 and sim.now > self.deadline:
            sim.blocked.clear()
            sim.clients_paused = False
            self.phase = 0  # again, as long as the run lasts


class LostRewrite(_Script):
    def __init__(self, sim: Simulation) -> None:
        super().__init__(sim)
        self.old = 0  # the leader cut off
        self.old_last = 0  # its last index once its own tail was on disk
        self.deadline = 0.0

    def step(self) -> None:
        sim = self.sim
        if self.phase == 0:
            lead = self.leader()
            if lead is None or sim.stats["acked"] < 5:
                return
            self.old = lead.nid
            sim.cut([{self.old}])
            for _ in range(self.rng.randrange(2, 6)):
                sim.spawn_client(lead, sim.client_write(lead))
            sim.trace(f"scenario: leader n{self.old} cut off alone, writing")
            self.deadline = sim.now + self.rng.uniform(0.25, 0.5)
            self.phase = 1
        elif self.phase == 1 and sim.now > self.deadline:
            old = sim.hosts.get(self.old)
            lead = self.leader()
            if old is None or lead is None or lead.nid == self.old:
                return
            self.old_last = old.node._raft.log.last_index()
            if lead.node._raft.log.committed < self.old_last:
                sim.spawn_client(lead, sim.client_write(lead))
                return
            sim.blocked.clear()
            sim.trace(f"scenario: heal; n{lead.nid} leads, n{self.old} held up to {self.old_last}")
            self.deadline = sim.now + 1.0
            self.phase = 2
        elif self.phase == 2:
            old = sim.hosts.get(self.old)
            lead = self.leader()
            if old is None or lead is None or sim.now > self.deadline:
                self.phase = 0
                return
            lr = lead.node._raft
            pr = lr._progress.get(self.old)
            o = old.node._raft
            term = lr._safe_term(self.old_last)  # 0: compacted already
            if term == 0:
                self.phase = 0
                return
            if (
                pr is not None
                and pr.match >= self.old_last
                and o.log.match_term(self.old_last, term)
            ):
                sim.trace(f"scenario: n{self.old} took the new tail; loses power")
                sim.crash(self.old, self.rng.uniform(0.002, 0.01))
                # No new writes meanwhile: the leader's appends would rewrite
                # the restarted node's old tail before a heartbeat names a
                # commit index inside it (the moment the bug needs).
                sim.clients_paused = True
                self.deadline = sim.now + 0.3
                self.phase = 3
        elif self.phase == 3 and sim.now > self.deadline:
            sim.clients_paused = False
            self.phase = 0  # again, as long as the run lasts


class LostMajority(_Script):
    def __init__(self, sim: Simulation) -> None:
        super().__init__(sim)
        self.old = 0
        self.old_commit = 0
        self.deadline = 0.0

    def step(self) -> None:
        sim = self.sim
        if self.phase == 0:
            lead = self.leader()
            if lead is None or sim.stats["acked"] < 5 + self.rng.randrange(20):
                return
            self.old = lead.nid
            self.old_commit = lead.node._raft.log.committed
            others = [v for v in lead.node._raft.config.voters if v != self.old]
            sim.cut([{self.old}])
            sim.trace(f"scenario: n{self.old} cut off; {others} lose power")
            for v in others:
                sim.crash(v, self.rng.uniform(0.005, 0.05))
            self.deadline = sim.now + 2.0
            self.phase = 1
        elif self.phase == 1:
            lead = self.leader()
            if sim.now > self.deadline:
                sim.blocked.clear()
                self.phase = 3
                return
            if lead is None or lead.nid == self.old:
                return
            lr = lead.node._raft
            if lr.log.committed <= self.old_commit + 2:
                sim.spawn_client(lead, sim.client_write(lead))
                return
            sim.blocked.clear()
            sim.trace(f"scenario: heal; n{lead.nid} leads at {lr.log.committed}")
            self.deadline = sim.now + self.rng.uniform(0.5, 1.5)
            self.phase = 2
        elif self.phase in (2, 3) and sim.now > self.deadline:
            self.phase = 0  # again, as long as the run lasts


SCENARIOS: dict[str, Callable[[Simulation], Callable[[], None]]] = {
    "lost-majority": LostMajority,
    "lost-rewrite": LostRewrite,
    "stale-snapshot": StaleSnapshot,
    "figure8": Figure8,
    "conf-replay": ConfReplay,
    "learner-vote": LearnerVote,
}
