"""torch's Python meta kernels without importing ``torch._dynamo`` (most of a second or two per
process).

On ``meta`` many aten ops (elementwise ones, ``embedding``, ``normal_``) run torch's Python
references, each wrapped by ``torch._compile._disable_dynamo``: on its first call that wrapper
imports ``torch._dynamo`` (1.8 s on a 2-core box, a quarter of ``protrain fit``) only to build
``torch._dynamo.disable(fn)``, a wrapper that matters while dynamo traces, which needs
``torch._dynamo`` imported. ``defer_dynamo`` hands every such wrapper that exists a stand-in
for that cached ``disable(fn)``: while ``torch._dynamo`` is not imported it calls ``fn``, as
``disable(fn)`` would with nothing tracing; once anything has imported it, the stand-in removes
itself and torch's own path runs from then on. So the ops compute what they computed, the same
in every process (tests/test_lazy_dynamo.py), and nothing changes for a process that compiles.

A torch whose wrapper looks different (no ``inner`` closure over ``fn`` and ``recursive``) is
left as it is: the stand-in is an optimisation only.
"""

from __future__ import annotations

import gc
import sys
import types

_ATTR = "__dynamo_disable"  # torch/_compile.py: the cached torch._dynamo.disable(fn)
_done = False


def _stand_in(inner, fn):
    def call(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)  # disable(fn) with nothing tracing: fn itself
        if getattr(fn, _ATTR, None) is call:
            delattr(fn, _ATTR)  # torch's own path from here on: it caches the real disable(fn)
        return inner(*args, **kwargs)

    return call


def _inner_code() -> types.CodeType | None:
    from torch import _compile

    outer = getattr(_compile, "_disable_dynamo", None)
    for c in getattr(getattr(outer, "__code__", None), "co_consts", ()):
        if (
            isinstance(c, types.CodeType)
            and c.co_name == "inner"
            and {"fn", "recursive"} <= set(c.co_freevars)
        ):
            return c
    return None


def defer_dynamo() -> int:
    """Give every ``_disable_dynamo`` wrapper torch has made so far the stand-in (module
    docstring); once per process, and not once ``torch._dynamo`` is imported. Returns how many
    wrappers it gave one (0 on a second call)."""
    global _done
    if _done or "torch._dynamo" in sys.modules:
        return 0
    _done = True
    code = _inner_code()
    if code is None:
        return 0
    at = code.co_freevars.index("fn")
    n = 0
    for f in gc.get_objects():
        if type(f) is types.FunctionType and f.__code__ is code:
            fn = f.__closure__[at].cell_contents
            if getattr(fn, _ATTR, None) is None:
                setattr(fn, _ATTR, _stand_in(f, fn))
                n += 1
    return n
