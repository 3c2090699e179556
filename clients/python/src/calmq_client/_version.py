"""The one place calmq-client's version is written (pyproject.toml reads it). calmq's own
distribution requires exactly this version: the two are released together."""

__version__ = "0.1.0"
USER_AGENT = f"calmq-client/{__version__}"
