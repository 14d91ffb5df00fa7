"""Errors the CLI prints as one line, without a traceback (flows/faults.py turns known faults into these).

Exit codes tell them apart: a user's mistake exits 2 (fix the input and run again), a fault of the machine or
its services exits 1 (the message says what failed, where, and how to recover; the traceback goes to the run's
log file).
"""


class UserError(Exception):
    """A mistake in the user's input (config, flags, data files); the message names where and what."""


class Fault(Exception):
    """An infrastructure fault (disk, object store, damaged files, a lost service): what, where, how to recover."""
