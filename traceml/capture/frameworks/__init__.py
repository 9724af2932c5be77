"""Thin adapters that drive a capture session from a framework's own events."""
