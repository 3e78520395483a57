"""python-mip models that cannot deadlock the process when the garbage collector frees them.

A ``mip.Model`` and its solver refer to each other, so the cyclic collector frees them, at whatever
allocation happens to trigger a collection. The solver's ``__del__`` frees its C model through a
cffi library whose functions are looked up lazily, the first time each is used, under cffi's
non-reentrant ``ffi._lock``. If that first lookup happens inside a collection that started while the
same thread holds the lock (``ffi.new`` parsing a C type, as python-mip's ``set_start`` does), the
thread waits on itself forever: seen as ``daskpipe demo`` hanging in ``make_plan`` (python-mip 2.0,
cffi 2.1; py-spy: ``SolverCbc.__del__`` -> ``make_accessor`` inside ``FFI._typeof_locked``). Looking
the finalizers' functions up once, before any model exists, takes them off that path.
"""

from __future__ import annotations

import sys
from typing import Any

FINALIZERS = {
    "mip.cbc": ("cbclib", ("Cbc_deleteModel", "Osi_deleteSolver")),
    "mip.highs": ("highslib", ("Highs_destroy",)),
}
"""Per python-mip solver module: its cffi library and the C functions its ``__del__`` calls."""

_resolved: set[str] = set()


def resolve_finalizers(solver_module: Any) -> None:
    """Look up the C functions ``solver_module``'s finalizers call, once per module."""
    name = solver_module.__name__
    if name in _resolved or name not in FINALIZERS:
        return
    library_name, functions = FINALIZERS[name]
    library = getattr(solver_module, library_name, None)
    for function in functions:
        try:
            getattr(library, function)
        except AttributeError:  # a library build without it: its __del__ cannot call it either
            pass
    _resolved.add(name)


def mip_model(*, sense: str, solver_name: str) -> Any:
    """``mip.Model(sense=sense, solver_name=solver_name)``, its solver's finalizers looked up first."""
    import mip

    model = mip.Model(sense=sense, solver_name=solver_name)
    resolve_finalizers(sys.modules[type(model.solver).__module__])
    return model
