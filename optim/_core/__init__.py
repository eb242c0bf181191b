"""The state model and the public verbs: `setup`, `update`, `adjust`, surgery, ties, dotted paths, the plan
of an update and its cache.
"""
