"""Loading a model's tokenizer: by ``AutoTokenizer`` where the engine runs, and by the class it
chose wherever only text is made (an ingress replica), without ``AutoTokenizer``.

``AutoTokenizer`` resolves the class from the checkpoint's configs, which imports the model
family's config classes and with them torch: about 2 s and 350 MB in a process that needs
neither. Every branch of its resolution ends in ``the_class.from_pretrained(path, ...)``, so a
process that is told the class the engine's ``AutoTokenizer`` chose loads the same tokenizer
by calling that class itself. A class of the checkpoint's own code (``trust_remote_code``) is
loaded through ``AutoTokenizer``, whose dynamic-module machinery it needs.
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger(__name__)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The tokenizer of the checkpoint at ``path`` (or hub id), as ``AutoTokenizer`` picks it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def tokenizer_class_path(tokenizer) -> str:
    """``module:qualname`` of ``tokenizer``'s class, for ``load_tokenizer_of_class``."""
    cls = type(tokenizer)
    return f"{cls.__module__}:{cls.__qualname__}"


def load_tokenizer_of_class(path: str, class_path: str | None, trust_remote_code: bool = False):
    """The tokenizer at ``path``, of the class ``class_path`` names (``tokenizer_class_path`` of
    the engine's tokenizer): the one ``load_tokenizer`` gives, without importing torch for a
    class of transformers' own. Without a class path, or for a class of the checkpoint's own
    code, ``load_tokenizer``."""
    module_name, _, qualname = (class_path or "").partition(":")
    if not module_name.startswith("transformers.") or not qualname or "." in qualname:
        return load_tokenizer(path, trust_remote_code)
    try:
        cls = getattr(importlib.import_module(module_name), qualname)
    except (ImportError, AttributeError) as exc:   # another transformers than the engine's
        logger.info("tokenizer class %s not importable here (%s): resolving it by AutoTokenizer", class_path, exc)
        return load_tokenizer(path, trust_remote_code)
    # ``_from_auto`` as AutoTokenizer passes it (it only marks the hub's user agent).
    return cls.from_pretrained(path, _from_auto=True)
