"""The errors a user can act on. The CLI turns these into one line on stderr and exit status 2."""


class DipacoError(Exception):
    """Base for errors caused by the user's config, input or run root, never by a bug."""


class ConfigError(DipacoError):
    """A config key or CLI argument is wrong; the message names the key and the file."""


class InputError(DipacoError):
    """Input data or stored state cannot be used; the message names the file."""


class CorruptStateError(InputError):
    """A committed file does not match its _SUCCESS checksum, or cannot be parsed."""


class RunLockedError(DipacoError):
    """Another live process holds the run root's lock."""


class StorageError(Exception):
    """The run root cannot be written (disk full, permissions); not the user's input, so the CLI
    exits 1, but with one line naming the file instead of a traceback."""


class IslandError(Exception):
    """An island failed for good (it crashed more than train.max_attempts times, or every island
    left before the run finished): the CLI exits 1 with this one line."""
