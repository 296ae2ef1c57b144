"""`python -m coordinator ...` runs the coordinator alone: the flags and exit codes of `shardmesh coordinator`."""

import argparse
import sys

from coordinator import app
from shardmesh.rpc import procs
from shardmesh.rpc.flags import EXIT_USAGE, UsageError

if __name__ == "__main__":
    procs.die_with_parent_if_asked()
    parser = argparse.ArgumentParser(prog="python -m coordinator", description="run the coordinator")
    app.add_arguments(parser)
    try:
        sys.exit(app.run(parser.parse_args()))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
