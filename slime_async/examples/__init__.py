"""Runnable examples of the plugin points (each module says how to run it)."""
