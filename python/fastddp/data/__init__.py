"""Built-in data for fastddp's launcher (HAR activity recognition)."""

from .har import HARData, load_uci_har, synthetic_har

__all__ = ["HARData", "load_uci_har", "synthetic_har"]
