"""Weight versions on the object store: full HF safetensors copies and lossless deltas, with manifests.

Import each name from the module that defines it (`store.WeightStore`, `publish.WeightPublisher`,
`materialize.materialize`, ...): this package imports nothing, so a trainer writing a weight version to its own
disk takes the file formats it needs (tasks/sync/disk.py: `safetensors_raw`, `checksums`, `model_dir`) without
the object store (tests/unit/repo/test_layering.py).
"""
