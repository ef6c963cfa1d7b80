"""cluster/detached.py: what it starts sees none of its starter's context (Ray keeps the task id
whose cancellation reaches a call there), and still runs when its starter is cancelled."""

import asyncio
import contextvars

from pagedserve.cluster.detached import call_soon_detached, start_detached

STARTER = contextvars.ContextVar("starter", default=None)


def test_a_detached_task_sees_no_context_of_its_starter_and_outlives_it():
    async def main():
        seen = asyncio.get_running_loop().create_future()

        async def detached_work():
            await asyncio.sleep(0.01)   # the starter is cancelled meanwhile
            seen.set_result(STARTER.get())

        async def starter():
            STARTER.set("request-1")
            task = start_detached(asyncio.get_running_loop(), detached_work(), name="work")
            assert task.get_name() == "work"
            await asyncio.sleep(10)

        starting = asyncio.create_task(starter())
        await asyncio.sleep(0)
        starting.cancel()
        return await asyncio.wait_for(seen, 5)

    assert asyncio.run(main()) is None


def test_a_detached_callback_sees_no_context_of_its_caller():
    async def main():
        seen = asyncio.get_running_loop().create_future()
        STARTER.set("request-2")
        call_soon_detached(asyncio.get_running_loop(), lambda x: seen.set_result((x, STARTER.get())), 7)
        return await seen

    assert asyncio.run(main()) == (7, None)
