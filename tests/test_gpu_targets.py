"""Dtype per device and the GPU generations the kernels support, with a stubbed device
capability (there is no GPU here): bf16 where the GPU has it natively, fp16 on other GPUs,
fp32 on CPU, an explicit ``engine.dtype`` always wins, and a kernel variant that cannot run on
the GPU is refused when the model loads, not at its first request."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

from pagedserve.kernels import gpu_targets
from pagedserve.kernels.gpu_targets import UnsupportedOnDeviceError, check_dtype, target_for
from pagedserve.workers.model import model_runner
from pagedserve.workers.model.model_runner import resolve_dtype

CUDA = torch.device("cuda:0")
T4, A100, A10G, L4, H100 = (7, 5), (8, 0), (8, 6), (8, 9), (9, 0)
NAMES = {T4: "Tesla T4", A100: "NVIDIA A100-SXM4-40GB", A10G: "NVIDIA A10G", L4: "NVIDIA L4", H100: "NVIDIA H100"}


@pytest.fixture
def fake_gpu(monkeypatch):
    """``fake_gpu(capability)``: torch.cuda answers as that GPU would (no CUDA needed)."""

    def install(capability: tuple[int, int]) -> None:
        def is_bf16_supported(including_emulation: bool = True) -> bool:
            # torch's own rule: native from sm_80; older GPUs "support" bf16 only by emulation.
            return capability >= (8, 0) or including_emulation

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: NAMES[capability])

    return install


@pytest.mark.parametrize("capability, expected", [
    (T4, torch.float16), (A100, torch.bfloat16), (A10G, torch.bfloat16), (L4, torch.bfloat16),
    (H100, torch.bfloat16)])
def test_auto_dtype_is_bf16_only_where_the_gpu_has_it(fake_gpu, capability, expected):
    fake_gpu(capability)
    assert resolve_dtype(None, CUDA) == expected
    assert resolve_dtype("auto", CUDA) == expected


def test_auto_dtype_is_fp32_on_cpu_and_an_explicit_dtype_always_wins(fake_gpu):
    fake_gpu(T4)
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        assert resolve_dtype(name, CUDA) == dtype
        assert resolve_dtype(name, torch.device("cpu")) == dtype
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8", CUDA)


def test_targets_cover_every_generation_a_launcher_names():
    assert sorted(gpu_targets.GPU_TARGETS) == [75, 80, 86, 89, 90]
    assert target_for((12, 0)).max_shared_bytes == target_for(H100).max_shared_bytes  # newer: as sm_90
    assert target_for((8, 7)).arch == 87 and target_for((8, 7)).max_shared_bytes == target_for(A10G).max_shared_bytes
    with pytest.raises(UnsupportedOnDeviceError, match="sm_70"):
        target_for((7, 0))


def test_bf16_is_refused_before_sm80_naming_the_fix():
    with pytest.raises(UnsupportedOnDeviceError, match=r"sm_75 .*T4.*engine.dtype: float16"):
        check_dtype(T4, torch.bfloat16)
    for capability in (A100, A10G, L4, H100):
        check_dtype(capability, torch.bfloat16)
    check_dtype(T4, torch.float16)


def test_the_worker_refuses_bf16_on_a_t4_before_loading_weights(fake_gpu, monkeypatch, tiny_model):
    fake_gpu(T4)
    monkeypatch.setattr(model_runner, "select_backend", lambda device: "triton")
    from transformers import AutoConfig, AutoModelForCausalLM

    def never(*args, **kwargs):
        raise AssertionError("the refusal must come before the model is read")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", never)
    monkeypatch.setattr(AutoConfig, "from_pretrained", never)
    with pytest.raises(UnsupportedOnDeviceError, match="bfloat16 needs sm_80"):
        model_runner.ModelRunner(tiny_model("llama"), dtype="bfloat16", device="cuda")
    # The torch backend has no such limit: the check is the Triton kernels'.
    monkeypatch.setattr(model_runner, "select_backend", lambda device: "torch")
    with pytest.raises(AssertionError, match="before the model is read"):
        model_runner.ModelRunner(tiny_model("llama"), dtype="bfloat16", device="cuda")


_OVERRUNS = """
import json, torch
from pagedserve.kernels.gpu_targets import shared_memory_overruns, check_shared_memory, UnsupportedOnDeviceError
result = {"a10g_fp32_256": shared_memory_overruns((8, 6), torch.float32, 256, 4, 64),
          "a100_fp32_256": shared_memory_overruns((8, 0), torch.float32, 256, 4, 64),
          "a10g_fp16_128": shared_memory_overruns((8, 6), torch.float16, 128, 8, 16)}
try:
    check_shared_memory((8, 9), torch.float32, 256, 4, 64)
except UnsupportedOnDeviceError as exc:
    result["l4_error"] = str(exc)
print(json.dumps(result))
"""


@pytest.mark.slow
def test_kernels_too_large_for_a_gpus_shared_memory_are_refused_at_load():
    """Compiles the kernels for real targets (Triton's ptxas; no GPU needed)."""
    done = subprocess.run([sys.executable, "-c", _OVERRUNS], env={**os.environ, "TRITON_INTERPRET": "0"},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    limit = gpu_targets.GPU_TARGETS[86].max_shared_bytes
    # Plain and with the attention variants (window, soft-cap, sinks): the same tiles.
    assert [name for name, _ in result["a10g_fp32_256"]] == ["paged_prefill_kernel",
                                                             "paged_prefill_kernel+variants"]
    assert all(shared > limit for _, shared in result["a10g_fp32_256"])
    assert result["a100_fp32_256"] == [] and result["a10g_fp16_128"] == []
    assert "sm_89" in result["l4_error"] and "paged_prefill_kernel needs" in result["l4_error"]
    assert "float16 or bfloat16" in result["l4_error"]
