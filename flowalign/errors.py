"""The error every configuration check raises (re-exported by ``flowalign.config``)."""


class ConfigError(ValueError):
    """A configuration problem; the message names the key and where it came from."""
