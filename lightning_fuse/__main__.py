r"""The ``lightning-fuse`` command line, also run as ``python -m lightning_fuse`` (no venv activation needed).

Sub-commands:

- ``report LOGDIR... [--format md] [--plot PNG]``: one table over FuseCallback runs (see :mod:`lightning_fuse.report`).

Example::

    >>> main(["report", "/nonexistent/run"])
    2

From a shell::

    $ .venv/bin/python -m lightning_fuse report outputs/
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_fuse import report


def build_parser() -> argparse.ArgumentParser:
    """The parser with one sub-parser per command, each with its ``run`` function as the ``run`` default.

    Example::

        >>> build_parser().parse_args(["report", "outputs/"]).logdirs
        ['outputs/']
    """
    parser = argparse.ArgumentParser(prog="lightning-fuse", description="Tools for lightning_fuse runs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    report_parser = commands.add_parser(
        "report", help="summarise FuseCallback runs: speedup, step time, what each run compiled"
    )
    report.add_arguments(report_parser)
    report_parser.set_defaults(run=report.report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the command line) and run the sub-command; returns its exit code."""
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
