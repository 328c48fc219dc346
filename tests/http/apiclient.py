"""A JSON client for the /v1 API of a LocalCluster (stdlib HTTP)."""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dledger.cluster import HTTP_ERRORS, LocalCluster, http_request
from tests.http.conformance import Conformance

START_TIMEOUT_S = 60.0


class ApiCluster(LocalCluster):
    """LocalCluster plus a JSON client that follows the leader."""

    __test__ = False

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.leader_hint: int | None = None
        self.token: str | None = None  # bearer token for call(), when auth is on
        self._conformance: Conformance | None = None

    def conformance(self) -> Conformance | None:
        """/openapi.json of the cluster (fetched once), None while no node answers."""
        if self._conformance is None:
            for nid in self.ids():
                try:
                    r = http_request(self.http(nid), "GET", "/openapi.json", timeout_s=5)
                except HTTP_ERRORS:
                    continue
                if r.status == 200:
                    self._conformance = Conformance(r.json())
                    break
        return self._conformance

    def _node_of(self, address: str) -> int:
        for m in self.spec.members:
            if m.http_address == address:
                return m.id
        return 0

    def call(
        self,
        method: str,
        path: str,
        body: object | None = None,
        via: int | None = None,
        timeout_s: float = 5.0,
        follow: bool = True,
    ) -> tuple[int, Any]:
        """(status, JSON body); status 0 means the connection failed (the
        request may or may not have reached the node). Every answer, the
        307s followed included, must conform to /openapi.json."""
        nid = via or self.leader_hint or self.ids()[0]
        address = self.http(nid)
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        for _ in range(4):
            try:
                r = http_request(address, method, path, data, timeout_s=timeout_s, headers=headers)
            except HTTP_ERRORS as exc:
                return 0, {"error": {"code": "CONNECTION", "message": repr(exc)}}
            conf = self.conformance()
            if conf is not None:
                conf.check(method, path, r.status, r.headers, r.body)
            if r.status == 307 and follow:
                address = urllib.parse.urlsplit(r.headers["location"]).netloc
                continue
            if r.status < 300 and via is None and method != "GET":
                self.leader_hint = self._node_of(address)
            return r.status, r.json()
        return 0, {"error": {"code": "REDIRECT_LOOP", "message": path}}

    def refresh_leader(self) -> None:
        lead = self.leader()
        if lead is not None:
            self.leader_hint = lead

    def wait_leader(
        self, timeout_s: float = START_TIMEOUT_S, among: Any = None, poll_s: float = 0.1
    ) -> int:
        lead = super().wait_leader(timeout_s, among, poll_s)
        self.leader_hint = lead
        return lead


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(poll_s)
