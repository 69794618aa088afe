"""lightning_fuse: compile a Lightning model's hot submodules in place, and log how much faster it trains.

Example::

    >>> import lightning.pytorch as pl
    >>> from lightning_fuse import FuseCallback
    >>> trainer = pl.Trainer(callbacks=[FuseCallback()], logger=False, enable_progress_bar=False)
"""

from lightning_fuse.callback import FuseCallback

__all__ = ["FuseCallback"]
__version__ = "0.1.0"
