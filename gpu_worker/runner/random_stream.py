"""The random stream of seeded requests, counter-based: the draw for the token at position p (the number
of tokens before it, prompt included) uses a generator seeded with `stream_key(seed, p)`, so a request
samples the same tokens whatever process, batch or step it lands in, and after a preemption."""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers that spreads every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_key(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw at `position`: a function of (seed, position) alone."""
    return _splitmix64((seed & _MASK64) ^ _splitmix64(position))


class Streams:
    """One reusable generator per device, reseeded for each seeded draw (building one costs more)."""

    def __init__(self) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}

    def at(self, device: torch.device, seed: int, position: int) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        return generator.manual_seed(stream_key(seed, position))


STREAMS = Streams()  # the process's, shared by every sampling call
