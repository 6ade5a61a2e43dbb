"""Gradient-delay policies, mitigations and the single-process delay emulator."""
