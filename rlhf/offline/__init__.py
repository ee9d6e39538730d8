"""Offline generation workflows: rejection sampling (best-of-n by a reward) and batch inference."""
