"""sluiceway's stand-in for the `slime` package (THUDM/slime at 624b824a), for plugins written for slime.

Only the names slime's plugins import are here (sluiceway.tasks.rollout.slime_plugins says how this becomes
importable). slime's own slime/__init__.py is empty; SLUICEWAY marks this copy.
"""

SLUICEWAY = True
