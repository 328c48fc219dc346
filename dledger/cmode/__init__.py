"""Controller mode: RocketMQ 5's replication for a broker group, beside Raft.

A broker group replicates in one of two modes. ``raft`` (the default,
:mod:`dledger.core`): quorum commit, elections inside the group, a leader
lease. ``controller`` (this package, from RocketMQ 5's design): one master
writes the CommitLog and pushes it to slaves; the **controller group**
elects masters and records each group's **SyncStateSet** (the replicas
close enough to the master to take over); the **confirm offset** (how far
consumers may read and producers are acknowledged) follows the
acknowledgements of the SyncStateSet under the seed's settings
(``all_ack_in_sync_state_set``, ``in_sync_replicas``,
``min_in_sync_replicas``, ``enable_auto_in_sync_replicas``,
``enable_elect_unclean_master``); every new master starts a new **epoch**
recorded in each replica's epoch file, and a slave joining a master
truncates its log to the last point both agree on.

Pure parts, without I/O (the driver feeds them and acts on what they say):

- :mod:`dledger.cmode.epochs`: the epoch map and file, the last consistent
  point, the six join cases;
- :mod:`dledger.cmode.master`: SyncStateSet requests and the confirm offset;
- :mod:`dledger.cmode.election`: the controller's choice of a new master.
"""
