"""slime.rollout: GenerateState, the default generate and the reward hub (mirrors slime's slime/rollout/)."""
