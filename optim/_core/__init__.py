"""The state model and the public verbs: `setup`, `update`, `adjust`, surgery, ties, `averaged`, the plan of an
update and its cache.
"""
