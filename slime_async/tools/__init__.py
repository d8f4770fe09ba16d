"""Command-line tools (model conversion)."""
