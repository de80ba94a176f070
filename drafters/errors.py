"""The one exception type for bad user input: entry points print its message as one line and exit 2."""


class UserError(Exception):
    """Bad input from the user (file, config, model mismatch); the message names the culprit."""
