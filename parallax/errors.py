"""The errors parallax raises for a user to fix. A leaf: it imports nothing of parallax, so every layer may
raise them (docs/design.md, "Layers and file map")."""


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming key, value and the fix."""
