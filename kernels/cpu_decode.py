"""Paged decode attention for float32 CPU tensors in C, built with the system compiler on first use.

One query per sequence reads its context (the part its sliding window covers) straight from
the cache blocks: no gathered copy of K/V, no padding, one pass over the memory. Scale,
soft-capped logits and attention sinks are per call. Sequences are spread over torch's OpenMP
threads (the library links the ``libgomp`` that torch has already loaded).

``load()`` compiles the source once per machine and source version into the user cache
(``$PAGEDSERVE_CACHE_DIR`` or ``~/.cache/pagedserve``) and returns None when that is not
possible (no C compiler, not Linux, a failed build) or when ``PAGEDSERVE_NATIVE_KERNELS=0``;
callers then use the torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV_SWITCH = "PAGEDSERVE_NATIVE_KERNELS"

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Dot product over 8 interleaved partial sums: vectorises without reassociation. */
static inline float dot(const float *a, const float *b, int n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
    float tail = 0;
    for (; i < n; ++i) tail += a[i] * b[i];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
}

/* One sequence's query heads against its last n = min(len, window) positions. A
   position's score is q.k * scale, soft-capped when softcap > 0; a head's sink logit (when
   sinks is not NULL) joins its softmax denominator. */
static void attend_one(const float *q, int64_t q_head_stride, const float *k_cache,
                       const float *v_cache, const int32_t *table, int len, float *out,
                       int64_t out_head_stride, int num_heads, int num_kv_heads, int head_dim,
                       int block_size, float scale, float softcap, const float *sinks, int window,
                       float *scores, float *acc) {
    if (len <= 0) {  /* a padded row: no context, zeros */
        for (int h = 0; h < num_heads; ++h)
            for (int d = 0; d < head_dim; ++d) out[h * out_head_stride + d] = 0;
        return;
    }
    const int group = num_heads / num_kv_heads;
    const int64_t row = (int64_t)num_kv_heads * head_dim;
    const int start = window > 0 && len > window ? len - window : 0;
    const int n = len - start;
    for (int i = 0; i < n; ++i) {
        const int pos = start + i;
        const float *k = k_cache + ((int64_t)table[pos / block_size] * block_size + pos % block_size) * row;
        for (int h = 0; h < num_heads; ++h) {
            float s = dot(q + h * q_head_stride, k + (h / group) * head_dim, head_dim) * scale;
            if (softcap > 0) s = softcap * tanhf(s / softcap);
            scores[(int64_t)h * n + i] = s;
        }
    }
    for (int h = 0; h < num_heads; ++h) {
        float *s = scores + (int64_t)h * n;
        float max = s[0];
        for (int i = 1; i < n; ++i) max = s[i] > max ? s[i] : max;
        if (sinks) max = sinks[h] > max ? sinks[h] : max;
        double sum = 0;
        for (int i = 0; i < n; ++i) {
            s[i] = expf(s[i] - max);
            sum += s[i];
        }
        if (sinks) sum += expf(sinks[h] - max);
        const float inv = (float)(1.0 / sum);
        for (int i = 0; i < n; ++i) s[i] *= inv;
    }
    for (int i = 0; i < num_heads * head_dim; ++i) acc[i] = 0;
    for (int i = 0; i < n; ++i) {
        const int pos = start + i;
        const float *v = v_cache + ((int64_t)table[pos / block_size] * block_size + pos % block_size) * row;
        for (int h = 0; h < num_heads; ++h) {
            const float p = scores[(int64_t)h * n + i];
            const float *vh = v + (h / group) * head_dim;
            float *a = acc + h * head_dim;
            for (int d = 0; d < head_dim; ++d) a[d] += p * vh[d];
        }
    }
    for (int h = 0; h < num_heads; ++h)
        for (int d = 0; d < head_dim; ++d) out[h * out_head_stride + d] = acc[h * head_dim + d];
}

/* window <= 0: no window; softcap <= 0: no soft-cap; sinks NULL: no sinks. */
int pagedserve_decode_attention_f32(
    const float *q, int64_t q_token_stride, int64_t q_head_stride,
    const float *k_cache, const float *v_cache,
    const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
    const int64_t *order, float *out, int64_t out_token_stride, int64_t out_head_stride,
    int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
    float scale, float softcap, const float *sinks, int window, int num_threads) {
    int max_len = 1;
    for (int i = 0; i < num_seqs; ++i) {
        const int n = window > 0 && seq_lens[i] > window ? window : seq_lens[i];
        max_len = n > max_len ? n : max_len;
    }
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)num_heads * max_len);
        float *acc = malloc(sizeof(float) * (size_t)num_heads * head_dim);
        failed = scores == NULL || acc == NULL;
        #pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < num_seqs; ++i) {
            if (failed) continue;
            const int64_t seq = order ? order[i] : i;
            attend_one(q + seq * q_token_stride, q_head_stride, k_cache, v_cache,
                       block_tables + seq * table_stride, seq_lens[seq],
                       out + seq * out_token_stride, out_head_stride, num_heads, num_kv_heads,
                       head_dim, block_size, scale, softcap, sinks, window, scores, acc);
        }
        free(scores);
        free(acc);
    }
    return failed;
}
"""


def _compile_flags() -> list[str]:
    flags = ["-O3", "-std=c11", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno"]
    if platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"):
        flags.append("-march=native")
    return flags


def _cpu_signature() -> str:
    """What the compiled code depends on besides the source: compiler flags and CPU features."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        features = sorted({line for line in cpuinfo.splitlines()
                           if line.startswith(("flags", "Features", "model name"))})
    except OSError:
        features = []
    return "\n".join([platform.machine(), *_compile_flags(), *features])


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDSERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "pagedserve")
    return Path(root) / "kernels"


def _build(target: Path, compiler: str) -> None:
    """Compile into a temporary file and move it into place (safe across processes)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as workdir:
        source = Path(workdir) / "cpu_decode.c"
        source.write_text(_SOURCE)
        built = Path(workdir) / target.name
        subprocess.run([compiler, *_compile_flags(), str(source), "-o", str(built), "-lm"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(built, target)


@functools.cache
def load():
    """The compiled decode function, or None (see the module docstring)."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or platform.system() != "Linux":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    digest = hashlib.sha256((_SOURCE + _cpu_signature() + compiler).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_decode_{digest}.so"
    try:
        if not target.is_file():
            _build(target, compiler)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("native CPU decode attention unavailable, using torch ops: %s", detail)
        return None
    function = library.pagedserve_decode_attention_f32
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    f32 = ctypes.c_float
    function.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64,
                         i32, i32, i32, i32, i32, f32, f32, ptr, i32, i32]
    function.restype = i32
    return function


def supports_cache(k_cache: torch.Tensor) -> bool:
    """Whether the native kernel runs on caches like ``k_cache`` (float32, CPU) here."""
    return k_cache.dtype == torch.float32 and k_cache.device.type == "cpu" and load() is not None


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float, out,
                     order: torch.Tensor | None = None, *, sliding_window: int | None = None,
                     logit_softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
    """Write into ``out`` the attention of ``q`` ``[n, num_heads, head_dim]`` (one query
    per sequence, at position ``seq_lens[i] - 1``) over the last ``sliding_window`` (all
    without a window) of each sequence's ``seq_lens[i]`` cached positions; a sequence of
    length 0 (a padded row) gets zeros.

    Scores are ``q.k * scale``, then ``logit_softcap * tanh(score / logit_softcap)`` with a
    soft-cap; ``sinks`` (``[num_heads]``) adds one logit per head to the softmax
    denominator. Only the table entries of blocks holding those positions are read; they
    must be already checked against the cache, and ``block_tables`` and ``seq_lens`` be
    contiguous int32. ``order`` (int64) is the order to hand sequences to threads.
    """
    function = load()
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return
    _, block_size, num_kv_heads, _ = k_cache.shape
    if out.stride(-1) != 1:
        raise ValueError("out must have a contiguous last dimension")
    if sinks is not None:
        sinks = sinks.to(device="cpu", dtype=torch.float32).contiguous()
    failed = function(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
        None if order is None else order.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, float(scale),
        0.0 if logit_softcap is None else float(logit_softcap),
        None if sinks is None else sinks.data_ptr(),
        0 if sliding_window is None else min(int(sliding_window), 2**31 - 1),
        torch.get_num_threads())
    if failed:
        raise MemoryError("native decode attention could not allocate its scratch buffers")
