"""Hydra recipes for ``lightning_fuse``: models, data and tasks that ``recipes/train.py`` composes from ``configs/``.

A plain folder used from a checkout (not installed): run ``python recipes/train.py`` from the repository root.
"""
