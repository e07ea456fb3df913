"""kvatlas: the command line and the local cluster launcher (the only package importing all others)."""
__version__ = "0.1.0"
