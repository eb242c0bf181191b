"""The engine's strategies: the ways a rule's stepping stacks can run, besides XLA's code for the rule.

`update` (optim._core.update) plans each call the same way: per rule, its stepping stacks and their summed gradients.
XLA's path runs the rule's own JAX code, vmapped over each stack (optim._engine.hoist hoists its small arithmetic once
per pack); it always works. A strategy is another way to run some rules' stacks, faster where it applies (the
fused CPU kernel, optim._engine.fused). It registers here with `register`, and says

- `enabled()`: whether it is on (part of the key of the program cache, optim._core.program);
- `wide(rule)`: whether `setup` and `adjust` keep this rule's large parameters in stacks (one kernel call runs
  many members of a stack, where XLA's path prefers one parameter per stack);
- `refuse(rule, firsts, stored, sizes, n_trees)`: why it cannot run these stacks, or None where it can;
- `branches(prog, rule, js, in_place)`: the functions `update` runs, as `optim._core.update._fused_branches` builds.

`choose` asks each registered strategy in turn and takes the first that accepts; where none does, XLA's path
runs, and each refusal is logged (logger "optim", debug level) with its reason, once per compiled program.
Nothing here knows a rule's formulas or imports a strategy: the rule protocol, `setup` and `adjust` depend on
this module only.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["Strategy", "register", "registered", "key", "wide_rules", "choose"]

_log = logging.getLogger("optim")


class Strategy:
    """The interface of a strategy (see the module). Subclasses override every method."""

    name = "strategy"

    def enabled(self) -> bool:
        raise NotImplementedError

    def wide(self, rule: Any) -> bool:
        raise NotImplementedError

    def refuse(self, rule: Any, firsts: list, stored: list, sizes: list, n_trees: int) -> str | None:
        raise NotImplementedError

    def branches(self, prog: Any, rule: Any, js: list, in_place: bool) -> tuple:
        raise NotImplementedError


_REGISTERED: list[Strategy] = []


def register(strategy: Strategy) -> Strategy:
    """Add `strategy`, asked after those registered before it."""
    _REGISTERED.append(strategy)
    return strategy


def registered() -> tuple[Strategy, ...]:
    return tuple(_REGISTERED)


def key() -> tuple[bool, ...]:
    """Which strategies are on: a program compiled with one on is not reused with it off."""
    return tuple(s.enabled() for s in _REGISTERED)


def wide_rules(rules: tuple) -> frozenset:
    """The rules (indices into `rules`, unwrapped: `optim._core.state.unwrap`) that an enabled strategy
    keeps stacked when their parameters are large (`optim._engine.stack.make_stacks`), as `(ANY, index)` the
    rules that ask for it themselves (`Rule._stack_large`: stacked whatever their dtype and placement), and as
    `(GROUPED, index)` the rules that XLA's path groups (`optim._engine.group`)."""
    from .._rules.protocol import stacks_large
    from . import group
    from .stack import ANY, GROUPED

    kernel = frozenset(r for r, rule in enumerate(rules) if any(s.enabled() and s.wide(rule)
                                                                  for s in _REGISTERED))
    return kernel | frozenset((ANY, r) for r, rule in enumerate(rules) if stacks_large(rule)) | frozenset(
        (GROUPED, r) for r, rule in enumerate(rules) if r not in kernel and group.groups(rule))


def choose(rule: Any, firsts: list, stored: list, sizes: list, n_trees: int) -> Strategy | None:
    """The first registered strategy that runs `rule` on these stacks (see `Strategy.refuse`), or None for XLA's
    path; the reason each other one gave is logged at debug level."""
    for s in _REGISTERED:
        why = s.refuse(rule, firsts, stored, sizes, n_trees)
        if why is None:
            return s
        _log.debug("optim: %s does not run %s here (XLA's path does): %s", s.name, type(rule).__name__, why)
    return None
