"""``autopar plan | show | explain | diff | check | profile``."""

from autopar.cli.main import main, parse_bytes, parse_mesh

__all__ = ["main", "parse_bytes", "parse_mesh"]
