"""`python -m coordinator ...` is `shardmesh coordinator ...`: same flags, same exit codes."""

import sys

from shardmesh.cli import main

if __name__ == "__main__":
    sys.exit(main(["coordinator", *sys.argv[1:]]))
