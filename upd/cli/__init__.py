"""Command line interface: `upd info|analyze|verify|demo`."""
from .main import main

__all__ = ["main"]
