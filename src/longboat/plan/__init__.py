"""``longboat plan``: predict per-rank memory and communication of each strategy without the
hardware, by running the strategies themselves on meta tensors (see ``docs/plan.md``)."""

from __future__ import annotations

from longboat.plan.planner import STRATEGIES, Plan, StrategyPlan, make_plan
from longboat.plan.render import parse_bytes, render
from longboat.plan.simulate import MetaCollectives, Simulated, simulate
from longboat.plan.target import BUILTINS, PlanInputError, Target, resolve

__all__ = [
    "BUILTINS",
    "STRATEGIES",
    "MetaCollectives",
    "Plan",
    "PlanInputError",
    "Simulated",
    "StrategyPlan",
    "Target",
    "make_plan",
    "parse_bytes",
    "render",
    "resolve",
    "simulate",
]
