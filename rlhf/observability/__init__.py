"""What a run reports: metrics, logging and phase timers (``metrics``), profiling (``profiling``)."""
