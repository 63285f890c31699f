"""Float comparisons whose tolerance scales with the magnitude of what is compared.

Two float32 computations of the same quantity (padded vs packed, chunked vs full logits, one
rank vs two, one pass vs micro-batches, or one CPU's kernels vs another's: SIMD width, BLAS
code path, thread count) sum the same terms in different orders. Their difference is rounding
noise whose size follows the magnitude of the terms summed, roughly the largest values of the
tensor, not each element: an element that is a small difference of large terms carries the
large terms' noise. An elementwise ``rtol`` (``torch.allclose``) or a fixed ``atol`` below that
noise passes on the machine where the test was written and fails on one that sums in another
order. Here the tolerance is ``rel x scale``: ``scale`` is the largest ``|want|`` of the tensor
by default, or given by the caller where the terms are larger than the result (a loss whose
terms cancel; a weight update, whose size is the learning rate). Any real defect these tests
exist for (attention leaking between packed sequences, a micro-batch weighed wrongly) changes
values by O(1) relative, far above ``rel``.

Margins: with ``FORGE_TEST_MARGINS=<file>`` each comparison appends a JSON line (the test, what
was compared, the measured difference, the allowed one and their ratio, the margin), so runs
under other kernel settings (``ATEN_CPU_CAPABILITY``, ``OMP_NUM_THREADS``, ...) can measure how
much room each tolerance leaves.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch

MARGINS_ENV = "FORGE_TEST_MARGINS"


def assert_close_to_scale(got, want, rel: float = 1e-5, *, scale: float | None = None, what: str = "values") -> float:
    """Assert ``max |got - want| <= rel * scale`` and return the margin (difference / allowed).

    ``got``/``want``: tensors, numbers or sequences of numbers of one shape, or two mappings
    with the same keys (e.g. state dicts), compared key by key (each key its own scale unless
    ``scale`` is given) and reported by the worst key. ``scale`` defaults to ``max |want|``.
    """
    if isinstance(want, Mapping):
        assert isinstance(got, Mapping) and got.keys() == want.keys(), f"{what}: keys differ"
        worst = max(((k, *_measure(got[k], want[k], rel, scale)) for k in want), key=lambda r: r[1] / r[3])
        key, diff, scale_used, allowed = worst
        what = f"{what} (worst: {key})"
    else:
        diff, scale_used, allowed = _measure(got, want, rel, scale)
    margin = diff / allowed if allowed > 0 else (0.0 if diff == 0 else float("inf"))
    _record(what, diff, allowed, margin)
    assert margin <= 1.0, (
        f"{what}: max |got - want| = {diff:.3g} > allowed {allowed:.3g} (rel {rel:g} x scale {scale_used:.3g}); "
        f"relative error {diff / scale_used if scale_used else float('inf'):.3g}"
    )
    return margin


def max_abs(values) -> float:
    """The largest ``|x|`` of a tensor, a number, or a mapping of them: e.g. one scale for a whole
    model's gradients, where an element of a small tensor (a norm's weight: a sum over tokens whose
    terms cancel) carries the noise of terms as large as the model's larger gradients."""
    if isinstance(values, Mapping):
        return max((max_abs(v) for v in values.values()), default=0.0)
    t = torch.as_tensor(values).detach()
    return float(t.abs().max()) if t.numel() else 0.0


def _measure(got, want, rel: float, scale: float | None) -> tuple[float, float, float]:
    """(max |got - want|, the scale, the allowed difference), in float64."""
    g = torch.as_tensor(got).detach().to("cpu", torch.float64)
    w = torch.as_tensor(want).detach().to("cpu", torch.float64)
    assert g.shape == w.shape, f"shapes differ: {tuple(g.shape)} vs {tuple(w.shape)}"
    diff = float((g - w).abs().max()) if w.numel() else 0.0
    if scale is None:
        scale = float(w.abs().max()) if w.numel() else 0.0
    return diff, float(scale), rel * float(scale)


def _record(what: str, diff: float, allowed: float, margin: float) -> None:
    """One JSON line in the file ``FORGE_TEST_MARGINS`` names, if set."""
    path = os.environ.get(MARGINS_ENV)
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    with open(path, "a") as f:
        f.write(json.dumps({"test": test, "what": what, "diff": diff, "allowed": allowed, "margin": margin}) + "\n")
