"""The bottom layer: what every other layer uses and that imports none of them (tree paths and messages, export
registration, caches)."""
