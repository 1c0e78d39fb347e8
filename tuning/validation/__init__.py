"""``dflash validate``: the selection on the real trainer, next to the calibrated simulator's word.

For every configuration of a selection (the sweep's top-k plus ``baseline`` and ``handpicked``)
workers claim blocks of takes (:mod:`.claims`), train them on the real trainer (:mod:`.runner`),
measure docs/ARCHITECTURE.md's metrics on each block alone (:mod:`.metrics`), and simulate the same
configuration under the calibration (:mod:`.predict`). When every block is done, the worker that sees
it writes ``validation.json`` and ``best.toml`` (:mod:`.summary`) with the recommendation
(:mod:`.recommendation`, deciding by :mod:`.evidence`). With ``[train] quality_every`` the runs also
score their drafters on one shared held-out set, and held-out tau and loss join the compared
objectives (:mod:`.quality`); :mod:`.drift` separates machine drift from model error.

One job per module, imported in this order (no module imports one after it):

- :mod:`.evidence`: intervals, looks and the recommendation rule (pure);
- :mod:`.claims`: the claim table in a shared SQL database;
- :mod:`.plan`: the job's arguments, selection, identity, units and rounds;
- :mod:`.metrics`: a block's metrics from its own records; block means; errors against a prediction;
- :mod:`.quality`: the held-out objective read from the runs;
- :mod:`.drift`: each run calibrated alone;
- :mod:`.predict`: the calibrated simulator's prediction;
- :mod:`.acceptance`: tau of a final drafter on prompts it never trained on;
- :mod:`.runner`: one block on the real trainer (the one module that starts trainer processes);
- :mod:`.recommendation`: the tuned configuration under test, its comparisons, the pick, the stop reason;
- :mod:`.summary`: validation.json, best.toml and the CLI's text;
- :mod:`.job`: the claim loop that ties them together (``run_validation``).

This package is the one part of :mod:`tuning` that reaches into the pipeline and the model
(tests/test_layout.py holds that): it stands on a floor of its own above the rest of ``tuning``.
The package's ``__init__`` imports nothing, so importing one module loads only what that module needs.
"""
