"""One frontend, several engines (``frontend.engines``), against real ZeroMQ sockets driven by
the tests (``FakeScheduler``): an engine that announces another model than the first is refused
by address, and the frontend says so rather than serve a mix; rids are unique across engines."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
from fake_scheduler import FakeScheduler, model_info

from frontend.engines import EngineGroup


async def test_an_engine_serving_another_model_is_refused_by_address(tmp_path: Path) -> None:
    first, second = f"ipc://{tmp_path}/engine0", f"ipc://{tmp_path}/engine1"
    other = msgspec.structs.replace(model_info(), name="other", max_model_len=1024)
    async with FakeScheduler(first), FakeScheduler(second, other):
        group = EngineGroup.connect([first, second])
        await group.start()
        try:
            async with asyncio.timeout(10):
                await group.all_ready()
            error = group.engine_error
            assert error is not None
            assert f"the engine at {second} serves 'other'" in error and f"the one at {first} 'fake'" in error
            assert "max model len 1024" in error and "must serve the same model" in error
            assert group.model is not None and group.model.name == "fake"  # never the refused one's
            assert 1 in group.refused and 0 not in group.refused
        finally:
            await group.close()


async def test_engines_serving_one_model_share_a_rid_space(tmp_path: Path) -> None:
    addresses = [f"ipc://{tmp_path}/engine{i}" for i in range(2)]
    async with FakeScheduler(addresses[0]), FakeScheduler(addresses[1]):
        group = EngineGroup.connect(addresses)
        await group.start()
        try:
            async with asyncio.timeout(10):
                await group.all_ready()
            assert group.engine_error is None and not group.refused
            assert len({group.engines[i % 2].next_rids(3) for i in range(10)}) == 10
        finally:
            await group.close()
