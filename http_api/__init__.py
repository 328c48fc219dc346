"""http_api: the /v1 produce/consume API every node serves next to /raft/*
(:mod:`http_api.app`), its error table (:mod:`http_api.errors`), the OpenAPI
document (:mod:`http_api.openapi`), the node server (:mod:`http_api.server`)
and Python clients (:mod:`http_api.client`)."""
