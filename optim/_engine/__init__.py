"""The execution engine: how a rule's stacks of parameters step. The storage (stacks, packs), XLA's path with
its hoisting of small arithmetic (jaxpr analysis), and the strategies registered beside it (the fused CPU
kernel, chosen at lowering).
"""
