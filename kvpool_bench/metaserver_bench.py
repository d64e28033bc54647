from __future__ import annotations
import argparse
def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    sub.add_parser("metaserver", help="QueryPrefix latency/rate and Publish throughput")
def main(args: argparse.Namespace) -> int:
    return 0
