"""argparse value types shared by ``pagedserve`` and ``pagedserve bench``.

A leaf module (argparse only), so both command lines import it without
importing each other.
"""

from __future__ import annotations

import argparse


def _parse_number(text: str, kind: type, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _parse_number(text, int, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = _parse_number(text, int, "a non-negative integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0 (``inf`` allowed, NaN not)."""
    value = _parse_number(text, float, "a number")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number (or inf), got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = _parse_number(text, float, "a number")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text}")
    return value


def port(text: str) -> int:
    """argparse type: a TCP port, 0..65535."""
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value}")
    return value


def json_object(text: str) -> dict:
    """argparse type: a JSON object (vLLM's ``--speculative-config '{...}'``)."""
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def lora_module(text: str) -> dict:
    """argparse type: one of vLLM's ``--lora-modules`` items, ``NAME=PATH`` or a JSON object with
    ``name`` and ``path`` (the adapters' base is always the served model: no ``base_model_name``)."""
    if text.lstrip().startswith("{"):
        value = json_object(text)
        if set(value) != {"name", "path"}:
            raise argparse.ArgumentTypeError(f"expected {{\"name\": ..., \"path\": ...}} (and no other key), "
                                             f"got {text!r}")
        return value
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return {"name": name, "path": path}
