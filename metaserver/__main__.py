"""`python -m metaserver [--log-level L] {metaserver,admin} ...`: the metaserver's own two
commands, with the same flags as `kvpool metaserver` / `kvpool admin`, without loading the
rest of kvpool (how `kvpool_harness.processes.MetaserverProcess` starts replicas).
`--log-level` may also follow the command."""
from __future__ import annotations

import argparse
import sys

from metaserver import admin, cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metaserver", description="the metaserver and its admin CLI")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    cli.add_parser(sub)
    admin.add_parser(sub)
    cli.add_log_level(parser)
    args = parser.parse_args(argv)
    cli.configure_logging(args.log_level)
    return cli.main(args) if args.cmd == "metaserver" else admin.main(args)


if __name__ == "__main__":
    sys.exit(main())
