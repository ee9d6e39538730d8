"""Rewards: the sources a job combines (``sources``: reward models, rule functions, a remote reward model),
the remote reward model's client (``remote``) and the answer checkers (``verifiers``)."""
