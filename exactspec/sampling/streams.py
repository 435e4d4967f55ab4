"""Random streams and inverse-CDF sampling. All randomness enters as float64 uniforms.

`RowStreams` gives every batch row its own counter-based stream: the uniforms a row sees depend
only on (its seed, its own step count, a domain, a column), never on the other rows, so the same
seed gives the same text alone or inside any batch. Coupled verification reads one more kind,
`RowStreams.at_positions`: the uniform of an output position, a hash of (seed, position) alone,
so it is the same whatever the step it is drawn in (the draft length, speculation on or off). Domains keep drafting and acceptance apart
(reusing one uniform for both is one of the pitfalls the audit catches).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Domains: which decision a uniform is for. Draft position j uses DOMAIN_DRAFT + j.
DOMAIN_ACCEPT = 1  # how many draft tokens are accepted
DOMAIN_RESAMPLE = 2  # the recovered / bonus token
DOMAIN_SAMPLE = 3  # a plain draw (autoregressive decoding)
DOMAIN_DRAFT = 64  # + draft position
DOMAIN_POSITION = 5  # coupled verification's uniform of an output position (no step)

_MASK64 = (1 << 64) - 1


def _i64(c: int) -> int:
    """A 64-bit constant as the signed int64 torch stores."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)
_POSITION_SALT = _i64(0xD6E8FEB86659FD93)  # keeps position keys apart from the step keys


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (multiplication wraps modulo 2^64)."""
    z = z + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


_COLUMNS: dict[tuple[int, int, torch.device], torch.Tensor] = {}  # see _columns


def _columns(n: int, domain: int, device: torch.device) -> torch.Tensor:  # [1, n] int64
    """The hashed column ids of a domain, `_mix(column + (domain << 32))`: constants, kept."""
    key = (n, domain, device)
    cols = _COLUMNS.get(key)
    if cols is None:
        if len(_COLUMNS) > 4096:  # many widths (trees, large n): start over, never grow unbounded
            _COLUMNS.clear()
        cols = _mix(torch.arange(n, dtype=torch.long, device=device)[None, :] + (domain << 32))
        _COLUMNS[key] = cols
    return cols


class RowStreams:
    """Per-row counter-based random streams for a batch.

    Row b's uniform at (step, domain, column) is a hash of (seed_b, step, domain, column).
    """

    def __init__(self, seeds: torch.Tensor, steps: torch.Tensor | None = None) -> None:
        self.seeds = seeds.long()  # [B] one 64-bit seed per row
        self.steps = torch.zeros_like(self.seeds) if steps is None else steps.long()  # [B]
        # the step's row keys [B, 1], with copies of the seeds and steps they were hashed from
        # (`advance`, or any other change of either, makes them stale)
        self._key: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_seed(cls, seed: int, num_rows: int, device: torch.device | str = "cpu") -> RowStreams:
        """Row i's seed is derived from (seed, i): independent of the batch around it."""
        base = _mix(torch.tensor([_i64(seed & _MASK64)], dtype=torch.long))  # [1]
        rows = torch.arange(num_rows, dtype=torch.long)
        return cls(_mix(base ^ _mix(rows)).to(device))

    def __len__(self) -> int:
        return self.seeds.shape[0]

    @property
    def device(self) -> torch.device:
        return self.seeds.device

    def select(self, rows: torch.Tensor) -> RowStreams:
        """The streams of a subset of rows (e.g. the ones still generating), identities kept."""
        rows = rows.to(self.seeds.device)
        return RowStreams(self.seeds[rows], self.steps[rows])

    def advance(self, rows: torch.Tensor | None = None) -> None:
        """Move every row (or the given rows) to its next step."""
        if rows is None:
            self.steps += 1
        else:
            self.steps[rows.to(self.steps.device)] += 1

    def uniform(self, n: int, domain: int) -> torch.Tensor:  # [B, n] float64 in [0, 1)
        """n uniforms per row for this step and domain; column j does not depend on n.

        The row keys are hashed once per step (every draw of a step shares them) and the column
        hashes once per (n, domain, device): one mix per call instead of four, the same bits.
        """
        held = self._key
        if (held is None or held[1].shape != self.steps.shape
                or not torch.equal(held[1], self.steps) or not torch.equal(held[0], self.seeds)):
            key = _mix(self.seeds ^ _mix(self.steps))[:, None]  # [B, 1]
            held = self._key = self.seeds.clone(), self.steps.clone(), key
        z = _mix(held[2] ^ _columns(n, domain, self.seeds.device))  # [B, n]
        return _shr(z, 11).to(torch.float64) * (1.0 / (1 << 53))

    def at_positions(self, positions: torch.Tensor) -> torch.Tensor:  # [B, n] -> [B, n] f64
        """The uniform of each row's output positions (0 = the first generated token): a hash
        of (seed, position) alone, never of the step, so the draw at a position is the same in
        plain decoding, at any draft length and in any batch (coupled verification)."""
        dev = self.seeds.device
        key = _mix(self.seeds ^ _POSITION_SALT)[:, None]  # [B, 1]
        z = _mix(key ^ _mix(positions.to(dev).long() + (DOMAIN_POSITION << 32)))  # [B, n]
        return _shr(z, 11).to(torch.float64) * (1.0 / (1 << 53))


Randomness = torch.Generator | Sequence[torch.Generator] | RowStreams | None


def uniforms(generator: Randomness, rows: int, n: int, domain: int,
             device: torch.device | str = "cpu") -> torch.Tensor:  # [rows, n] float64
    """Draw float64 uniforms in [0, 1) from whichever kind of randomness the caller passed."""
    if isinstance(generator, RowStreams):
        if len(generator) != rows:
            raise ValueError(f"RowStreams has {len(generator)} rows, the batch has {rows}")
        return generator.uniform(n, domain).to(device)
    if generator is None or isinstance(generator, torch.Generator):
        gen_device = generator.device if generator is not None else device
        return torch.rand(rows, n, dtype=torch.float64, generator=generator,
                          device=gen_device).to(device)
    gens = list(generator)
    if len(gens) != rows:
        raise ValueError(f"got {len(gens)} generators for a batch of {rows} rows; pass one per row")
    return torch.stack([torch.rand(n, dtype=torch.float64, generator=g, device=g.device)
                        for g in gens]).to(device)


def position_uniforms(generator: Randomness,
                      positions: torch.Tensor) -> torch.Tensor:  # [B, n] long -> [B, n] f64
    """Coupled verification's uniforms of the rows' output positions: RowStreams'
    `at_positions`; any other randomness has no positions and draws fresh uniforms."""
    if isinstance(generator, RowStreams):
        if len(generator) != positions.shape[0]:
            raise ValueError(f"RowStreams has {len(generator)} rows, positions has "
                             f"{positions.shape[0]}")
        return generator.at_positions(positions).to(positions.device)
    return uniforms(generator, positions.shape[0], positions.shape[1], DOMAIN_POSITION,
                    positions.device)


def sample_from_weights(
    weights: torch.Tensor,  # [B, V] non-negative, need not be normalised
    u: torch.Tensor,  # [B] float64 uniforms in [0, 1)
) -> torch.Tensor:  # [B] long
    """Inverse-CDF draw in float64; never returns a token of zero weight."""
    cdf = weights.to(torch.float64).cumsum(-1)  # [B, V]
    target = (u.to(cdf.device) * cdf[:, -1])[:, None]  # [B, 1]
    idx = torch.searchsorted(cdf, target, right=True)  # first index with cdf > target
    return idx.squeeze(-1).clamp(max=weights.shape[-1] - 1)


def sample(
    probs: torch.Tensor,  # [B, V] standardized distributions
    generator: Randomness = None,
    *,
    domain: int = DOMAIN_SAMPLE,
    greedy: bool = False,
) -> torch.Tensor:  # [B] long
    """Draw one token per row from `probs` with the row's own randomness.

    greedy=True: every row is a one-hot (temperature 0, `probs_from_logits`), so the draw is its
    hot index, the very token the inverse CDF gives for any uniform. With RowStreams no uniform
    is computed (counter-based: skipping one moves no later draw) and no float64 CDF is built;
    a torch.Generator still draws its uniform, so its later draws stay where they were.
    """
    if probs.dim() != 2:
        raise ValueError(f"probs must be [B, V], got shape {tuple(probs.shape)}")
    if greedy and isinstance(generator, RowStreams):
        return probs.argmax(-1)
    u = uniforms(generator, probs.shape[0], 1, domain, probs.device)[:, 0]
    return sample_from_weights(probs, u)
