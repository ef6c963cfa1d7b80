"""``pagedserve bench``: benchmarks that measure the engine and the server.

One module per subcommand (``allocators``, ``prefix``, ``serve``,
``offline``), each with a frozen config dataclass, a ``DEFAULT_CONFIG`` (and
a ``QUICK_CONFIG``), ``run_benchmark(config, out, plot_dir)`` returning the
JSON it writes, and ``format_results`` for the terminal. Shared pieces:
``workload`` (synthetic requests), ``replay`` (drives an ``LLMEngine`` step
by step and samples it), ``fragmentation`` (the seed's alloc/free
simulation), ``report`` (percentiles, JSON, progress bar) and ``plots``.

Nothing heavy is imported here, so the CLI stays fast.
"""
