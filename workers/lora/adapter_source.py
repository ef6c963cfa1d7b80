"""Where a LoRA adapter's files are: a directory, or a Hugging Face hub id that the reading
node fetches itself (vLLM takes both as ``lora_path``), only the adapter's two files, into
the node's hub cache (``$HF_HOME``), with the node's token (``$HF_TOKEN``)."""

from __future__ import annotations

from pathlib import Path

from ..model.model_source import describe_node, is_hub_id, token_from_environment

ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]


class AdapterSourceError(ValueError):
    """The adapter's files cannot be had; the message says where and why."""


def adapter_directory(lora_path: str) -> Path:
    """A local directory holding the adapter at ``lora_path``: the directory itself, or the
    hub id's files fetched (or found in the cache, offline). ``AdapterSourceError`` otherwise."""
    directory = Path(lora_path).expanduser()
    if directory.is_dir():
        return directory
    if not is_hub_id(lora_path):
        raise AdapterSourceError("no adapter directory at lora_path")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=lora_path, allow_patterns=ADAPTER_FILES,
                                      token=token_from_environment()))
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else ""
        raise AdapterSourceError(f"no adapter directory at lora_path, and as a hub id it cannot be fetched on "
                                 f"node {describe_node()} ({type(exc).__name__}: {reason})") from None


__all__ = ["ADAPTER_FILES", "AdapterSourceError", "adapter_directory"]
