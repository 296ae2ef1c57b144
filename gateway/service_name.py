"""The Gateway service's full name, from the proto descriptor: the server, its health entries and the
request spans all name the service exactly as the proto does."""

from __future__ import annotations

from shardmesh.proto.v1 import gateway_pb2

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name  # "shardmesh.v1.Gateway"
