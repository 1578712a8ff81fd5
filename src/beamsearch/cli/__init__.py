"""The ``beamsearch`` command line (needs ``transformers``: ``pip install 'beamsearch[hf]'``)."""

from .main import main

__all__ = ["main"]
