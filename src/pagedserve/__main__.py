"""Entry point for ``python -m pagedserve`` and the ``pagedserve`` console script."""

import sys


def main() -> int:
    """Run the ``pagedserve`` command line on ``sys.argv[1:]`` and return its exit status."""
    from pagedserve.cluster.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
