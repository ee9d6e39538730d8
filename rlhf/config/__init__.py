"""Configuration: the part base (``part``), the parts the entry points share (``parts``), the supervised job and
``cli_main`` (``job``), the seed systems' launcher flags (``migration``), OpenRLHF's dotted flags (``openrlhf``) and
``--config FILE`` with the resolved flags written beside each run (``config_file``)."""
