"""`python -m metaserver [--log-level L] {metaserver,admin} ...`: the metaserver's own two
commands, with the same flags as `kvpool metaserver` / `kvpool admin`, without loading the
rest of kvpool (how `metaserver.launch` starts replicas)."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from metaserver import admin, cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metaserver", description="the metaserver and its admin CLI")
    parser.add_argument("--log-level", default=os.environ.get("KVPOOL_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    cli.add_parser(sub)
    admin.add_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return cli.main(args) if args.cmd == "metaserver" else admin.main(args)


if __name__ == "__main__":
    sys.exit(main())
