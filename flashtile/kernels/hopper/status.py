"""Whether this Triton can run the Hopper kernels: Gluon must import, the version must be one
flashtile supports, and the kernels' modules must build (a Gluon name a future Triton drops shows
here, and the dispatcher keeps to the portable kernels and warns once)."""

import functools

import triton

from ...triton_compat import SUPPORTED, gluon_import_error, version_supported


@functools.lru_cache(maxsize=None)
def gluon_status() -> tuple:
    """(available, reason): whether this Triton can build the Hopper Gluon kernels, and if not,
    why (the kernels then stay on the portable path; dispatch warns once)."""
    error = gluon_import_error()
    if error is not None:
        return False, f"Gluon does not import on Triton {triton.__version__} ({error})"
    if not version_supported():
        return False, (f"Triton {triton.__version__} is outside the range flashtile's Hopper kernels support "
                       f"({SUPPORTED[0][0]}.{SUPPORTED[0][1]} to {SUPPORTED[1][0]}.{SUPPORTED[1][1]})")
    try:
        from . import backward, forward  # noqa: F401
    except Exception as exc:  # a Gluon name this module does not know yet
        return False, f"the Gluon kernels do not build on Triton {triton.__version__} ({type(exc).__name__}: {exc})"
    return True, f"Triton {triton.__version__} runs the Gluon kernels"
