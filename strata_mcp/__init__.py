"""Strata MCP: run a local language model on this PC, driven by an AI assistant over MCP."""

__version__ = "0.1.0"
