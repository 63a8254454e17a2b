"""Test-time training for language modelling, meta-learned through the inner updates (BoB inside attention)."""
