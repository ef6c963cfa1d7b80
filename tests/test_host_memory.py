"""Host memory: the CPU runner's allocator setting (safe to apply repeatedly, harmless to torch),
and the check that KV pools fit the host."""

import logging
import platform

import pytest
import torch

from pagedserve.workers.model.host_memory import check_pools_fit_host, host_memory_info, retain_freed_host_memory


def test_retain_freed_host_memory_is_idempotent_and_keeps_torch_working():
    first = retain_freed_host_memory()
    assert retain_freed_host_memory() is first
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert first is True
    for _ in range(3):  # large buffers allocated and freed again come back intact
        x = torch.ones(2048, 1408)
        assert float(x.sum()) == 2048 * 1408
        del x


GiB = 1 << 30


def test_host_memory_info_reads_what_this_linux_host_has():
    info = host_memory_info()
    if platform.system() != "Linux":
        assert info is None
        return
    assert 0 < info["MemAvailable"] and info.get("SwapFree", 0) >= 0


def test_pools_past_memory_and_swap_are_refused_and_pools_in_swap_warned_of(caplog):
    """Past the available memory and free swap: refused, naming the pools and both figures.
    Past the memory alone: a warning, as the pools would partly be in swap. Within it: quiet."""
    pools = "10 device blocks on the CPU: engine.kv_cache_memory_gb 6"
    with pytest.raises(ValueError) as refused:
        check_pools_fit_host(6 * GiB, pools, {"MemAvailable": 4 * GiB, "SwapFree": 1 * GiB})
    assert str(refused.value) == (f"the KV pools would take 6.00 GiB of host memory ({pools}), more than the 4.00 GiB "
                                  "this node has available and its 1.00 GiB of free swap: lower them")
    with pytest.raises(ValueError, match=r"than the 4\.00 GiB this node has available: lower them"):
        check_pools_fit_host(6 * GiB, pools, {"MemAvailable": 4 * GiB, "SwapFree": 0})
    with caplog.at_level(logging.WARNING, logger="pagedserve.workers.model.host_memory"):
        check_pools_fit_host(6 * GiB, pools, {"MemAvailable": 4 * GiB, "SwapFree": 4 * GiB})
        assert [record.getMessage() for record in caplog.records] == [
            f"the KV pools take 6.00 GiB of host memory ({pools}), more than the 4.00 GiB available: "
            "part of them will be in swap"]
        caplog.clear()
        check_pools_fit_host(4 * GiB, pools, {"MemAvailable": 4 * GiB})
        assert not caplog.records


def test_an_engine_refuses_kv_pools_this_host_cannot_hold_before_making_them(tiny_model):
    """A CPU pool larger than the host's memory and swap is refused before it is zeroed (which
    would have the OOM killer end the process with no message), naming the setting."""
    from pagedserve import LLM

    info = host_memory_info()
    if info is None:
        pytest.skip("no /proc/meminfo here")
    too_much = (info["MemAvailable"] + info.get("SwapFree", 0)) / GiB + 8
    with pytest.raises(ValueError, match=rf"device blocks on the CPU: engine.kv_cache_memory_gb {too_much:g}; "
                                         r"\d+ host blocks: engine.swap_space_gb 0.25\), more than the"):
        LLM(tiny_model("llama"), kv_cache_memory_gb=too_much)
    with pytest.raises(ValueError, match=rf"engine.swap_space_gb {too_much:g}\), more than the"):
        LLM(tiny_model("llama"), swap_space_gb=too_much, num_device_blocks=64)
