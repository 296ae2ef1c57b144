"""Package shardmesh.v1. Generated: edit protos/shardmesh/v1/*.proto instead."""
