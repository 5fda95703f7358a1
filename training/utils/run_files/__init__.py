"""What a run writes and reads back: the metrics ledger and logs, JSON Lines, checkpoints, the run's key, its lock,
and directories replaced whole."""
