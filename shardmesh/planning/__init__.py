"""Planning a deployment: how many bytes each shard needs, how to split a model over given devices,
and the YAML manifest that describes a deployment. Pure functions on config.json and safetensors headers:
nothing here imports torch, reads a weight or starts a process."""
