"""Where a checkpoint comes from, resolved to a local directory on the node that loads it.

``ModelSource.reference`` is one of:

* a directory: local to every node, or on shared storage mounted at the same
  path everywhere. It must exist and hold a ``config.json`` on the node that
  resolves it;
* a Hugging Face hub id (``org/name``, or ``name``), which each node fetches
  itself through ``huggingface_hub`` into its own cache (``download_dir``, else
  ``$HF_HOME``), at ``revision`` (a branch, tag or commit; default ``main``),
  with ``token`` (else ``$HF_TOKEN`` or the node's saved login). With
  ``HF_HUB_OFFLINE=1`` a node uses its cache only.

Anything that cannot be resolved raises ``ModelSourceError`` at once, naming
the node and the reason; nothing waits for a ready timeout.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path

TOKEN_ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
# huggingface_hub's own repo id rule (validate_repo_id): [namespace/]name of word characters, '-', '.'.
_HUB_ID = re.compile(r"^(?:[\w\-.]+/)?[\w\-.]+$")
# What a worker needs: configs, tokenizer files, chat templates, the checkpoint's own code
# (run only with ``model.trust_remote_code``), safetensors weights (PyTorch .bin weights only
# for a repo without safetensors). Never the duplicates (GGUF, ONNX, original/ checkpoints)
# that many repos carry too.
_CONFIG_PATTERNS = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", "tokenizer*", "*.py"]
_WEIGHT_PATTERNS = ["*.safetensors"]
_FALLBACK_WEIGHT_PATTERNS = ["*.bin"]


class ModelSourceError(ValueError):
    """The model cannot be had on this node: the message names the node and why."""


def has_weights(directory: str | Path) -> bool:
    """Whether ``directory`` holds weight files a checkpoint loads from: ``*.safetensors``, or
    PyTorch's ``*.bin`` (the files a hub id's fetch takes)."""
    directory = Path(directory)
    return any(directory.glob("*.safetensors")) or any(directory.glob("*.bin"))


def token_from_environment() -> str | None:
    """The hub token of this process's environment, if set (``HF_TOKEN`` first)."""
    for name in TOKEN_ENV_VARS:
        if os.environ.get(name):
            return os.environ[name]
    return None


def is_hub_id(reference: str) -> bool:
    """True for ``org/name`` or ``name`` that is not a path (absolute, ``./``, ``../`` or ``~``)
    and not an existing directory here; huggingface_hub's id syntax (no ``--`` or ``..``)."""
    if reference.startswith(("/", "./", "../", "~")):
        return False
    if Path(reference).is_dir():
        return False
    return (bool(_HUB_ID.match(reference)) and "--" not in reference and ".." not in reference
            and not reference.endswith(".") and len(reference) <= 96)


def describe_node() -> str:
    """``host (Ray node <id>)``: where the caller runs, for error messages."""
    host = socket.gethostname()
    try:
        import ray

        if ray.is_initialized():
            return f"{host} (Ray node {ray.get_runtime_context().get_node_id()[:12]})"
    except Exception:
        pass
    return host


@dataclass(frozen=True)
class ModelSource:
    """A checkpoint reference plus how to fetch it; plain data, sent to every worker.

    ``token`` never appears in ``repr`` (logs, error messages).
    """

    reference: str
    revision: str | None = None
    download_dir: str | None = None
    token: str | None = field(default=None, repr=False)

    @property
    def is_hub_id(self) -> bool:
        return is_hub_id(self.reference)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelSource":
        return cls(**data)

    def resolve(self, weights: bool = True) -> str:
        """A local directory holding the checkpoint (``weights=False``: config and tokenizer only;
        a directory's weights are then not looked for).

        Raises ``ModelSourceError`` naming this node and the reason.
        """
        if self.is_hub_id:
            return self._fetch(weights)
        path = Path(self.reference).expanduser()
        if self.revision is not None:
            raise ModelSourceError(f"model.revision {self.revision!r} applies to a hub id, but "
                                   f"model.path {self.reference!r} is a directory")
        if not path.is_dir():
            raise ModelSourceError(
                f"model.path {self.reference!r}: no such directory on node {describe_node()}; a directory "
                "must exist on every node (local, or shared storage mounted at the same path), or use a "
                "hub id such as 'Qwen/Qwen2.5-0.5B-Instruct'")
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"model.path {self.reference!r} on node {describe_node()} has no "
                                   "config.json: not a transformers checkpoint directory")
        if weights and not has_weights(path):
            raise ModelSourceError(f"model.path {self.reference!r} on node {describe_node()} holds no weights "
                                   "(no *.safetensors or *.bin file): a directory must hold the checkpoint's "
                                   "weights on every node that runs a worker")
        return str(path)

    def _fetch(self, weights: bool) -> str:
        from huggingface_hub import snapshot_download

        kwargs = dict(repo_id=self.reference, revision=self.revision, cache_dir=self.download_dir,
                      token=self.token or None)
        patterns = _CONFIG_PATTERNS + (_WEIGHT_PATTERNS if weights else [])
        try:
            directory = snapshot_download(allow_patterns=patterns, **kwargs)
            if weights and not any(Path(directory).glob("*.safetensors")):
                directory = snapshot_download(allow_patterns=patterns + _FALLBACK_WEIGHT_PATTERNS, **kwargs)
        except Exception as exc:
            raise ModelSourceError(self._explain(exc)) from None
        if not (Path(directory) / "config.json").is_file():
            raise ModelSourceError(f"model.path {self.reference!r} (hub id) fetched on node {describe_node()} "
                                   "has no config.json: not a transformers checkpoint")
        if weights and not has_weights(directory):
            raise ModelSourceError(f"model.path {self.reference!r} (hub id) on node {describe_node()} holds no "
                                   "*.safetensors or *.bin weights")
        return directory

    def _explain(self, exc: Exception) -> str:
        from huggingface_hub import errors

        where = (f"model.path {self.reference!r} (hub id, revision {self.revision or 'main'}) cannot be "
                 f"fetched on node {describe_node()}")
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if isinstance(exc, errors.GatedRepoError):
            hint = "a gated repo: set HF_TOKEN to a token whose account was granted access"
        elif isinstance(exc, errors.RevisionNotFoundError):
            hint = "no such revision (branch, tag or commit) in that repo"
        elif isinstance(exc, errors.RepositoryNotFoundError):
            hint = ("no such repo, or a private one: check the id, or set HF_TOKEN to a token that can "
                    "read it")
        elif isinstance(exc, errors.LocalEntryNotFoundError):
            hint = ("the hub is unreachable from this node and its cache lacks this revision: give the "
                    "node network access, pre-fill its cache (HF_HOME or model.download_dir), or use a "
                    "directory on shared storage")
        elif isinstance(exc, errors.HfHubHTTPError):
            hint = "the hub refused the download"
        else:
            hint = "unexpected error while fetching"
        return f"{where}: {hint} ({reason})"
