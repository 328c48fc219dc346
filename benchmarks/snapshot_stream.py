"""Time one chunked snapshot transfer between two OS processes on 127.0.0.1.

The sender (this process) and the receiver (a child process) each run the
real TcpTransport (HMAC-authenticated frames) and SnapshotStreams, exactly
as two nodes do, without Raft or storage around them: the number is the
cost of the stream itself (chunk encoding, framing, MAC, reassembly, CRCs).

    .venv/bin/python -m benchmarks.snapshot_stream --mb 200 [--chunk-kib 1024 --window 4]

Prints one JSON line: bytes, seconds, MB/s, chunk settings and counters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

from dledger.cluster import free_ports
from dledger.core.types import ClusterConfig, Message, MsgType, Snapshot, SnapshotMeta
from dledger.snapshot_stream import SnapshotStreams, StreamSettings
from dledger.transport.tcp import TcpTransport

SECRET = b"benchmark-secret-0123456789"
META = SnapshotMeta(1000, 1, 0, ClusterConfig((1, 2), ()))
SENDER, RECEIVER = 1, 2


def _settings(a: argparse.Namespace) -> StreamSettings:
    return StreamSettings(chunk_bytes=a.chunk_kib << 10, window_chunks=a.window, timeout_s=30)


async def _receiver(a: argparse.Namespace) -> None:
    done = asyncio.Event()
    got: list[Message] = []

    def deliver(m: Message) -> None:
        got.append(m)
        done.set()

    tr: TcpTransport | None = None

    def send(to: int, b: bytes) -> bool:
        return tr is not None and tr.send(to, b)

    streams = SnapshotStreams(RECEIVER, _settings(a), send, deliver, lambda p: None, {})
    tr = TcpTransport(
        RECEIVER,
        "bench",
        "127.0.0.1",
        a.recv_port,
        {SENDER: ("127.0.0.1", a.send_port)},
        SECRET,
        streams.on_frame,
    )
    await tr.start()
    print("ready", flush=True)
    await done.wait()
    await asyncio.sleep(0.5)  # let the DONE ack leave
    print(json.dumps({"received_bytes": len(got[0].snapshot_data)}), flush=True)
    await tr.stop()


async def _sender(a: argparse.Namespace) -> None:
    send_port, recv_port = free_ports(2, "127.0.0.1")
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.snapshot_stream",
            "--role",
            "recv",
            "--send-port",
            str(send_port),
            "--recv-port",
            str(recv_port),
            "--chunk-kib",
            str(a.chunk_kib),
            "--window",
            str(a.window),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"ready"
        payload = os.urandom(a.mb << 20)
        failed: list[int] = []
        counters: dict[str, int] = {}
        tr: TcpTransport | None = None

        def send(to: int, b: bytes) -> bool:
            return tr is not None and tr.send(to, b)

        streams = SnapshotStreams(
            SENDER, _settings(a), send, lambda m: None, failed.append, counters
        )
        tr = TcpTransport(
            SENDER,
            "bench",
            "127.0.0.1",
            send_port,
            {RECEIVER: ("127.0.0.1", recv_port)},
            SECRET,
            streams.on_frame,
        )
        await tr.start()
        msg = Message(MsgType.SNAPSHOT, RECEIVER, SENDER, 1, META.term, META.index, snapshot=META)
        t0 = time.monotonic()
        streams.send_snapshot(msg, Snapshot(META, payload))
        while counters["snapshots_sent"] == 0 and not failed:
            await asyncio.sleep(0.005)
        dt = time.monotonic() - t0
        await tr.stop()
        line = child.stdout.readline()
        out = {
            "bytes": len(payload),
            "ok": not failed,
            "seconds": round(dt, 3),
            "mb_per_s": round(len(payload) / dt / 1e6, 1),
            "chunk_kib": a.chunk_kib,
            "window_chunks": a.window,
            "receiver": json.loads(line) if line else None,
            **{k: v for k, v in counters.items() if k.startswith("snapshot")},
        }
        print(json.dumps(out))
    finally:
        child.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--role", choices=["send", "recv"], default="send")
    p.add_argument("--mb", type=int, default=200)
    p.add_argument("--chunk-kib", type=int, default=1024)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--send-port", type=int, default=0)
    p.add_argument("--recv-port", type=int, default=0)
    a = p.parse_args()
    asyncio.run(_receiver(a) if a.role == "recv" else _sender(a))


if __name__ == "__main__":
    main()
