"""Turns summaries into words and pictures: the text report, report.html, the live view."""
