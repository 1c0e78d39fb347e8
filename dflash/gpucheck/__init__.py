"""``dflash gpu-check``: the acceptance run a user starts on their own node before a long job.

It drives the product's real verbs in subprocesses (regenerate -> train -> eval -> calibrate ->
simulate -> train a second configuration, and one short train with the sharing data plane refused)
and writes one JSON of what it measured. Why a package and not a side script: users run it on an
air-gapped GPU node from the installed wheel, where ``scripts/`` does not exist; the scripts
(``scripts/gpu_check.sh``, ``scripts/gpu_check.py``) are thin wrappers around ``dflash gpu-check``.

Modules: :mod:`.plan` (what to run, decided once; up-front checks of dependencies, model and data),
:mod:`.assets` (random targets, synthetic data, the run configs), :mod:`.sampling` (memory, GPU
utilisation and power while a verb runs), :mod:`.figures` (what the JSON reports from a run's
records), :mod:`.report` (the JSON, written on every exit) and :mod:`.check` (the loop).

It stands on the tuning floor (tests/test_layout.py): it reads the config layer and the data
plane names of the pipeline, and runs everything else through ``python -m dflash``.
"""
