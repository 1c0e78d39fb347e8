"""Models: the frozen target and its hidden-state capture, the DFlash drafter and its loss,
acceptance-length evaluation, and export to serving layouts. Uses ``dflash.data`` and the core."""
