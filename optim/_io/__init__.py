"""Checkpoint I/O: `save` / `load` files and `state_dict` trees (orbax).
"""
