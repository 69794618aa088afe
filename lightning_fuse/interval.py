"""The speedup's interval: the ratio of the eager reference's median step to the compiled one's, with its spread.

The eager reference comes in chunks of steps in a row (:data:`~lightning_fuse.timing.CHUNK`), each one moment of the
run, and a shared machine's speed moves between moments by more than it varies within one: on the H100 machines a
chunk's median of eager steps spread by 13-26% (lognormal sd) between the moments of one fit
(``benchmarks/RESULTS.md``). So where the reference holds two chunks or more, each chunk is one observation of the
run's eager speed, and the eager side's spread is a Student-t on the chunks' log medians with one degree of freedom
fewer than chunks, the rule for few clusters (a bootstrap that resamples two or three chunks cannot see how far a
third moment would fall, and missed the separate eager fits' median in about half the draws of two). The interval
widens with the drift between the moments it saw and narrows as it sees more. One chunk shows no drift: its
steps are resampled as if independent, and the interval is a lower bound (the verdict calls such a reference thin).

Example::

    >>> eager = [30.0, 30.2, 29.9, 30.1, 36.0, 36.1, 35.8, 36.2]  # two moments, the second 20% slower
    >>> compiled = [10.0, 10.1, 9.9, 10.0, 10.2, 9.8]
    >>> _, low, high = speedup_interval(eager, compiled)  # as if 8 independent steps
    >>> _, chunked_low, chunked_high = speedup_interval(eager, compiled, chunks=[4, 4])
    >>> chunked_high - chunked_low > high - low
    True
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence

import numpy as np
from scipy import stats

BOOTSTRAP_RESAMPLES = 1000
"""Resamples of :func:`speedup_interval`: its bounds move by ~1% of the interval's width between seeds."""
BOOTSTRAP_MAX_SAMPLES = 4000
"""Each side is thinned evenly to at most this many steps for the bootstrap (not for the point): a median of 4000
steps is already far steadier than the reference's, and a 100k-step epoch would take seconds otherwise."""
_RNG_ARG = "rng" if "rng" in inspect.signature(stats.bootstrap).parameters else "random_state"  # scipy < 1.15


def speedup_interval(
    eager_ms: Sequence[float], compiled_ms: Sequence[float], confidence: float = 0.95, seed: int = 0,
    chunks: Sequence[int] | None = None,
) -> tuple[float | None, float | None, float | None]:  # fmt: skip
    """The speedup (median eager step over median compiled step) with a bootstrap interval.

    The compiled steps are resampled (:data:`BOOTSTRAP_RESAMPLES` times, percentile method, seeded). With ``chunks``
    of two or more, the eager median is drawn as many times from its chunks' Student-t (the module's docstring says
    why; never narrower than its steps' own spread); otherwise ``scipy.stats.bootstrap`` resamples each side's steps.
    On lognormal step times the interval covers the true ratio in 93-96% of trials at 95%, from 5 eager steps up;
    with drift between chunks, in about 95% from two chunks up (``tests/test_timing.py``). Nothing clamps the ratio:
    a plan slower than eager gives less than 1.

    Args:
        eager_ms: The eager reference's step times, oldest first (e.g. :attr:`ReferencePool.samples`).
        compiled_ms: The compiled step times of the epoch.
        confidence: Confidence level of the interval, in (0, 1).
        seed: Seed of the resampling, so the same steps give the same interval.
        chunks: How many of ``eager_ms``' steps each chunk holds, in order (e.g. :attr:`ReferencePool.chunks`);
            ``None``: one chunk.

    Returns:
        ``(point, low, high)``. ``point`` is ``None`` without a step on either side; ``low`` and ``high`` are
        ``None`` with fewer than 2 steps on a side or all steps equal on both.

    Raises:
        ValueError: If ``confidence`` is not in (0, 1), or ``chunks`` do not add up to the eager steps.

    Example::

        >>> speedup_interval([12.0], [10.0, 10.0])
        (1.2, None, None)
        >>> point, low, high = speedup_interval([9.0, 9.5, 9.2, 9.4, 9.1], [10.0, 10.4, 10.1, 9.9, 10.2])
        >>> round(point, 2), round(low, 2), round(high, 2)  # slower than eager, and clearly so
        (0.91, 0.88, 0.95)
    """
    if not 0 < confidence < 1:
        raise ValueError(f"`confidence` must be in (0, 1), e.g. 0.95, got {confidence}.")
    if chunks is not None and sum(chunks) != len(eager_ms):
        raise ValueError(f"`chunks` {list(chunks)} hold {sum(chunks)} steps, but `eager_ms` has {len(eager_ms)}.")
    eager, compiled = np.asarray(eager_ms, dtype=float), np.asarray(compiled_ms, dtype=float)
    if not len(eager) or not len(compiled) or np.median(compiled) <= 0:
        return None, None, None
    point = float(_ratio_of_medians(eager, compiled))
    if len(eager) < 2 or len(compiled) < 2 or (np.ptp(eager) == 0 and np.ptp(compiled) == 0):
        return point, None, None
    rng = np.random.default_rng(seed)
    if chunks is not None and len(chunks) > 1:
        thinned = _thin(compiled)
        compiled_medians = np.median(rng.choice(thinned, (BOOTSTRAP_RESAMPLES, len(thinned))), axis=1)
        log_ratios = _eager_log_medians(eager, chunks, rng) - np.log(compiled_medians)
        low, high = np.exp(np.percentile(log_ratios, [50 * (1 - confidence), 50 * (1 + confidence)]))
    else:
        result = stats.bootstrap(
            (_thin(eager), _thin(compiled)), _ratio_of_medians, n_resamples=BOOTSTRAP_RESAMPLES, vectorized=True,
            paired=False, confidence_level=confidence, method="percentile", **{_RNG_ARG: rng},
        )  # fmt: skip
        low, high = result.confidence_interval
    if not (math.isfinite(low) and math.isfinite(high)):
        return point, None, None
    return point, float(low), float(high)


def _eager_log_medians(eager: np.ndarray, chunks: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """:data:`BOOTSTRAP_RESAMPLES` draws of the log of the run's eager median from ``eager``'s chunks (moments): the
    pooled median's log plus ``se * t``, ``t`` a Student-t with one degree of freedom fewer than chunks and ``se`` the
    standard error of the chunks' mean log median, or of the steps' as if independent where that is larger."""
    logs = np.log(eager)
    medians = np.array([np.median(chunk) for chunk in np.split(logs, np.cumsum(chunks)[:-1])])
    se = max(medians.std(ddof=1) / math.sqrt(len(medians)), logs.std(ddof=1) / math.sqrt(len(logs)))
    return math.log(np.median(eager)) + se * rng.standard_t(len(medians) - 1, BOOTSTRAP_RESAMPLES)


def _ratio_of_medians(eager: np.ndarray, compiled: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.median(eager, axis=axis) / np.median(compiled, axis=axis)


def _thin(sample: np.ndarray) -> np.ndarray:
    if len(sample) <= BOOTSTRAP_MAX_SAMPLES:
        return sample
    return sample[np.linspace(0, len(sample) - 1, BOOTSTRAP_MAX_SAMPLES).round().astype(int)]
