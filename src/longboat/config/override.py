"""A config file whose keys replace a script's own, named by an environment variable.

[Note: config override] ``longboat tune SCRIPT`` runs the user's script under each candidate
config without editing it: it writes the candidate to a file and names it in
``LONGBOAT_CONFIG_OVERRIDE``. ``longboat.initialize`` loads the script's config as always, then
sets every key the file sets (tables merged key by key, so a key the file does not name keeps
the script's value) and validates the result as one config. Anyone can use it to try a setting
without touching a script: ``LONGBOAT_CONFIG_OVERRIDE=zero3.toml longboat run -n 2 train.py``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from longboat.config.errors import ConfigError
from longboat.config.loading import load_config, read_mapping
from longboat.config.sections import Config

OVERRIDE_VAR = "LONGBOAT_CONFIG_OVERRIDE"


def merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with every key of ``over`` set, tables merged key by key."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merged(out[k], v)
        else:
            out[k] = v
    return out


def overridden(cfg: Config, environ: Mapping[str, str] = os.environ) -> Config:
    """``cfg`` with the file named in ``$LONGBOAT_CONFIG_OVERRIDE`` set over it ([Note: config
    override]); ``cfg`` itself when the variable is unset."""
    path = environ.get(OVERRIDE_VAR)
    if not path:
        return cfg
    try:
        over = read_mapping(path)
    except (OSError, ConfigError) as e:
        raise ConfigError(f"{OVERRIDE_VAR}={path!r}: {e}; unset it or name a config file") from None
    try:
        return load_config(merged(cfg.model_dump(exclude_unset=True), over))
    except ConfigError as e:
        raise ConfigError(f"{OVERRIDE_VAR}={path!r} set over the script's config: {e}") from None
