"""Errors the user fixes (placeholder until the errors module lands)."""
from parallax.config import ConfigError  # noqa: F401
