"""Interop with optax: `from_optax`, `to_optax`, `with_extra_args` and the probes behind them.
"""
