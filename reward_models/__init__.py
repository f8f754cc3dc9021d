"""Rewards: plain callables registered by name (reward_models/base.py); built-ins load on first use."""

import flowalign  # noqa: F401  (checks that pipelines and reward_models are flowalign's own: flowalign/layout.py)
