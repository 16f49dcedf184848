"""Closed-form memory formulas from the literature, each term cited, for cross-checking the
traced figures (``tracemem crosscheck``). Nothing here feeds an estimate."""
