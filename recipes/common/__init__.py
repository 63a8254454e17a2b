"""What the three recipes share: config loading and checks (``config``), the command line (``cli``),
the training loop (``training``) and what it shows a person (``progress``), the run folder, its checkpoints and metrics log (``run_folder``,
``checkpoint``, ``logger``), data-parallel set-up (``distributed``), byte-level data (``data``), the
learning-rate schedule (``schedule``) and a small transformer (``transformer``)."""
