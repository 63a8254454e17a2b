"""Pieces the meta-learning and test-time-training recipes share: config loading and a small transformer."""
