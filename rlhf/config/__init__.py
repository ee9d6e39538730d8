"""Configuration: the part base (``part``), the parts the entry points share (``parts``), the supervised job and
``cli_main`` (``job``), the seed systems' launcher flags (``migration``) and OpenRLHF's dotted flags (``openrlhf``)."""
