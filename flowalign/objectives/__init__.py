"""Objectives: one file per method, each a pure loss function returning ``(loss, stats)``."""
