"""Generated protobuf and gRPC modules: `python protos/generate.py`."""
