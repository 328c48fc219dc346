"""The process compositions above the replication library: the `dledger`
command line (node, cluster, client commands) and the demo. `dledger/` imports
nothing from here, `broker_adapter` or `http_api`."""
