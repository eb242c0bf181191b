"""The engine's one interface: `run(request) -> Result`, the step of one rule's stepping stacks.

`update` (optim._core.update) asks the engine once per rule: a `Request` names the rule, the stacks of its
parameters that step, their stored state, values and tie-summed gradients; the `Result` holds their new state and
values. How they step is a *strategy*'s. Strategies register here with `register`; `run` asks each in turn and
the first that accepts runs the request. XLA's path (optim._engine.xla: the rule's own JAX code, vmapped over
each stack) is registered as the fallback: it accepts everything, so `run` always has an answer, and every
refusal before it is logged (logger "optim", debug level) with its reason, once per compiled program. A
strategy says

- `enabled()`: whether it is on;
- `wide(rule)`: whether `setup` and `adjust` keep this rule's large parameters in stacks (one kernel call runs
  many members of a stack, where XLA's path prefers one parameter per stack);
- `one_kernel(rule)`: whether it steps a group of this rule's large parameters in one kernel of its own, whose
  compile grows with the group's members (`setup` then makes the groups smaller);
- `refuse(request)`: why it cannot run this request, or None where it can;
- `run(request)`: the `Result`.

A module-level switch that changes what a strategy compiles (`optim._engine.fused.ENABLED`) is declared with
`switch`: the switches' values are part of the key of the program cache (optim._core.program), read there
without a call. Nothing here knows a strategy by name: the rule protocol, `setup` and `adjust` depend on this
module only, and `optim._engine`'s `__init__` imports the strategies so that they are registered.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

__all__ = ["Request", "Result", "Strategy", "register", "registered", "switch", "SWITCHES", "key", "wide_rules",
           "run"]

_log = logging.getLogger("optim")


class Request(NamedTuple):
    """One rule's stepping stacks in one `update`. Per stack, in the order of `stacks`: its stepping `rows`, their
    parameters' indices `members` (into `layout.params`), its `stored` state (small leaves as placeholders into
    `packs`: optim._engine.pack), and per stepping member its value (`params`), its tie-summed gradient in each
    gradient tree (`grads`), its first tree's gradient as *parts* (`parts`: a tie's one or two gradients, which a
    strategy may add in its own pass; else the sum alone) and the arrays at its other tied positions (`mirrors`:
    traced calls only, else empty)."""

    layout: Any                              # the state's Layout (optim._core.layout)
    rule: Any                                # the rule, its schedules resolved at this step
    stacks: tuple[int, ...]                  # indices into `layout.stacks`
    rows: tuple[tuple[int, ...], ...]
    members: tuple[tuple[int, ...], ...]
    stored: tuple
    packs: tuple
    params: tuple
    grads: tuple
    parts: tuple
    mirrors: tuple
    in_place: bool                           # the new values may overwrite the old buffers (they are donated)

    @property
    def firsts(self) -> list:
        """Per stack, the `Param` of its first member (all members share shape, dtype and placement)."""
        return [self.layout.params[self.layout.stacks[s][0]] for s in self.stacks]

    @property
    def sizes(self) -> list[int]:
        """Per stack, its number of members (stepping or not)."""
        return [len(self.layout.stacks[s]) for s in self.stacks]

    @property
    def n_trees(self) -> int:
        return len(self.grads[0][0])


class Result(NamedTuple):
    """What a strategy returns for a `Request`: per stack its new stored state and per stepping member its new
    value; the pack groups those stacks write, whole (`{group: arrays}`); and per member its new value once per
    position in its `mirrors` (XLA's path repeats the value; the fused kernel writes each into its buffer)."""

    stored: list
    params: list
    packs: dict
    mirrors: list


class Strategy:
    """The interface of a strategy (see the module). Subclasses override every method but `one_kernel`."""

    name = "strategy"

    def enabled(self) -> bool:
        raise NotImplementedError

    def wide(self, rule: Any) -> bool:
        raise NotImplementedError

    def one_kernel(self, rule: Any) -> bool:
        return False

    def refuse(self, request: Request) -> str | None:
        raise NotImplementedError

    def run(self, request: Request) -> Result:
        raise NotImplementedError


_REGISTERED: list[Strategy] = []
_FALLBACK: list[Strategy] = []
# (owner, attribute) of each switch: `tuple(getattr(o, a) for o, a in SWITCHES)` is their state.
SWITCHES: list[tuple[Any, str]] = []


def register(strategy: Strategy, fallback: bool = False) -> Strategy:
    """Add `strategy`, asked after those registered before it; `fallback=True`: the one that runs what every
    other refuses (XLA's path), which must accept every request."""
    if fallback:
        _FALLBACK[:] = [strategy]
    else:
        _REGISTERED.append(strategy)
    return strategy


def registered() -> tuple[Strategy, ...]:
    """The strategies `run` asks, in order, the fallback last."""
    return (*_REGISTERED, *_FALLBACK)


def switch(owner: Any, attribute: str) -> None:
    """Declare `owner.attribute` a switch: a program compiled with one value is not reused with another."""
    SWITCHES.append((owner, attribute))


def key() -> tuple:
    """The switches' values (what optim._core.program reads inline)."""
    return tuple(getattr(o, a) for o, a in SWITCHES)


def wide_rules(rules: tuple) -> frozenset:
    """The rules (indices into `rules`, unwrapped: `optim._core.state.unwrap`) that an enabled strategy
    keeps stacked when their parameters are large (`optim._engine.stack.make_stacks`), as `(ANY, index)` the
    rules that ask for it themselves (`Rule._stack_large`: stacked whatever their dtype and placement), as
    `(GROUPED, index)` the rules that XLA's path groups (`optim._engine.group`), and as `(ONE_KERNEL, index)`
    those of them whose group an enabled strategy steps in one kernel of its own (`Strategy.one_kernel`)."""
    from .._rules.protocol import splits_large, stacks_large
    from . import group
    from .stack import ANY, GROUPED, ONE_KERNEL, SPLIT

    kernel = frozenset(r for r, rule in enumerate(rules) if any(s.enabled() and s.wide(rule)
                                                                  for s in _REGISTERED))
    grouped = frozenset(r for r, rule in enumerate(rules) if r not in kernel and group.groups(rule))
    return kernel | frozenset((ANY, r) for r, rule in enumerate(rules) if stacks_large(rule)) | frozenset(
        (GROUPED, r) for r in grouped) | frozenset(
        (ONE_KERNEL, r) for r in grouped if any(s.enabled() and s.one_kernel(rules[r]) for s in _REGISTERED)
    ) | frozenset((SPLIT, r) for r, rule in enumerate(rules) if splits_large(rule))


def run(request: Request, after: Strategy | None = None) -> Result:
    """The step of `request`, by the first registered strategy that accepts it (see `Strategy.refuse`), else by
    the fallback; the reason each other one gave is logged at debug level. `after`: ask only the strategies
    registered after it (a strategy's code for a platform it has no kernel for: the fused CPU kernel's on a GPU).
    The rules trace it with the mesh the parameters or their state live on, where it spans several devices: the
    matrix rules split their per-matrix work over it (optim._rules.split)."""
    from .._rules import split

    with split.over(split.mesh_of(s for p in request.firsts for s in (p.place, p.state_place))):
        for s in _REGISTERED[_REGISTERED.index(after) + 1 if after is not None else 0:]:
            why = s.refuse(request)
            if why is None:
                return s.run(request)
            _log.debug("optim: %s does not run %s here: %s", s.name, type(request.rule).__name__, why)
        return _FALLBACK[0].run(request)
