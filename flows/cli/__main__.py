"""`python -m sluiceway.flows.cli ...`: the `sluiceway` command (its signal handling is set up by the package's
__init__, which Python imports first)."""

from sluiceway.flows.cli import entry

entry()
