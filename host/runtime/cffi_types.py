"""The C types a session's creation uses, parsed by cffi in one pycparser run instead of one each.

cffi parses every new type string (`ffi.new("EpValueInfo[]", n)`) with pycparser, in pure Python, with
a typedef line for each of the ABI's typedefs in front: about 0.7 ms a string, once per process. Building
the graph view and partitioning use a dozen of them, 6-8 ms of a first session. `prime` parses them all
as the parameters of one declaration, as `ffi.typeof` parses one (cffi's `parse_type_and_quals`), and
stores each in the FFI's own cache of parsed types, where `ffi.new`/`ffi.typeof` find it.

That goes through cffi's internals (its parser and type cache); where they differ (another cffi), `prime`
does nothing and each type is parsed on first use as before (tests/host/test_cffi_types.py notices).
"""

from __future__ import annotations

# Every type string host/runtime/graphview.py and host/runtime/partition/ pass to the ABI's FFI.
CREATION_TYPES = (
    "EpGraphView", "EpGraphView*", "EpGraphView*[]", "EpValueInfo[]", "EpNodeView*", "EpNodeView[]",
    "EpAttribute[]", "EpTensor*", "EpKernel**", "EpNodeComputeInfo*[]", "char*[]", "double[]",
    "int32_t[]", "int64_t[]", "uint8_t[]", "void*", "void**",
)


def prime(ffi, cdecls=CREATION_TYPES) -> bool:
    """Parse the `cdecls` `ffi` has not parsed yet, in one pycparser run; False when cffi's internals
    are not the ones this expects (nothing is stored then)."""
    try:
        cache, parser, lock = ffi._parsed_types, ffi._parser, ffi._lock
        with lock:
            missing = [c for c in cdecls if c not in cache]
            if not missing:
                return True
            ast = parser._parse("void __dummy(\n" + ",\n".join(missing) + "\n);")[0]
            params = ast.ext[-1].type.args.params
            if len(params) != len(missing):
                return False
            parsed = {}
            for cdecl, param in zip(missing, params):
                tp = parser._get_type_and_quals(param.type)[0]
                raw_function = tp.is_raw_function
                if raw_function:  # as ffi.typeof: a function type stands for its pointer
                    tp = tp.as_function_pointer()
                parsed[cdecl] = (ffi._get_cached_btype(tp), raw_function)
            cache.update(parsed)
    except Exception:  # noqa: BLE001 - another cffi: each type is parsed on first use instead
        return False
    return True
