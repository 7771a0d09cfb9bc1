"""Errors every part of splitserve shares.

`ConfigError`: what a flag, an environment variable or a model directory's config files ask
for cannot run (an unknown backend, an unsupported model feature, a mismatched draft model),
as opposed to a bug. The one subtle rule: it subclasses ValueError, so a caller that catches
ValueError still catches it, and a caller that wants config errors alone catches ConfigError.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the setting and why."""
