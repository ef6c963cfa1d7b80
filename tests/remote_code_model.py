"""A checkpoint that brings its own code, as many on the hub do: ``config.json``'s ``auto_map``
names a config class and a causal LM class in Python files beside the weights, which
transformers imports only with ``trust_remote_code``.

``make_remote_code_model(base, parent)`` copies a tiny Llama checkpoint and adds such classes
(subclasses of transformers' Llama ones, under a model type transformers does not know), so
the copy computes exactly what the base does, but loads only through its own code.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

MODEL_TYPE = "remote_llama"
MODEL_CLASS = "RemoteLlamaForCausalLM"

_CONFIGURATION = '''from transformers import LlamaConfig


class RemoteLlamaConfig(LlamaConfig):
    model_type = "remote_llama"
'''

_MODELING = '''from transformers import LlamaForCausalLM

from .configuration_remote_llama import RemoteLlamaConfig


class RemoteLlamaForCausalLM(LlamaForCausalLM):
    config_class = RemoteLlamaConfig
'''


def make_remote_code_model(base: str | Path, parent: Path) -> Path:
    """A copy of checkpoint ``base`` under ``parent`` whose config and model load through its own
    code. Its folder's name is unique: transformers caches a checkpoint's code by that name, in
    one folder for every process of the machine."""
    path = parent / f"remote_llama_{uuid.uuid4().hex[:8]}"
    shutil.copytree(base, path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type=MODEL_TYPE, architectures=[MODEL_CLASS],
                  auto_map={"AutoConfig": "configuration_remote_llama.RemoteLlamaConfig",
                            "AutoModelForCausalLM": f"modeling_remote_llama.{MODEL_CLASS}"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "configuration_remote_llama.py").write_text(_CONFIGURATION)
    (path / "modeling_remote_llama.py").write_text(_MODELING)
    return path
