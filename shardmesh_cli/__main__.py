"""`python -m shardmesh_cli ...` is the `shardmesh` command."""

import sys

from shardmesh_cli.main import main

sys.exit(main())
