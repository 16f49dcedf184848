"""Attention blocks (MLA)."""
