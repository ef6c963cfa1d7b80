"""Where a LoRA adapter's files are, and how the reading node gets them.

An adapter's ``lora_path`` is one of:

- a directory;
- a Hugging Face hub id (vLLM takes both as ``lora_path``), whose adapter files the node
  fetches into its hub cache (``$HF_HOME``) with its own token (``$HF_TOKEN``);
- ``hf://org/repo/folder``: a folder of a hub repo, fetched the same way (a dynamic
  adapter of a hub repo, below);
- a URI of a filesystem fsspec knows (``s3://``, ``gs://``, ``file://``, ...; the cloud ones
  need their fsspec package, s3fs or gcsfs), whose two files the node copies into
  ``$PAGEDSERVE_CACHE_DIR/lora`` (or ``~/.cache/pagedserve/lora``) once.

``DynamicAdapters`` finds adapters by name under Ray Serve LLM's ``dynamic_lora_loading_path``:
a directory, a hub repo (``org/repo`` or ``hf://org/repo``) or a URI, each adapter a folder
named after it that holds ``adapter_config.json``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from ..model.model_source import describe_node, is_hub_id, token_from_environment

ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]
CONFIG_FILE = ADAPTER_FILES[0]
HUB_SCHEME = "hf://"


class AdapterSourceError(ValueError):
    """The adapter's files cannot be had; the message says where and why."""


def is_uri(path: str) -> bool:
    """A ``scheme://`` path other than ``hf://`` (which names a hub repo's folder)."""
    return "://" in path and not path.startswith(HUB_SCHEME)


def adapter_directory(lora_path: str) -> Path:
    """A local directory holding the adapter at ``lora_path`` (module docstring): the directory
    itself, or the files fetched (or found already fetched). ``AdapterSourceError`` otherwise."""
    if lora_path.startswith(HUB_SCHEME):
        repo_id, folder = _hub_folder(lora_path)
        return _fetch_from_hub(repo_id, folder) / folder
    if is_uri(lora_path):
        return _fetch_uri(lora_path)
    directory = Path(lora_path).expanduser()
    if directory.is_dir():
        return directory
    if not is_hub_id(lora_path):
        raise AdapterSourceError("no adapter directory at lora_path")
    return _fetch_from_hub(lora_path, None)


def _hub_folder(path: str) -> tuple[str, str]:
    parts = path[len(HUB_SCHEME):].strip("/").split("/")
    if len(parts) < 3 or not all(parts):
        raise AdapterSourceError(f"{path!r} is not hf://org/repo/folder")
    return "/".join(parts[:2]), "/".join(parts[2:])


def _fetch_from_hub(repo_id: str, folder: str | None) -> Path:
    from huggingface_hub import snapshot_download

    patterns = [f"{folder}/{name}" if folder else name for name in ADAPTER_FILES]
    try:
        directory = Path(snapshot_download(repo_id=repo_id, allow_patterns=patterns, token=token_from_environment()))
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else ""
        raise AdapterSourceError(f"no adapter directory at lora_path, and as a hub id it cannot be fetched on "
                                 f"node {describe_node()} ({type(exc).__name__}: {reason})") from None
    if folder and not (directory / folder / CONFIG_FILE).is_file():
        raise AdapterSourceError(f"hub repo {repo_id!r} has no adapter in folder {folder!r} "
                                 f"(fetched on node {describe_node()})")
    return directory


def uri_cache_dir() -> Path:
    root = os.environ.get("PAGEDSERVE_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "pagedserve") / "lora"


def _fetch_uri(uri: str) -> Path:
    """The adapter's two files under ``uri``, copied once into this node's cache (a folder per
    URI, filled in a temporary sibling and renamed into place)."""
    final = uri_cache_dir() / hashlib.sha256(uri.encode()).hexdigest()[:32]
    if (final / CONFIG_FILE).is_file():
        return final
    fs, root = _filesystem(uri)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    try:
        for name in ADAPTER_FILES:
            try:
                fs.get(f"{root.rstrip('/')}/{name}", str(staging / name))
            except FileNotFoundError:
                raise AdapterSourceError(f"no {name} under lora_path on node {describe_node()}") from None
            except Exception as exc:
                raise AdapterSourceError(f"lora_path cannot be read on node {describe_node()} "
                                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
                                         ) from None
        try:
            staging.rename(final)
        except OSError:   # another reader filled it first
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _filesystem(uri: str):
    """fsspec's filesystem for ``uri`` and the path in it; a clear error for a scheme fsspec
    has no installed filesystem for."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as exc:
        raise AdapterSourceError(f"{uri.split('://')[0]}:// paths need an fsspec filesystem this node lacks "
                                 f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None


class DynamicAdapters:
    """The adapters under ``dynamic_lora_loading_path``: ``lora_path(name)`` is where adapter
    ``name`` is (a folder holding ``adapter_config.json``), or None when there is none.
    ``name`` must already be a safe folder name (no separators, no "..")."""

    def __init__(self, root: str) -> None:
        self.root = root
        if root.startswith(HUB_SCHEME) or (not is_uri(root) and not Path(root).expanduser().is_dir()
                                          and is_hub_id(root)):
            self.kind = "hub"
            self._repo_id = root[len(HUB_SCHEME):].strip("/") if root.startswith(HUB_SCHEME) else root
            if len(self._repo_id.split("/")) != 2:
                raise AdapterSourceError(f"dynamic_lora_loading_path {root!r}: a hub repo is org/repo")
        elif is_uri(root):
            self.kind = "uri"
            self._fs, self._path = _filesystem(root)
        else:
            self.kind = "directory"
            self._directory = Path(root).expanduser()

    def lora_path(self, name: str) -> str | None:
        """Raises ``AdapterSourceError`` when the place cannot be read (a hub or bucket that
        does not answer, a token it refuses)."""
        if self.kind == "directory":
            folder = self._directory / name
            return str(folder) if (folder / CONFIG_FILE).is_file() else None
        try:
            if self.kind == "uri":
                if not self._fs.exists(f"{self._path.rstrip('/')}/{name}/{CONFIG_FILE}"):
                    return None
                return f"{self.root.rstrip('/')}/{name}"
            from huggingface_hub import file_exists

            if not file_exists(self._repo_id, f"{name}/{CONFIG_FILE}", token=token_from_environment()):
                return None
            return f"{HUB_SCHEME}{self._repo_id}/{name}"
        except Exception as exc:
            reason = str(exc).splitlines()[0] if str(exc) else ""
            raise AdapterSourceError(f"dynamic_lora_loading_path {self.root!r} cannot be read "
                                     f"({type(exc).__name__}: {reason})") from None


__all__ = ["ADAPTER_FILES", "AdapterSourceError", "DynamicAdapters", "adapter_directory", "is_uri"]
