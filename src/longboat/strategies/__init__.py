"""Strategies: how data-parallel ranks share a model's state, one file (or folder) each, behind
:class:`~longboat.strategies.base.Strategy`; ``registry.py`` builds them by name.

This package imports nothing on import, so any of its modules (and the parameter server's
worker, which builds on ``base.py``) can be imported first."""
