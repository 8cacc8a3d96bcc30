"""flashtile under flash_attn's module names, so that code written for flash-attn 2.x runs unchanged.

    handle = flashtile.install_as_flash_attn()
    from flash_attn import flash_attn_func                  # flashtile's
    from flash_attn.bert_padding import pad_input, unpad_input
    handle.uninstall()                                      # or: with flashtile.install_as_flash_attn(): ...

Registered (in sys.modules, and as attributes of their parents):

    flash_attn                        the public functions, __version__ = "2.8.3+flashtile<version>"
    flash_attn.flash_attn_interface   the public functions and the private _flash_attn_forward,
                                      _flash_attn_backward, _flash_attn_varlen_forward,
                                      _flash_attn_varlen_backward (flash_attn_private.py)
    flash_attn.bert_padding           pad_input, unpad_input, index_first_axis, index_put_first_axis
    flash_attn.layers.rotary          apply_rotary_emb (flash_attn's signature), RotaryEmbedding
    flash_attn.modules.mha            MHA, FlashSelfAttention, FlashCrossAttention, get_alibi_slopes

While installed, flash_attn's distribution metadata answers too: importlib.metadata.version("flash_attn")
(or "flash-attn"; transformers and others ask it) gives the same VERSION, from a finder at the front of
sys.meta_path that uninstall removes. Where a real flash-attn distribution is installed, its metadata is
left as it is unless force=True.

Opt-in: importing flashtile registers nothing. A real flash-attn (one importlib can find) is never
shadowed unless force=True. Other flash_attn submodules (ops, utils, ...) are not provided: importing
them raises ModuleNotFoundError. The module objects are built on install, so importing flashtile
does not import flashtile.modules.
"""

import importlib.machinery
import importlib.metadata
import importlib.util
import pathlib
import re
import sys
import types
from typing import Dict, Iterator, Optional

from .._version import __version__ as _flashtile_version

FLASH_ATTN_VERSION = "2.8.3"  # the flash_attn release whose API (private signatures included) this mirrors
VERSION = f"{FLASH_ATTN_VERSION}+flashtile{_flashtile_version}"  # a PEP 440 local version: compares as 2.8.3

_MARK = "__flashtile_alias__"  # set on every module object built here


class FlashAttnAlias:
    """What :func:`install_as_flash_attn` registered. ``uninstall()`` (or the end of a ``with``
    block) removes exactly those entries of sys.modules and puts back any it replaced (force=True)."""

    def __init__(self, modules: Dict[str, types.ModuleType], replaced: Dict[str, types.ModuleType],
                 metadata_finder: Optional["_MetadataFinder"] = None):
        self.modules = modules
        self._replaced = replaced
        self._metadata_finder = metadata_finder  # in sys.meta_path while installed, or None
        self.installed = True

    def uninstall(self) -> bool:
        """Take the alias out of sys.modules; False if it was already out."""
        global _active
        if not self.installed:
            return False
        for name, module in self.modules.items():
            if sys.modules.get(name) is module:  # never remove what someone put there since
                del sys.modules[name]
        for name, module in self._replaced.items():
            sys.modules.setdefault(name, module)
        if self._metadata_finder is not None:
            sys.meta_path[:] = [finder for finder in sys.meta_path if finder is not self._metadata_finder]
        self.installed = False
        if _active is self:
            _active = None
        return True

    def __enter__(self) -> "FlashAttnAlias":
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def __repr__(self) -> str:
        return f"<FlashAttnAlias flash_attn {VERSION}, {'installed' if self.installed else 'uninstalled'}>"


_active: Optional[FlashAttnAlias] = None

_DIST_NAME = "flash_attn"  # as flash-attn's wheels spell it in their METADATA


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503: flash_attn, flash-attn, Flash.Attn are one name


class _AliasDistribution(importlib.metadata.Distribution):
    """flash_attn's distribution metadata while the alias is installed: Name flash_attn, Version VERSION.
    It lists no files (no RECORD): the modules live in memory."""

    def read_text(self, filename) -> Optional[str]:
        if filename in ("METADATA", "PKG-INFO"):
            return (f"Metadata-Version: 2.1\nName: {_DIST_NAME}\nVersion: {VERSION}\n"
                    f"Summary: flashtile {_flashtile_version} registered under the flash_attn module names by "
                    "flashtile.install_as_flash_attn()\n")
        if filename == "top_level.txt":
            return "flash_attn\n"  # importlib.metadata.packages_distributions() maps flash_attn to this
        return None

    def locate_file(self, path) -> pathlib.Path:
        return pathlib.Path(__file__).resolve().parents[2] / path  # beside the flashtile package


class _MetadataFinder(importlib.metadata.DistributionFinder):
    """Answers importlib.metadata's questions about flash_attn (finds no modules: the alias's are in
    sys.modules already). A search of given paths (``distributions(path=[...])``) does not see it."""

    def find_spec(self, fullname, path=None, target=None):
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()) -> Iterator:
        if "path" in vars(context):
            return
        name = getattr(context, "name", None)
        if name is None or _canonical(name) == _canonical(_DIST_NAME):
            yield _AliasDistribution()


def _real_flash_attn_distribution() -> Optional[str]:
    """Name and version of an installed flash-attn distribution that is not this alias, or None."""
    try:
        for dist in importlib.metadata.distributions(name=_DIST_NAME):
            if not isinstance(dist, _AliasDistribution):
                return f"{dist.metadata['Name']} {dist.version}"
    except Exception:  # an unreadable metadata directory: nothing to defer to
        return None
    return None


def _real_flash_attn() -> Optional[str]:
    """Where a flash_attn that is not this alias lives, or None if there is none."""
    loaded = sys.modules.get("flash_attn")
    if loaded is not None:
        return None if getattr(loaded, _MARK, False) else (getattr(loaded, "__file__", None) or repr(loaded))
    try:
        spec = importlib.util.find_spec("flash_attn")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    return spec.origin or ", ".join(spec.submodule_search_locations or ()) or "flash_attn"


def install_as_flash_attn(force: bool = False) -> FlashAttnAlias:
    """Register flashtile as ``flash_attn`` (and the submodules listed in this module's docstring)
    in sys.modules, for this process. Returns a handle (also a context manager) whose
    ``uninstall()`` removes them; :func:`uninstall_as_flash_attn` does the same. Installing twice
    returns the same handle.

    Raises RuntimeError if a real flash-attn is installed (importlib finds it) or already imported,
    unless ``force=True``: then flashtile replaces it in sys.modules until uninstalled (code that
    already holds references to the real modules keeps them). ``importlib.metadata.version("flash_attn")``
    gives :data:`VERSION` while installed, except where a real flash-attn distribution is installed
    and force is False (its metadata then stays visible).
    """
    global _active
    from ..checks import check_flag

    force = check_flag(force, "force")
    if _active is not None and _active.installed and sys.modules.get("flash_attn") is _active.modules["flash_attn"]:
        return _active
    real = _real_flash_attn()
    if real is not None and not force:
        raise RuntimeError(f"flash-attn is installed ({real}): flashtile does not shadow it. To run flashtile under "
                           "the flash_attn names anyway, call install_as_flash_attn(force=True) (this process only; "
                           "uninstall_as_flash_attn() puts flash-attn back)")
    if _active is not None:
        _active.uninstall()  # a stale handle (its flash_attn was replaced since): start afresh
    modules = _build_modules()
    replaced = {name: sys.modules[name] for name in modules if name in sys.modules}
    # Metadata too, unless that would hide a real flash-attn's that force did not ask to replace.
    finder = _MetadataFinder() if force or _real_flash_attn_distribution() is None else None
    sys.modules.update(modules)
    if finder is not None:
        sys.meta_path.insert(0, finder)
    _active = FlashAttnAlias(modules, replaced, finder)
    return _active


def uninstall_as_flash_attn() -> bool:
    """Remove what :func:`install_as_flash_attn` registered; False if nothing was installed."""
    return _active.uninstall() if _active is not None else False


def index_put_first_axis(values, indices, first_axis_dim: int):
    """flash_attn.bert_padding.index_put_first_axis: zeros (first_axis_dim, ...) with rows ``indices``
    set to ``values``; differentiable (flashtile's pad_input with one position per row)."""
    from ..padding import pad_input

    return pad_input(values, indices, first_axis_dim, 1).squeeze(1)


def _module(name: str, doc: str, attrs: dict, package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    # A spec, so importlib.util.find_spec("flash_attn") answers while installed; an empty __path__
    # makes a package of it that no finder can add submodules to.
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, origin="flashtile", is_package=package)
    module.__package__ = name if package else name.rpartition(".")[0]
    if package:
        module.__path__ = []
    setattr(module, _MARK, True)
    for key, value in attrs.items():
        setattr(module, key, value)
    module.__all__ = [key for key in attrs if not key.startswith("_") and not isinstance(attrs[key], types.ModuleType)]
    return module


def _build_modules() -> Dict[str, types.ModuleType]:
    from .. import interface, kvcache, padding, varlen
    from ..modules import mha as mha_module, rotary as rotary_module
    from . import flash_attn_private as private

    public = dict(
        flash_attn_func=interface.flash_attn_func,
        flash_attn_kvpacked_func=interface.flash_attn_kvpacked_func,
        flash_attn_qkvpacked_func=interface.flash_attn_qkvpacked_func,
        flash_attn_varlen_func=varlen.flash_attn_varlen_func,
        flash_attn_varlen_kvpacked_func=varlen.flash_attn_varlen_kvpacked_func,
        flash_attn_varlen_qkvpacked_func=varlen.flash_attn_varlen_qkvpacked_func,
        flash_attn_with_kvcache=kvcache.flash_attn_with_kvcache,
    )
    note = "(flashtile, registered by flashtile.install_as_flash_attn)"
    interface_module = _module("flash_attn.flash_attn_interface", f"flash_attn's interface {note}", dict(
        public,
        _flash_attn_forward=private._flash_attn_forward,
        _flash_attn_backward=private._flash_attn_backward,
        _flash_attn_varlen_forward=private._flash_attn_varlen_forward,
        _flash_attn_varlen_backward=private._flash_attn_varlen_backward,
    ))
    bert_padding = _module("flash_attn.bert_padding", f"flash_attn's padding utilities {note}", dict(
        pad_input=padding.pad_input, unpad_input=padding.unpad_input, index_first_axis=padding.index_first_axis,
        index_put_first_axis=index_put_first_axis,
    ))
    rotary = _module("flash_attn.layers.rotary", f"flash_attn's rotary embedding {note}", dict(
        apply_rotary_emb=rotary_module.apply_rotary_emb_func, apply_rotary_emb_func=rotary_module.apply_rotary_emb_func,
        RotaryEmbedding=rotary_module.RotaryEmbedding,
    ))
    mha = _module("flash_attn.modules.mha", f"flash_attn's attention modules {note}", dict(
        MHA=mha_module.MHA, FlashSelfAttention=mha_module.FlashSelfAttention,
        FlashCrossAttention=mha_module.FlashCrossAttention, get_alibi_slopes=mha_module.get_alibi_slopes,
    ))
    layers = _module("flash_attn.layers", f"flash_attn.layers {note}", dict(rotary=rotary), package=True)
    modules_pkg = _module("flash_attn.modules", f"flash_attn.modules {note}", dict(mha=mha), package=True)
    root = _module("flash_attn", f"flash_attn {VERSION} {note}", dict(
        public, __version__=VERSION, flash_attn_interface=interface_module, bert_padding=bert_padding,
        layers=layers, modules=modules_pkg,
    ), package=True)
    return {module.__name__: module for module in (root, interface_module, bert_padding, layers, rotary,
                                                   modules_pkg, mha)}
