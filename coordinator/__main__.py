"""`python -m coordinator ...` runs the coordinator alone: the flags and exit codes of `shardmesh coordinator`."""

import argparse
import sys

from coordinator import app
from shardmesh.rpc import procs

if __name__ == "__main__":
    procs.die_with_parent_if_asked()
    parser = argparse.ArgumentParser(prog="python -m coordinator", description="run the coordinator")
    app.add_arguments(parser)
    sys.exit(app.run(parser.parse_args()))
