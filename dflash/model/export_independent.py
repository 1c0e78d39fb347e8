"""Step 3 of an export's checks: an independent reader (vLLM's ``speculators``) loads it and agrees.

speculators pins transformers <= 5.19 and torch <= 2.14.1 (dflash runs newer ones), so it lives in
a virtual environment of its own (``scripts/speculators_venv.sh``) and runs as a subprocess: the
standalone script :mod:`dflash.model.export_reader_speculators` loads the export with speculators'
converter and model and writes what its forward computed on the reference block. Here that output
is compared with the export's reference, and the config values speculators read (its layer ids,
block size, MASK id) with ours. Where the environment or the target checkpoint is missing the check
is skipped, and the reason says what to install.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from dflash.model.export_reference import MANIFEST, REFERENCE_FILE, ExportCheckError, Reference, compare, read_json

READER = Path(__file__).with_name("export_reader_speculators.py")
VENV_ENV = "DFLASH_SPECULATORS_VENV"
TIMEOUT_S = 900.0
NAME = "independent reader (speculators)"


def speculators_python() -> tuple[Path | None, str]:
    """The speculators venv's python, or None and why not."""
    venv = Path(os.environ.get(VENV_ENV) or Path.home() / ".cache" / "dflash" / "speculators-venv").expanduser()
    py = venv / "bin" / "python"
    if not py.is_file():
        return None, f"no speculators environment at {venv} (create it: bash scripts/speculators_venv.sh)"
    return py, ""


def independent_check(out: Path, fmt: str, verifier: str) -> tuple[str, str]:
    """``("ok", detail)`` or ``("skipped", reason)``; raises :class:`ExportCheckError` on disagreement."""
    py, why = speculators_python()
    if py is None:
        return "skipped", why
    if not Path(verifier).is_dir():
        return "skipped", f"the target checkpoint {verifier!r} is not a local directory on this machine"
    with tempfile.TemporaryDirectory(prefix="dflash-indep-") as tmp:
        res = _run(py, out, fmt, verifier, Path(tmp))
        if res.returncode != 0:
            last = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ExportCheckError(NAME, f"failed to load the export: {last}")
        return "ok", _compare(out, Path(tmp))


def _run(py: Path, out: Path, fmt: str, verifier: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONNOUSERSITE="1", OMP_NUM_THREADS="1")
    cmd = [str(py), str(READER), "--format", fmt, "--export", str(out), "--verifier", str(verifier),
           "--out", str(tmp / "read")]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise ExportCheckError(NAME, f"did not finish in {TIMEOUT_S:.0f} s") from None


def _compare(out: Path, tmp: Path) -> str:
    from safetensors.torch import load_file

    manifest = read_json(out / MANIFEST)
    ref = Reference.from_tensors(load_file(str(out / REFERENCE_FILE)))
    got = load_file(str(tmp / "read" / "outputs.safetensors"))
    read = read_json(tmp / "read" / "read.json")
    want_aux = [i + 1 for i in manifest["capture_layers"]]
    if read["aux_hidden_state_layer_ids"] != want_aux:
        raise ExportCheckError("aux_hidden_state_layer_ids", f"speculators reads {read['aux_hidden_state_layer_ids']},"
                                                             f" the trained capture layers are {want_aux} there")
    for key in ("block_size", "mask_token_id"):
        if read[key] != manifest[key]:
            raise ExportCheckError(key, f"speculators reads {read[key]}, the drafter was trained with {manifest[key]}")
    problem = compare("hidden states", got["hidden"], ref.hidden) or compare("logits", got["logits"], ref.logits)
    if problem:
        raise ExportCheckError(NAME, problem)
    diff = float((got["logits"] - ref.logits).abs().max())
    return f"speculators {read['speculators_version']}: logits within {diff:.2g} of ours, layer ids {want_aux}"
