"""User-facing errors: the CLI prints these as one line and exits non-zero, without a traceback."""


class UserError(Exception):
    """A mistake in the user's input (config, flags, data files); the message names where and what."""
