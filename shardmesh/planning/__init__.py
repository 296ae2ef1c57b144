"""Planning a deployment: how many bytes each shard needs, how to split a model over given devices,
and the YAML manifest that describes a deployment. Pure functions; nothing here starts a process."""
