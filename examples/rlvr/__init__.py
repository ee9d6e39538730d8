"""The rlvr example: README.md has its command, what it trains, its output and its figures."""
