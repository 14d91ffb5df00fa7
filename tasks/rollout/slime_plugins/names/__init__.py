"""Not a package of sluiceway: this directory is a sys.path entry (tasks/rollout/slime_plugins: provide_slime_names).

Importing `sluiceway.tasks.rollout.slime_plugins.names.slime...` would make a second copy of every class (a second
`Sample`) that plugins, which import `slime.*`, would not recognise; so it is refused.
"""

raise ImportError(
    "sluiceway.tasks.rollout.slime_plugins.names is a sys.path entry, not a package: call "
    "sluiceway.tasks.rollout.slime_plugins.provide_slime_names() and import slime.* instead"
)
