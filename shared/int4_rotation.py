"""The `int4` store's rotation (`shared.int4`): per group of a vector's values, fixed random
signs, then the normalised Walsh-Hadamard matrix, which spreads a group's outliers over it. Both
are defined here bit for bit, so that every version decodes every cache alike.
"""

from __future__ import annotations

import functools

import numpy as np
import torch


def rotation_signs_H(hidden: int, seed: int) -> torch.Tensor:
    """float32 [hidden] of +-1: bit 63 of splitmix64 of (seed, i). Defined here, not by a
    library's random generator, so that every version decodes every cache alike.

    >>> rotation_signs_H(8, 0).tolist()
    [-1.0, 1.0, 1.0, -1.0, 1.0, 1.0, 1.0, -1.0]
    """
    z = np.arange(1, hidden + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z += np.uint64((seed * 0xD1B54A32D192ED03) & (1 << 64) - 1)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return torch.from_numpy(1.0 - 2.0 * (z >> np.uint64(63)).astype(np.float32))


def hadamard_GG(group: int) -> torch.Tensor:
    """The normalised Walsh-Hadamard matrix (Sylvester's), float32 [group, group]: symmetric and
    orthogonal, so its own inverse.

    >>> (hadamard_GG(4) * 2).tolist()[1]
    [1.0, -1.0, 1.0, -1.0]
    """
    m = torch.ones(1, 1)
    while m.shape[0] < group:
        m = torch.cat([torch.cat([m, m], 1), torch.cat([m, -m], 1)])
    return m / group**0.5


def rotate_NH(x_NH: torch.Tensor, signs_H: torch.Tensor, hadamard: torch.Tensor) -> torch.Tensor:
    """Each group of x's last dim (the matrix's size) times its signs, then the matrix.

    >>> x = torch.tensor([[3.0, 1.0, 0.0, 2.0]])
    >>> y = rotate_NH(x, rotation_signs_H(4, 0), hadamard_GG(2))
    >>> torch.allclose(unrotate_NH(y, rotation_signs_H(4, 0), hadamard_GG(2)), x, atol=1e-6)
    True
    """
    g = hadamard.shape[0]
    return ((x_NH * signs_H).unflatten(-1, (-1, g)) @ hadamard).flatten(-2)


def unrotate_NH(y_NH: torch.Tensor, signs_H: torch.Tensor, hadamard: torch.Tensor) -> torch.Tensor:
    """Inverse of `rotate_NH`."""
    g = hadamard.shape[0]
    return (y_NH.unflatten(-1, (-1, g)) @ hadamard).flatten(-2) * signs_H


@functools.cache
def rotation_tables(
    hidden: int, seed: int, group: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation's signs and matrix on `device`, made once: a copy from pageable host memory
    waits for the stream's earlier work (on a GPU, the forward whose states are encoded), which
    left the device idle for the rest of each encode's launches."""
    return rotation_signs_H(hidden, seed).to(device), hadamard_GG(group).to(device)
