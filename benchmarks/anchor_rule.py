"""Which anchor rule makes the better drafter: the training reference's or our earlier full-block rule.

Issue #36 item 4. The two rules:

- ``upstream`` (the code's, SpecForge's DFlash trainer): an anchor at ``p`` iff ``loss_mask[p]`` and
  ``loss_mask[p + 1]``; a block running past the end trains its remaining response slots under their
  weights; a sequence is dropped only without two consecutive response tokens.
- ``full_block`` (ours until issue #36): ``loss_mask[p]`` and ``p <= len - B``; a sequence whose
  response has no room for a whole block is dropped.

One fixed scorer for both (the yardstick does not move with the rule judged): the held-out metric of
:mod:`dflash.model.heldout` (its window is its own full-block rule, whatever the trainer's), on the
same held-out sequences, chosen among those both rules keep. Equal target tokens, not equal steps: each
arm walks the same seeded order of the profile's sequences, skipping those its rule drops, one sequence
per step, until it has sent ``--tokens`` target tokens (truncated lengths) through the target; the
rules differ in anchors per step and in which sequences they can use, so equal steps would not be equal
cost. Per seed both arms start from the same drafter initialisation and draw anchors from the same
seeded generator. The target's states are computed once per sequence and shared by the arms of a seed.

The comparison is paired: a bootstrap over the held-out sequences (the same resample for both arms)
of ``upstream - full_block`` in held-out loss and tau, averaged over the seeds; "resolved" means the
95% interval excludes 0. Run-to-run variance enters through the seeds (their per-seed differences are
printed; two seeds cannot estimate it well).

    python benchmarks/anchor_rule.py --tokens 30000 --seeds 0 1 --heldout 32
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RULES = ("full_block", "upstream")


def full_block_eligible(loss_mask, block_size: int):
    """The earlier rule, kept here only for this comparison: ``loss_mask[p]`` and ``p <= len - B``."""
    ok = loss_mask.bool().clone()
    ok[..., max(ok.shape[-1] - block_size + 1, 0):] = False
    return ok


def draw(eligible, max_anchors: int, gen):
    """Up to ``max_anchors`` eligible positions of one sequence, uniformly without replacement, sorted."""
    import torch

    pos = torch.nonzero(eligible, as_tuple=False).flatten()
    if pos.numel() > max_anchors:
        pos = pos[torch.randperm(pos.numel(), generator=gen)[:max_anchors]].sort().values
    return pos


def lr_factor(done: float, warmup: float = 0.04, decay: float = 0.2) -> float:
    """The profile's WSD shape on the share of the token budget spent: warm-up 4%, decay over the last 20%."""
    if done < warmup:
        return max(done / warmup, 1e-3)
    if done > 1.0 - decay:
        return max((1.0 - done) / decay, 1e-3)
    return 1.0


def paired_ci(rows: dict, n_boot: int, seed: int = 0) -> tuple[float, float, float]:
    """``upstream - full_block`` of a ratio metric averaged over seeds, and its 95% paired bootstrap
    interval over held-out sequences. ``rows[(rule, seed)]``: per-sequence (numerator, denominator)."""
    import numpy as np

    seeds = sorted({s for _, s in rows})
    num = {k: np.array([r[0] for r in v], float) for k, v in rows.items()}
    den = {k: np.array([r[1] for r in v], float) for k, v in rows.items()}
    n = len(next(iter(rows.values())))

    def diff(idx):
        return float(np.mean([num[("upstream", s)][idx].sum() / den[("upstream", s)][idx].sum()
                              - num[("full_block", s)][idx].sum() / den[("full_block", s)][idx].sum()
                              for s in seeds]))

    rng = np.random.default_rng(seed)
    point = diff(np.arange(n))
    boots = sorted(diff(rng.integers(0, n, n)) for _ in range(n_boot))
    return point, boots[int(0.025 * n_boot)], boots[int(0.975 * n_boot) - 1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/cpu-smollm2-learning.toml", help="the profile (a TOML file)")
    ap.add_argument("--tokens", type=int, default=30000, help="target tokens per run (>= 1)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="training seeds (>= 2 of them)")
    ap.add_argument("--heldout", type=int, default=32, help="held-out sequences (>= 4)")
    ap.add_argument("--window", type=int, default=32, help="held-out anchors per sequence (>= 1)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (>= 1)")
    ap.add_argument("--boot", type=int, default=2000, help="bootstrap resamples (>= 100)")
    args = ap.parse_args(argv)
    for name, ok in (("--tokens", args.tokens >= 1), ("--seeds", len(set(args.seeds)) >= 2),
                     ("--heldout", args.heldout >= 4), ("--window", args.window >= 1),
                     ("--threads", args.threads >= 1), ("--boot", args.boot >= 100)):
        if not ok:
            ap.exit(2, f"anchor_rule.py: error: {name} is out of range (see --help)\n")

    import torch

    from dflash.core.config import load_config
    from dflash.core.sampler import has_anchor
    from dflash.model.drafter import DFlashDrafter, DrafterSpec, anchor_eligible, default_mask_token_id
    from dflash.model.heldout import prepare_heldout, score_sequences, summarize
    from dflash.model.target import HiddenStateCapture, capture_layer_ids, load_target
    from dflash.pipeline.optim import build_optimizer
    from dflash.pipeline.training_data import TrainingData

    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    bs, max_anchors, max_len = cfg.drafter.block_size, cfg.drafter.anchors, cfg.workload.max_len
    target = load_target(cfg.target.model)
    layer_ids = capture_layer_ids(target.num_layers, cfg.target.capture_layers)
    capture = HiddenStateCapture(target.model, layer_ids)
    data = TrainingData(cfg, target.tokenizer)
    lengths, prompts = data.sampler.lengths, data.sampler.prompt_lengths
    keep = {"upstream": [has_anchor(n, p, max_len) for n, p in zip(lengths, prompts, strict=True)],
            "full_block": [p <= n - bs for n, p in zip(lengths, prompts, strict=True)]}
    dropped = {r: k.count(False) for r, k in keep.items()}
    print(f"anchor-rule: {len(lengths)} sequences; dropped: full_block {dropped['full_block']}, upstream "
          f"{dropped['upstream']}", flush=True)

    both = [i for i in range(len(lengths)) if keep["upstream"][i] and keep["full_block"][i]]
    held = sorted(random.Random(424_242).sample(both, args.heldout))
    t0 = time.perf_counter()
    held_seqs = ((i, str(data.conversations[i].id), 0, *data.encode(i)) for i in held)
    states = prepare_heldout(target.model, capture, held_seqs, 1, "cpu", torch.float32)
    print(f"held-out target side: {len(held)} sequences, {time.perf_counter() - t0:.0f} s", flush=True)
    pool = [i for i in range(len(lengths)) if i not in set(held)]

    spec = DrafterSpec.from_target_config(target.config, target_layer_ids=layer_ids,
                                          mask_token_id=default_mask_token_id(target.tokenizer), drafter=cfg.drafter)
    rows: dict = {}
    summaries: dict = {}
    target_s = 0.0
    for seed in args.seeds:
        order = pool[:]
        random.Random(seed).shuffle(order)
        cache: dict[int, tuple] = {}
        for rule in RULES:
            t_arm = time.perf_counter()
            torch.manual_seed(1000 + seed)
            drafter = DFlashDrafter.from_target(target.model, spec)
            drafter.train()
            opt = build_optimizer(drafter.trainable_parameters(), cfg.train)
            gen = torch.Generator().manual_seed(seed)
            spent = steps = anchors = 0
            for i in order:
                if spent >= args.tokens:
                    break
                if not keep[rule][i]:
                    continue
                if i not in cache:
                    t0 = time.perf_counter()
                    ids, lm = data.encode(i)
                    with torch.no_grad():
                        x = ids.view(1, -1)
                        ctx = capture(x, torch.ones_like(x)).float()
                    cache[i] = (x, lm.view(1, -1), ctx)
                    target_s += time.perf_counter() - t0
                x, lm, ctx = cache[i]
                elig = anchor_eligible(lm)[0] if rule == "upstream" else full_block_eligible(lm[0], bs)
                pos = draw(elig, max_anchors, gen)
                spent += int(x.shape[1])
                if pos.numel() == 0:  # the sampler's drop rule is exact enough that this does not happen
                    continue
                for g in opt.param_groups:
                    g["lr"] = cfg.train.lr * lr_factor(spent / args.tokens)
                res = drafter.loss(ctx, x, lm, anchors=pos.view(1, -1))
                opt.zero_grad(set_to_none=True)
                res.mean().backward()
                torch.nn.utils.clip_grad_norm_(drafter.trainable_parameters(), cfg.train.grad_clip)
                opt.step()
                steps += 1
                anchors += res.anchors
            got = score_sequences(drafter, states, anchors=args.window)
            rows[(rule, seed)] = got
            s = summarize(got, 1, bs, seed=0)
            summaries[(rule, seed)] = s
            print(f"  seed {seed} {rule}: {steps} steps, {spent} target tokens, {anchors / max(steps, 1):.1f} "
                  f"anchors/step; held-out loss {s['loss']:.3f} {s['loss_ci']}, tau {s['tau']:.3f} {s['tau_ci']}, "
                  f"acceptance {s['acceptance']:.3f}; {time.perf_counter() - t_arm:.0f} s", flush=True)
    loss = paired_ci({k: [(r[1], r[2]) for r in v] for k, v in rows.items()}, args.boot)
    tau = paired_ci({k: [(float(r[5]), float(r[6])) for r in v] for k, v in rows.items()}, args.boot)
    per_seed = "; ".join(
        f"seed {s}: loss {summaries[('upstream', s)]['loss'] - summaries[('full_block', s)]['loss']:+.3f}, "
        f"tau {summaries[('upstream', s)]['tau'] - summaries[('full_block', s)]['tau']:+.3f}" for s in args.seeds)

    def say(name, v):
        verdict = "resolved" if v[1] > 0 or v[2] < 0 else "not resolved"
        return f"{name} {v[0]:+.3f} [{v[1]:+.3f}, {v[2]:+.3f}] ({verdict})"

    print(f"anchor-rule: upstream - full_block at {args.tokens} target tokens, {len(args.seeds)} seeds, "
          f"{len(held)} held-out sequences x {args.window} anchors, paired: {say('loss', loss)}, {say('tau', tau)}; "
          f"{per_seed}; target side {target_s:.0f} s; {time.perf_counter() - t_start:.0f} s in all; "
          f"`python benchmarks/anchor_rule.py --tokens {args.tokens} --seeds {' '.join(map(str, args.seeds))} "
          f"--heldout {args.heldout} --window {args.window}`", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
