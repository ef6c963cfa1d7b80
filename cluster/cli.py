"""The ``pagedserve`` command line: one argparse subcommand per action.

Adding a subcommand takes two functions and one line:

* ``_add_<name>_parser(subparsers)`` creates the subparser, declares its
  arguments and calls ``parser.set_defaults(run=_run_<name>)``;
* ``_run_<name>(args) -> int`` does the work and returns the exit status;
* append ``_add_<name>_parser`` to ``_PARSER_BUILDERS``.

Import heavy modules inside ``_run_*`` so that ``pagedserve --help`` and
argument errors stay fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pagedserve.workers.model_factory import ARCHS, SIZES


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def _add_make_model_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "make-model",
        help="write a random-weight checkpoint (offline) in transformers format",
        description=(
            "Write config.json, model.safetensors, generation_config.json and a "
            "byte-level BPE tokenizer with a ChatML chat template into OUT. "
            "The same arch/size/seed always gives identical weights."
        ),
    )
    parser.add_argument("--arch", choices=ARCHS, default="llama", help="model family (default: llama)")
    parser.add_argument("--size", choices=SIZES, default="tiny", help="tiny (~0.2M params) or small (~25M params)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    parser.add_argument("--seed", type=_non_negative_int, default=0, help="weight seed (default: 0)")
    parser.set_defaults(run=_run_make_model)


def _run_make_model(args: argparse.Namespace) -> int:
    from pagedserve.workers.model_factory import make_model

    out_dir = make_model(args.arch, args.size, args.out, seed=args.seed)
    print(out_dir)
    return 0


# One entry per subcommand; each adds its subparser to the given subparsers.
_PARSER_BUILDERS = (_add_make_model_parser,)


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM serving built around a paged KV cache.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_parser in _PARSER_BUILDERS:
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the chosen subcommand, return its exit status.

    Bad arguments print usage and exit with status 2 (argparse's convention).
    """
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
