"""The supervised workflows on one loop (``loop``): SFT (and conditional SFT), reward models, DPO / IPO / cDPO and
KTO with their frozen reference (``reference``)."""
