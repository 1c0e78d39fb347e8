"""dflash-tune: tune the hidden-state queue of a decoupled DFlash drafter-training pipeline.

The package is laid out by DESIGN.md: ``core/`` (torch-free rules: config, queue policy and core,
sampler, metrics, records), ``data/`` (conversations, length cache), ``model/`` (target capture,
drafter, acceptance, export), ``pipeline/`` (the trainer), ``regenerate/`` and the CLI. The flat
module paths of earlier versions (``dflash.drafter``, ``dflash.queue_core``, ...) stay importable:
:mod:`dflash._moved` maps each to its new home, so user scripts written against them keep working.
"""

from dflash import _moved

__version__ = "0.1.0"

_moved.install()
