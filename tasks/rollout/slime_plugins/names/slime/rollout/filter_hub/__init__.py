"""slime.rollout.filter_hub: dynamic sampling filters (slime's slime/rollout/filter_hub at 624b824a)."""
