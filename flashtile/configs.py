"""Kernel launch configurations, kept as data.

Every kernel launch takes its tile sizes, warps and pipeline depth from a
:class:`KernelConfig`; the tables below say which config serves which
(architecture, kernel, head dim). Nothing in the launch code hard-codes a tile size.
"""

import contextlib
from dataclasses import dataclass

import triton


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape and scheduling of one kernel launch.

    block_m: query rows per tile; block_n: key rows per tile.
    num_warps / num_stages: Triton's warps per program and software-pipelining depth.
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    def launch_kwargs(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def padded_head_dim(head_dim: int) -> int:
    """Head dims are processed in a power-of-two tile (tl.dot needs at least 16)."""
    return max(16, triton.next_power_of_2(head_dim))


# Kernel names used in the tables.
FWD = "fwd"          # forward: one program per (query block, head, batch)
BWD_DKDV = "bwd_dkdv"  # backward, dK/dV: one program per (key block, kv head, batch)
BWD_DQ = "bwd_dq"    # backward, dQ: one program per (query block, head, batch)

# The interpreter runs tiles as numpy arrays: small tiles keep multi-block paths
# exercised at the small sequence lengths CPU tests use.
_INTERPRETER = {
    FWD: KernelConfig(32, 32),
    BWD_DKDV: KernelConfig(32, 32),
    BWD_DQ: KernelConfig(32, 32),
}

# Portable GPU defaults, keyed by the padded head dim (upper bound). Chosen to fit
# registers and shared memory on sm80/sm90; tuned values per arch go in _TUNED.
_DEFAULT_GPU = {
    FWD: [
        (64, KernelConfig(128, 64, num_warps=4, num_stages=3)),
        (128, KernelConfig(128, 64, num_warps=8, num_stages=3)),
        (256, KernelConfig(64, 64, num_warps=8, num_stages=2)),
    ],
    BWD_DKDV: [
        (64, KernelConfig(64, 64, num_warps=4, num_stages=2)),
        (128, KernelConfig(64, 64, num_warps=8, num_stages=2)),
        (256, KernelConfig(32, 64, num_warps=8, num_stages=1)),
    ],
    BWD_DQ: [
        (64, KernelConfig(64, 64, num_warps=4, num_stages=2)),
        (128, KernelConfig(64, 64, num_warps=8, num_stages=2)),
        (256, KernelConfig(64, 32, num_warps=8, num_stages=1)),
    ],
}

# Measured per architecture: {arch: {kernel: [(max padded head dim, config), ...]}}.
# sm90 (H100/H200): bench/tune_configs.py on an H200, bf16, 16k tokens, hidden 2048,
# seqlen 4096; each the best geometric mean over causal and non-causal
# (bench/results/2026-11-21-h200-tune.md has the numbers).
_TUNED: dict = {
    "sm90": {
        FWD: [
            (64, KernelConfig(64, 64, num_warps=4, num_stages=3)),
            (128, KernelConfig(128, 64, num_warps=8, num_stages=3)),
            (256, KernelConfig(128, 64, num_warps=8, num_stages=2)),
        ],
        BWD_DKDV: [
            (64, KernelConfig(64, 64, num_warps=4, num_stages=2)),
            (128, KernelConfig(32, 64, num_warps=4, num_stages=3)),
            (256, KernelConfig(32, 32, num_warps=4, num_stages=2)),
        ],
        BWD_DQ: [
            (64, KernelConfig(128, 64, num_warps=8, num_stages=2)),
            (128, KernelConfig(64, 32, num_warps=4, num_stages=3)),
            (256, KernelConfig(128, 32, num_warps=8, num_stages=2)),
        ],
    },
}


# Set by :func:`override` (tuning scripts, experiments): {kernel: config}.
_OVERRIDES: dict = {}


@contextlib.contextmanager
def override(**configs: KernelConfig):
    """Within the block, launch the named kernels with the given configs, e.g.
    ``with override(bwd_dkdv=KernelConfig(32, 128, 8, 2)): ...``."""
    unknown = set(configs) - {FWD, BWD_DKDV, BWD_DQ}
    if unknown:
        raise ValueError(f"unknown kernel names {sorted(unknown)}; expected {FWD}, {BWD_DKDV} or {BWD_DQ}")
    previous = dict(_OVERRIDES)
    _OVERRIDES.update(configs)
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(previous)


def get_config(kernel: str, arch: str, head_dim: int) -> KernelConfig:
    """The config for ``kernel`` on ``arch`` ('sm90', 'interpreter', ...) at ``head_dim``."""
    if kernel in _OVERRIDES:
        return _OVERRIDES[kernel]
    if arch == "interpreter":
        return _INTERPRETER[kernel]
    padded = padded_head_dim(head_dim)
    for table in (_TUNED.get(arch, {}).get(kernel), _DEFAULT_GPU[kernel]):
        if not table:
            continue
        for max_dim, config in table:
            if padded <= max_dim:
                return config
    raise ValueError(f"no {kernel} config for head dim {head_dim} on {arch}")
