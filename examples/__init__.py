"""The runnable examples, one folder each (examples/README.md); their scripts import each other as ``examples.<name>``."""
