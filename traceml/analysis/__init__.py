"""Reads rank files and summaries: reduction, diagnosis, compare's statistics and rules.

Pure Python over plain dicts; never imports torch or the capture side.
"""
