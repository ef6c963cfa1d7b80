"""Which compiled variants of pagedserve's Triton kernels the launches ask for, on any device.

Triton compiles a kernel once per *specialisation* of a launch: the dtypes and 16-byte
alignment of its tensors, its constexprs, its options (``num_warps``), and whether each
integer argument is 1 or a multiple of 16 (unless the kernel says ``do_not_specialize``).
A launch whose specialisation is new compiles, for a second or so, inside whatever step
made it. ``TritonVariants`` records each launch's specialisation with Triton's own binder
for a CUDA target, so the same record comes from compiled kernels on a GPU and from the
interpreter (``TRITON_INTERPRET=1``) on the CPU, where nothing compiles.

    with TritonVariants() as variants:
        load()                   # what should compile every variant
        variants.mark("served")
        serve()
    assert variants.new_in("served") == {}
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

# The GPU the specialisations are computed for. Only its backend's rules matter (which
# arguments specialise, and how), not the architecture.
_TARGET = ("cuda", 90, 32)


def launched_kernels() -> dict:
    """The Triton kernels ``pagedserve.kernels`` launches, by name (imports Triton)."""
    from pagedserve.kernels import triton_attention_kernels, triton_cache_kernels, triton_lora_kernels

    return {name: getattr(module, name)
            for module in (triton_attention_kernels, triton_cache_kernels, triton_lora_kernels)
            for name in dir(module) if name.endswith("_kernel")}


def compiled_variants() -> int | None:
    """How many variants of those kernels Triton has compiled in this process (its own
    caches: on a GPU; None without Triton, or under its interpreter, which compiles nothing)."""
    try:
        kernels = launched_kernels()
    except ImportError:
        return None
    total = 0
    for kernel in kernels.values():
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            return None
        total += sum(len(cache[0]) for cache in caches.values())
    return total


def cuda_binder(kernel) -> tuple:
    """(the JIT function, Triton's binder for a CUDA target) of ``kernel``, compiled or
    interpreted: the binder maps a launch's arguments to its specialisation."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    # Interpreted kernels keep their decorator's arguments: rebuild the JIT function.
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
    return jit, create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget(*_TARGET)))


def specialisation_mismatch(kernel, arg_types: dict, constexprs: dict, target, args, kwargs
                            ) -> tuple[set[str], set[str]]:
    """Where ``triton_compile_check``'s specialisation of ``kernel`` (``arg_types``,
    ``constexprs``, for ``target``) and a real launch's (``args``, ``kwargs``) differ: the
    parameters specialised to the constant 1 by one of them only, and the ones specialised as
    16-byte aligned by one of them only (both empty: it compiled what the launch runs)."""
    from pagedserve.kernels.triton_compile import launch_specialisation

    jit, binder = cuda_binder(kernel)
    _, at_launch, _ = binder(*args, **kwargs)
    names = [param.name for param in jit.params]
    launch_ones = {n for n, (kind, value) in zip(names, at_launch)
                   if kind == "constexpr" and value == 1 and n not in constexprs}
    launch_aligned = {n for n, (kind, attr) in zip(names, at_launch) if kind != "constexpr" and attr == "D"}
    _, constants, attrs = launch_specialisation(jit, arg_types, constexprs, target)
    return ({n for n in constants if n not in constexprs} ^ launch_ones,
            {names[index] for index, in attrs} ^ launch_aligned)


class TritonVariants:
    """Records, per kernel, each specialisation launched and the phase it was first seen in
    (``mark`` starts a phase; the first is ``"start"``), and the launches per phase."""

    def __init__(self) -> None:
        self.phase = "start"
        self.first_seen: dict[str, dict[tuple, str]] = {}
        self.launches: Counter[tuple[str, str]] = Counter()  # (kernel, phase)
        self._hooks: list[tuple[object, Callable]] = []

    def __enter__(self) -> "TritonVariants":
        for name, kernel in launched_kernels().items():
            jit, binder = cuda_binder(kernel)
            hook = self._recorder(name, binder, list(jit.signature.parameters))
            kernel.add_pre_run_hook(hook)
            self._hooks.append((kernel, hook))
        return self

    def __exit__(self, *exc) -> None:
        for kernel, hook in self._hooks:
            kernel.pre_run_hooks.remove(hook)
        self._hooks.clear()

    def _recorder(self, name: str, binder, arg_names: list[str]) -> Callable:
        def record(*args, **kwargs) -> None:
            _, specialisation, options = binder(*args, **kwargs)
            key = (tuple(zip(arg_names, map(str, specialisation))), tuple(sorted(options.items())))
            self.first_seen.setdefault(name, {}).setdefault(key, self.phase)
            self.launches[name, self.phase] += 1
        return record

    def mark(self, phase: str) -> None:
        self.phase = phase

    def launched_in(self, phase: str) -> set[str]:
        """The kernels launched in ``phase``."""
        return {name for name, seen in self.launches if seen == phase}

    def new_in(self, phase: str) -> dict[str, list[list[tuple[str, str]]]]:
        """Per kernel, the variants first seen in ``phase``, each as the arguments whose
        specialisation differs from the kernel's first variant (none: it is the first)."""
        new = {}
        for name, keys in self.first_seen.items():
            first = next(iter(keys))
            diffs = [[pair for pair, base in zip(key[0] + key[1], first[0] + first[1]) if pair != base]
                     for key, seen in keys.items() if seen == phase]
            if diffs:
                new[name] = diffs
        return new
