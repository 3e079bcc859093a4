"""The package version, in a module of its own so the SDK's modules can read it (for the
``User-Agent`` header) without importing the package root, which imports them."""

__version__ = "0.1.0"
