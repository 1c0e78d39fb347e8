"""The old name of :mod:`dflash.pipeline.heldout` (kept while ``tuning/validate.py`` imports ``quality_line``
from here; delete once the validation package imports ``heldout_line`` from ``dflash.pipeline.heldout``)."""

from dflash.pipeline.heldout import heldout_line as quality_line

__all__ = ["quality_line"]
