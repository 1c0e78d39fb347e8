"""``dflash validate``: the selection on the real trainer, next to the calibrated simulator's word.

For every configuration of a selection (the sweep's top-k plus ``baseline`` and ``handpicked``)
workers claim blocks of takes (:mod:`.claims`), train them on the real trainer (:mod:`.runner`),
measure docs/ARCHITECTURE.md's metrics on each block alone (:mod:`.metrics`), and simulate the same
configuration under the calibration (:mod:`.predict`). When every block is done, the worker that sees
it writes ``validation.json`` and ``best.toml`` (:mod:`.summary`) with the recommendation
(:mod:`.recommendation`, deciding by :mod:`.evidence`). With ``[train] quality_every`` the runs also
score their drafters on one shared held-out set (its target states computed once per validation),
each configuration trains ``--seeds`` runs, and held-out tau and loss join the compared objectives,
compared paired with the variance between seeds (:mod:`.paired`, :mod:`.quality`); :mod:`.drift`
separates machine drift from model error.

One job per module, imported in this order (no module imports one after it):

- :mod:`.evidence`: intervals, looks and the recommendation rule (pure);
- :mod:`.claims`: the claim table in a shared SQL database;
- :mod:`.plan`: the job's arguments, selection, identity, units and rounds;
- :mod:`.metrics`: a block's metrics from its own records; block means; errors against a prediction;
- :mod:`.paired`: the paired held-out comparison over the same sequences, with the variance between
  training seeds (pure);
- :mod:`.quality`: the held-out objective read from the runs (every seed's run of each configuration);
- :mod:`.drift`: each run calibrated alone;
- :mod:`.predict`: the calibrated simulator's prediction;
- :mod:`.acceptance`: tau of a final drafter on prompts it never trained on;
- :mod:`.runner`: one block on the real trainer (the one module that starts trainer processes);
- :mod:`.model_error` and :mod:`.decision`: τ fixed in advance, and the decision with the simulator and
  the hardware together (pure);
- :mod:`.recommendation`: the tuned configuration under test, its hardware-only comparisons, the stop
  reason, and the decision's inputs (every pair, every objective: :func:`.recommendation.decide_validation`);
- :mod:`.summary`: validation.json, best.toml and the CLI's text;
- :mod:`.job`: the claim loop that ties them together (``run_validation``).

Like with like (issue #32): a hardware block and the simulator's prediction of it are one computation
(:func:`.metrics.records_block_metrics`: the configured window, the same warm-up rule, span and step
range; block 0 dropped in both when there are two blocks or more); the prediction runs on seeds
disjoint from the sweep's (:func:`.predict.prediction_seeds`); rounds pair the configurations on one
data order (one sampler seed). docs/guide/validate.md is the user's page.

``validation.json`` (written by :func:`.summary.write_summary`; :mod:`reports.answer` and the report
read it), the fields added for the decision:

- ``block_takes``, ``block_reason``: the block length and why (:func:`.plan.block_rule`);
- ``window``: the metrics window of every block and prediction; ``transient``: the rule for block 0;
- ``prediction_seeds``, ``sweep_seeds``: the simulator's seeds here and the sweep's they avoid;
  ``data_order``: the sampler seed, order and mega-batch every configuration shares;
- ``decision``: :meth:`.decision.Decision.as_json` (outcome, chosen, comparisons with the simulated and
  measured differences, τ, gap z, margin, verdict, power; ``inputs`` rebuild it through
  :func:`.decision.decide_from_json`);
- ``pathology``: name -> ``longest_streak``, ``streak_takes``, ``top_share``, ``top_bucket``, ``takes``
  (:func:`.metrics.bucket_use`);
- per configuration (``configs[i]``): ``kept_blocks``, ``bucket_use``, and in ``predicted`` per metric
  ``mean``/``se`` (over prediction seeds), ``sd_block``, ``per_seed``, plus ``blocks`` (metric -> per
  seed, the kept blocks' values) and ``seeds``;
- ``chosen``/``best_toml``/``command``: the decision's pick (without a decision, the hardware-only
  ``recommendation``'s, which keeps its "more takes" figure as a note).

This package is the one part of :mod:`tuning` that reaches into the pipeline and the model
(tests/test_layout.py holds that): it stands on a floor of its own above the rest of ``tuning``.
The package's ``__init__`` imports nothing, so importing one module loads only what that module needs.
"""
