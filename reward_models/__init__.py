"""Rewards: plain callables registered by name (reward_models/base.py); built-ins load on first use."""
