"""`python -m shardmesh.cli ...`, the command line of earlier releases, still runs the `shardmesh` command.

The command itself lives above the services, in `shardmesh_cli`; this library never imports it. Running
this file as a script hands over to that package by name (`runpy`), so nothing is imported from here.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("shardmesh_cli", run_name="__main__", alter_sys=True)
