"""The one error type of configuration: it names the key, the value and the fix."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration mistake; the message names the key, the value and the fix."""
