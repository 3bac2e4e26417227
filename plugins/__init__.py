"""Built-in plugins other than strategies: precision, loggers, progress display."""
