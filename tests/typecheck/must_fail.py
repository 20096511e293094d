"""Negative control for `make typecheck`: every line marked `# error` is a misuse the check must report
(and no other line may be reported); the Makefile fails when mypy accepts this file or flags other lines."""

from __future__ import annotations

from autobucket import RolloutConfg, RolloutConfig, SamplingConfig  # error: a misspelt export is no Any

RolloutConfig(route="auto-typo")  # error: routes are a Literal
RolloutConfig(compile="yes")  # error: compile is bool | "auto"
RolloutConfig(persist_costs="no")  # error: a bool
SamplingConfig(max_new_tokens="64")  # error: an int
RolloutConfig(route="aligned", compile="auto", persist_costs=False)  # the same fields, used right
print(RolloutConfg)
