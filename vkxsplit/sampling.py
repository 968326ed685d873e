"""Sampling the next token from the logits on the host (numpy): greedy, temperature, top-k,
top-p, min-p and llama.cpp's repeat penalty. Defaults: :mod:`vkxsplit.defaults`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .defaults import SAMPLING
from .errors import VkxError


class Sampler:
    """Greedy, temperature, top-k, top-p, min-p sampling and the repeat penalty on the host (numpy).

    Defaults: :mod:`vkxsplit.defaults` (shared with the command line). The repeat penalty is
    llama.cpp's: each distinct token among the last ``repeat_last_n`` of ``history`` has its
    logit divided by ``repeat_penalty`` where positive, multiplied where negative (also when
    greedy). min-p keeps the tokens whose probability is at least ``min_p`` times the largest."""

    def __init__(self, temperature: float = SAMPLING.temperature, top_k: int = SAMPLING.top_k,
                 top_p: float = SAMPLING.top_p, seed: int | None = None, min_p: float = SAMPLING.min_p,
                 repeat_penalty: float = SAMPLING.repeat_penalty, repeat_last_n: int = SAMPLING.repeat_last_n):
        def number(v: Any, integer: bool = False) -> bool:
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                return False
            return float(v) == int(v) if integer and math.isfinite(v) else math.isfinite(v)

        if not (number(temperature) and temperature >= 0 and number(top_p) and 0 < top_p <= 1
                and number(top_k, integer=True) and top_k >= 0 and number(min_p) and 0 <= min_p <= 1
                and number(repeat_penalty) and repeat_penalty > 0
                and number(repeat_last_n, integer=True) and repeat_last_n >= -1):
            raise VkxError(f"bad sampling parameters: temperature={temperature!r}, top_k={top_k!r}, top_p={top_p!r}, "
                           f"min_p={min_p!r}, repeat_penalty={repeat_penalty!r}, repeat_last_n={repeat_last_n!r}",
                           "temperature: a finite number >= 0 (0 = greedy); top_k: a whole number >= 0 "
                           "(0 = off); top_p: a number in (0, 1]; min_p: a number in [0, 1] (0 = off); "
                           "repeat_penalty: a number > 0 (1 = off); repeat_last_n: a whole number >= -1 "
                           "(-1 = the whole history)")
        temperature, top_k, top_p = float(temperature), int(top_k), float(top_p)
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.min_p, self.repeat_penalty, self.repeat_last_n = float(min_p), float(repeat_penalty), int(repeat_last_n)
        self.rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_logits(self) -> bool:
        """False when the GPU argmax gives the token (greedy without a repeat penalty)."""
        return not self.greedy or self.repeat_penalty != 1.0

    def penalize(self, logits: np.ndarray, history: list[int] | None) -> np.ndarray:
        """``logits`` with the repeat penalty applied over the recent ``history`` (a copy)."""
        if self.repeat_penalty == 1.0 or not history or self.repeat_last_n == 0:
            return logits
        recent = history if self.repeat_last_n < 0 else history[-self.repeat_last_n:]
        ids = np.unique(np.asarray(recent, np.int64))
        ids = ids[(ids >= 0) & (ids < len(logits))]
        out = logits.astype(np.float64)
        v = out[ids]
        out[ids] = np.where(v > 0, v / self.repeat_penalty, v * self.repeat_penalty)
        return out

    def sample(self, logits: np.ndarray, history: list[int] | None = None) -> int:
        logits = self.penalize(logits, history)
        if self.greedy:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.temperature
        idx = np.argsort(-z, kind="stable")
        if self.top_k:
            idx = idx[:self.top_k]
        p = np.exp(z[idx] - z[idx[0]])
        p /= p.sum()
        if self.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)
            idx, p = idx[:keep], p[:keep] / p[:keep].sum()
        if self.min_p > 0.0:
            keep = max(1, int(np.count_nonzero(p >= self.min_p * p[0])))
            idx, p = idx[:keep], p[:keep] / p[:keep].sum()
        return int(idx[self.rng.choice(len(idx), p=p)])


__all__ = ["Sampler"]
