"""dflash-tune: tune the hidden-state queue of a decoupled DFlash drafter-training pipeline.

The package is laid out by docs/ARCHITECTURE.md ("Layering"): ``core/`` (torch-free rules: config,
queue policy and core, sampler, metrics, records), ``data/`` (conversations, finding a model, length
cache), ``model/`` (target capture, drafter, acceptance, export), ``pipeline/`` (the trainer),
``regenerate/`` and the CLI. The flat module paths of early versions (``dflash.drafter``, ...) are
gone: import from the subpackages.
"""

__version__ = "0.1.0"
