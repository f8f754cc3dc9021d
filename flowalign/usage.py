"""Command-line arguments checked before anything loads, each failure one line naming the option
(``flowalign: error: ...``, exit 2): reward names (``--rewards``, ``--reward``) and JSON options
(``--kwargs``)."""

from __future__ import annotations

import json

from flowalign.errors import ConfigError

# rewards the recipes name that flowalign does not ship: what to do instead
EXTERNAL_REWARDS = {
    "geneval": "GenEval's object detector is not built into flowalign: install it where the server runs, register "
               "it there as a plug-in reward named 'geneval' (entry point group flowalign.rewards, returning "
               "{'geneval': [B]}), then run this command in that environment (the top of configs/sd35m_flow_grpo_geneval.yaml)",
}


def reward_names(text: str, option: str) -> list[str]:
    """The comma-separated reward names of ``option``, each registered (else ConfigError)."""
    from flowalign.preflight import reward_factory

    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ConfigError(f"{option}: name at least one reward")
    for name in names:
        if name in EXTERNAL_REWARDS:
            from reward_models.base import available_rewards

            if name not in available_rewards():
                raise ConfigError(f"{option} {name}: {EXTERNAL_REWARDS[name]}")
        reward_factory(name, option, "command line")
    return names


def json_option(text: str, option: str) -> dict:
    """``option``'s value as a JSON object (ConfigError naming the option and the position)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{option} {text!r} is not valid JSON ({error.msg} at character {error.pos}); write an "
                          """object with double quotes, e.g. --kwargs '{"min_area": 4}'""") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{option} {text!r} must be a JSON object (keyword arguments), got {type(value).__name__}")
    return value


def reward_options(name: str, kwargs_text: str) -> tuple[str, dict]:
    """``--reward NAME --kwargs JSON`` checked: the name registered, the JSON an object of the
    reward's own arguments."""
    from flowalign.preflight import reward_arguments, reward_factory

    name = reward_names(name, "--reward")[0]
    kwargs = json_option(kwargs_text, "--kwargs")
    reward_arguments(reward_factory(name, "--reward", "command line"), kwargs, name, "--kwargs", "command line")
    return name, kwargs
