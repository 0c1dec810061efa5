"""Orthogonal matrices for rotating a residual stream (NumPy only): Hadamard, randomised, random.

A Hadamard matrix H of order n has entries ±1 and H·Hᵀ = n·I, so H/√n is orthogonal. Orders built here:

* **Sylvester:** H₁ = [1], H₂ₙ = [[Hₙ, Hₙ], [Hₙ, −Hₙ]]: every power of two.
* **Paley I:** for a prime q ≡ 3 (mod 4), order q + 1: H = I + S, S = [[0, 1ᵀ], [−1, J]] with
  J the Jacobsthal matrix J[i, j] = χ(j − i), χ the quadratic character of GF(q) (12, 20, 24, 32, 44, 48 …).
* **Paley II:** for a prime q ≡ 1 (mod 4), order 2(q + 1): with the symmetric conference matrix
  C = [[0, 1ᵀ], [1, J]], H = C ⊗ [[1, −1], [−1, −1]] + I ⊗ [[1, 1], [1, −1]] (28, 36, 60, 76 …).
* **Kronecker products:** H_a ⊗ H_b is a Hadamard matrix of order a·b, so every m·2ᵏ with m a Paley
  order: 384 = 12·32, 768 = 12·64, 1280 = 20·64, 896 = 28·32, and every power of two (1024, 4096 …).

The rotation QuaRot uses is a *randomised* Hadamard matrix, H·diag(s)/√n with seeded random signs s:
it spreads any one channel evenly over all of them (|Q[i, j]| = 1/√n) whatever the signs, and the signs
keep it from aligning with structure in the weights. Where no Hadamard order is known, a random
orthogonal matrix (Haar-distributed: the Q of a Gaussian matrix's QR decomposition, its signs fixed by
R's diagonal) is used instead.
"""

from __future__ import annotations

import math

import numpy as np

KINDS = ("hadamard", "orthogonal")


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % p for p in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> np.ndarray:
    """J[i, j] = χ(j − i) over GF(q), q an odd prime: 0 on the diagonal, ±1 elsewhere."""
    squares = {(x * x) % q for x in range(1, q)}
    character = np.array([0] + [1 if r in squares else -1 for r in range(1, q)], dtype=np.int64)
    index = np.arange(q)
    return character[(index[None, :] - index[:, None]) % q]


def _paley(order: int) -> np.ndarray | None:
    """A Hadamard matrix of `order` by Paley's constructions I or II, or None where neither applies."""
    q = order - 1
    if _is_prime(q) and q % 4 == 3:
        core = np.zeros((order, order), dtype=np.int64)
        core[0, 1:], core[1:, 0], core[1:, 1:] = 1, -1, _jacobsthal(q)
        return np.eye(order, dtype=np.int64) + core
    q = order // 2 - 1
    if order % 2 == 0 and _is_prime(q) and q % 4 == 1:
        conference = np.zeros((q + 1, q + 1), dtype=np.int64)
        conference[0, 1:], conference[1:, 0], conference[1:, 1:] = 1, 1, _jacobsthal(q)
        return np.kron(conference, [[1, -1], [-1, -1]]) + np.kron(np.eye(q + 1, dtype=np.int64), [[1, 1], [1, -1]])
    return None


def _sylvester(order: int) -> np.ndarray:
    matrix = np.ones((1, 1), dtype=np.int64)
    while matrix.shape[0] < order:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    return matrix


def hadamard(order: int) -> np.ndarray | None:
    """A Hadamard matrix (entries ±1, H·Hᵀ = order·I) of `order`, or None where none is built here."""
    if order < 1:
        return None
    power = order & -order  # the largest power of two dividing the order
    while power >= 1:
        rest = order // power
        base = np.ones((1, 1), dtype=np.int64) if rest == 1 else _paley(rest)
        if base is not None:
            return np.kron(base, _sylvester(power))
        power //= 2
    return None


def random_orthogonal(order: int, seed: int) -> np.ndarray:
    """A Haar-random orthogonal matrix of `order` (float64), the same for the same seed."""
    gaussian = np.random.default_rng(seed).standard_normal((order, order))
    q, r = np.linalg.qr(gaussian)
    return q * np.sign(np.diag(r))


def rotation_matrix(order: int, kind: str = "hadamard", seed: int = 0) -> tuple[np.ndarray, str]:
    """An orthogonal matrix Q of `order` (float64) and a description of what it is.

    `kind` "hadamard": a randomised Hadamard matrix H·diag(s)/√n where a Hadamard matrix of the order is
    known, else a random orthogonal one (the description says which); "orthogonal": a random orthogonal one.
    """
    if kind not in KINDS:
        raise ValueError(f"rotation kind {kind!r}: choose one of {', '.join(KINDS)}")
    matrix = hadamard(order) if kind == "hadamard" else None
    if matrix is None:
        why = "" if kind == "orthogonal" else f" (no Hadamard matrix of order {order} is known here)"
        return random_orthogonal(order, seed), f"random orthogonal {order}×{order}{why}"
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=order)
    return matrix * signs / math.sqrt(order), f"randomised Hadamard {order}×{order}"
