"""The execution engine: how a rule's stacks of parameters step. Its one interface is `strategies.run(request)`;
the storage (stacks, packs), XLA's path (the fallback strategy) with its hoisting of small arithmetic (jaxpr
analysis), and the fused CPU kernel (a strategy chosen at lowering) are its modules.
"""

from . import fused as fused, onepass as onepass, xla as xla   # noqa: F401  (each registers its strategy with `strategies`)
