"""Weight sync: moving a new weight version from the trainer to the rollout engines.

Today the sampler lives in the trainer's process and `flows/rl.py`'s sync task loads the trainer's weights
(mapped to HF names) into it directly; checkpoints and deltas on object storage come with remote engines.
"""
