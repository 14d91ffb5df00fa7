"""Weight sync: moving a new weight version from the trainer to the rollout engines.

`disk.py` publishes each version as an HF model directory that engines load with SGLang's
`/update_weights_from_disk`; `publish.py` syncs a version (write, load on the engines, and with
`--update-weight-mode delta` publish it). Remote pools get versions through the weight store instead
(`storage/weights/`, `infra/pool_agent.py`, docs/weight_sync.md).
"""
