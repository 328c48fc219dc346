"""The controller group's state machine: broker groups, their liveness, and
topic routes (topic -> queues -> owning group), replicated by its own Raft
group (the same ``dledger`` core, storage and transport as a broker group).

Like ``broker_adapter`` it is deterministic over committed entries and does
no I/O; the controller node process (its HTTP API, the leader's clock ticks)
is composed in ``dledger_app.controller_node``.
"""
