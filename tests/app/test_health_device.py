"""``/health`` reports a lost device: once the runtime says its device can no longer
run programs (the CPU device process died), the server answers 503 with the reason."""

from __future__ import annotations

import trio
from http_fakes import FakeRuntime, TinyCodec
from http_harness import client_for, running_server

from app import AppSettings


async def test_health_reports_a_lost_device(codec: TinyCodec) -> None:
    runtime = FakeRuntime(codec)
    with trio.fail_after(20):
        async with running_server(runtime, AppSettings()) as server, \
                client_for(server) as client:
            healthy = await client.get("/health")
            runtime.device_fault = "the cpu device process (pid 7) was killed by SIGKILL"
            lost = await client.get("/health")
    assert healthy.status_code == 200
    assert lost.status_code == 503
    assert lost.json() == {"status": "unhealthy",
                           "error": "the cpu device process (pid 7) was killed by SIGKILL"}
