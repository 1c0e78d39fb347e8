"""The simulator's error on a *difference* between two configurations, fixed in advance.

Why in advance: the decision (:mod:`tuning.validation.decision`) weighs the simulator's predicted
difference against the hardware's measured one. If the simulator's error were estimated from the
same runs being judged, a run that disagreed with the simulator would widen the simulator's error
bar and so shrink its own disagreement: the evidence would grade itself. So τ (tau) comes only from
independent data, is written here as constants with where they came from, and the decision reads
them from this module alone (it has no argument through which a judged run could set τ).

Why a *difference*: a calibrated simulator's errors on two configurations of one profile are
correlated (the same timing fit, the same workload), so the error of their difference is smaller
than either error alone. That is what matters for "is A better than B". τ is the standard deviation
of that error.

Provenance: ``benchmarks/fidelity.py`` (issue #7; benchmarks/RESULTS.md "Simulator fidelity on the
CPU", second pass, command ``python benchmarks/fidelity.py --out fidelity --repredict``). Per CPU
profile one run calibrated the simulator; two *other* configurations (other knobs, other policies),
never seen by the calibration, ran 300 takes each on the real trainer and were predicted. The
prediction errors (predicted minus measured; relative for throughput, absolute for mix_efficiency):

=============  ===================  ===========  ==============
profile        configuration        throughput   mix_efficiency
=============  ===================  ===========  ==============
target-bound   tb-fullest-10-30     -1.8%        -0.014
target-bound   tb-prop-5-60         -3.3%        -0.009
drafter-bound  db-random-10-30      -1.6%        -0.011
drafter-bound  db-fullest-20-60     -8.3%        -0.026
=============  ===================  ===========  ==============

Within a profile, the error of a difference is the difference of the two errors: throughput +1.5%
and +6.7% (relative), mix_efficiency -0.005 and +0.015. τ is their root mean square (the maximum
likelihood standard deviation of zero-mean errors): throughput sqrt((1.5² + 6.7²)/2) = 4.9% of the
level, mix_efficiency sqrt((0.005² + 0.015²)/2) = 0.011. Two pairs are few: the decision's operating
characteristics (``benchmarks/decision_oc.py``) are measured with worlds whose simulator errs by up
to twice the margin, far beyond these τ, and the gap test is what protects the decision there.

The held-out objectives (``heldout_tau``, ``heldout_loss``) have no τ: the simulator does not predict
them, so their decisions are the hardware's alone.
"""

from __future__ import annotations

from dataclasses import dataclass

FIDELITY_COMMAND = "python benchmarks/fidelity.py --out fidelity --repredict"


@dataclass(frozen=True)
class ModelError:
    """τ of one objective: the standard deviation of the simulator's error on a difference.

    ``relative``: τ is a fraction of the level (the pair's reference value), as throughput errors are;
    otherwise it is in the objective's own unit.
    """

    objective: str
    tau: float
    relative: bool
    pair_errors: tuple[float, ...]  # the differences of errors τ was computed from
    provenance: str

    def absolute(self, scale: float) -> float:
        """τ in the objective's unit for a pair whose reference level is ``scale``."""
        return self.tau * abs(scale) if self.relative else self.tau

    def as_json(self) -> dict[str, object]:
        return {"objective": self.objective, "tau": self.tau, "relative": self.relative,
                "pair_errors": list(self.pair_errors), "provenance": self.provenance}


def _rms(xs: tuple[float, ...]) -> float:
    return (sum(x * x for x in xs) / len(xs)) ** 0.5


_THROUGHPUT_PAIRS = (-0.018 - -0.033, -0.016 - -0.083)  # target-bound, drafter-bound (relative)
_MIX_PAIRS = (-0.014 - -0.009, -0.011 - -0.026)  # target-bound, drafter-bound (absolute)
_SOURCE = (f"benchmarks/fidelity.py held-out configurations ({FIDELITY_COMMAND}; benchmarks/RESULTS.md, "
           "'Simulator fidelity on the CPU'): per profile, the difference of two configurations' prediction "
           "errors; tau = their root mean square")

MODEL_ERROR: dict[str, ModelError] = {
    "throughput_tokens_per_s": ModelError("throughput_tokens_per_s", round(_rms(_THROUGHPUT_PAIRS), 4), True,
                                          tuple(round(x, 4) for x in _THROUGHPUT_PAIRS), _SOURCE),
    "mix_efficiency": ModelError("mix_efficiency", round(_rms(_MIX_PAIRS), 4), False,
                                 tuple(round(x, 4) for x in _MIX_PAIRS), _SOURCE),
}
