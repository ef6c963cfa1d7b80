"""The in-process APIs: ``LLM`` (offline generation), ``AsyncLLMEngine`` (streaming in one process)
and chat templates."""
