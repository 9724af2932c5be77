"""Torch-level, framework-free instruments: collectives and the DataLoader."""
