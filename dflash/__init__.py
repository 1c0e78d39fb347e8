"""dflash-tune: tune the hidden-state queue of a decoupled DFlash drafter-training pipeline."""
__version__ = "0.1.0"
