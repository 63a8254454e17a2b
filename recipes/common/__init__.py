"""Pieces the three recipes share: config loading and checks, the command line, the run folder
(lock, leftover cleanup, verified resume) and a small transformer."""
