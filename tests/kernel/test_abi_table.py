"""The loaders' ctypes tables against the C headers they describe (CPU, no library needed).

ctypes trusts its ``argtypes``: a table entry that disagrees with the C prototype (an ``int`` where the
library takes ``int64_t``, an argument missing) passes garbage without an error. So every ``FVK_API``
prototype of ``csrc/ulysses_a2a/ulysses_a2a.h`` is parsed and compared, argument by argument and with its
return type, with ``fastvideo_kernel.SIGNATURES``, and those of ``testing/ulysses_a2a_testing.h`` with
``fastvideo_kernel.testing.TESTING_SIGNATURES``, both ways (every exported function has a signature, every
signature a prototype). The structs passed by pointer (``fvk_call``, ``fvk_vote``, ``fvk_sim_call``) are
compared field by field with their ctypes Structures, and the headers' constants with the loaders'. The
comparison's negative controls: a header with one argument's type changed, one function dropped, one struct
field changed, each reported.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from fastvideo.distributed.ulysses import transport
from tests.kernel.built import REPO, fastvideo_kernel, kernel_testing

CSRC = REPO / "csrc" / "ulysses_a2a"
PRODUCT_HEADER = CSRC / "ulysses_a2a.h"
TESTING_HEADER = CSRC / "testing" / "ulysses_a2a_testing.h"

SCALARS = {"int": ctypes.c_int, "unsigned": ctypes.c_uint, "size_t": ctypes.c_size_t, "int32_t": ctypes.c_int32,
           "uint32_t": ctypes.c_uint32, "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64}
STRUCTS = {"fvk_call": fastvideo_kernel.Call, "fvk_vote": fastvideo_kernel.Vote,
           "fvk_sim_call": kernel_testing.SimCall}
OPAQUE = {"void", "fvk_ctx"}  # passed as addresses only


def strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def prototypes(text: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (return type, parameter types) of every FVK_API prototype."""
    found = {}
    for ret, name, params in re.findall(r"FVK_API\s+([\w\s\*]+?)\s*\b(fvk_\w+)\s*\(([^)]*)\)\s*;",
                                        strip_comments(text)):
        params = " ".join(params.split())
        types = [] if params in ("", "void") else [re.sub(r"\s*\b\w+\s*$", "", p.strip()) for p in params.split(",")]
        found[name] = (" ".join(ret.split()), types)
    return found


def allowed(ctype: str) -> set:
    """The ctypes a C type may be declared as (a typed data pointer: POINTER(T) or c_void_p)."""
    base = next(w for w in ctype.replace("*", " * ").split() if w not in ("const", "*"))
    stars = ctype.count("*")
    if stars == 0 and base in STRUCTS:  # a struct held by value (fvk_sim_call's fvk_call)
        return {STRUCTS[base]}
    if stars == 0:
        return {SCALARS[base]}
    if stars == 1 and base == "char":
        return {ctypes.c_char_p}
    if stars == 1 and base in OPAQUE:
        return {ctypes.c_void_p}
    if stars == 1 and base in STRUCTS:
        return {ctypes.POINTER(STRUCTS[base])}
    if stars == 1 and base in SCALARS:
        return {ctypes.POINTER(SCALARS[base]), ctypes.c_void_p}
    if stars == 2 and base in OPAQUE:
        return {ctypes.POINTER(ctypes.c_void_p)}
    raise AssertionError(f"no ctypes rule for the C type {ctype!r}")


def table_problems(header: str, table: dict) -> list[str]:
    """Every disagreement between a header's prototypes and a ctypes table, both ways."""
    protos = prototypes(header)
    problems = [f"{name}: in the header, not in the table" for name in sorted(set(protos) - set(table))]
    problems += [f"{name}: in the table, not in the header" for name in sorted(set(table) - set(protos))]
    for name in sorted(set(protos) & set(table)):
        ret, params = protos[name]
        restype, argtypes = table[name]
        if restype not in allowed(ret):
            problems.append(f"{name}: returns {ret}, the table says {restype}")
        if len(params) != len(argtypes):
            problems.append(f"{name}: {len(params)} parameters, the table has {len(argtypes)}")
            continue
        for i, (param, argtype) in enumerate(zip(params, argtypes, strict=True)):
            if argtype not in allowed(param):
                problems.append(f"{name}: parameter {i} is {param}, the table says {argtype.__name__}")
    return problems


def struct_fields(header: str, name: str) -> list[tuple[str, str, int]]:
    """(field, C type, array length or 0) of ``typedef struct name {...} name;``, in order."""
    body = re.search(rf"typedef struct {name} \{{(.*?)\}} {name};", strip_comments(header), re.S).group(1)
    fields = []
    for decl in (d.strip() for d in body.split(";") if d.strip()):
        m = re.match(r"(?P<type>[^,]*?[\s*])(?P<names>\w+(\s*\[\d+\])?(\s*,\s*\w+(\s*\[\d+\])?)*)$",
                     " ".join(decl.split()))
        for declarator in m.group("names").split(","):
            dm = re.match(r"\s*(\w+)\s*(?:\[(\d+)\])?\s*$", declarator)
            fields.append((dm.group(1), m.group("type").strip(), int(dm.group(2) or 0)))
    return fields


def struct_problems(header: str, name: str, structure: type) -> list[str]:
    declared = [(f[0], f[1]) for f in structure._fields_]
    parsed = struct_fields(header, name)
    if [f[0] for f in declared] != [f[0] for f in parsed]:
        return [f"{name}: fields {[f[0] for f in parsed]} in the header, {[f[0] for f in declared]} in ctypes"]
    problems = []
    for (field, ctype, length), (_, declared_type) in zip(parsed, declared, strict=True):
        element = declared_type._type_ if length else declared_type
        # Pointers in a Structure are c_void_p: an address the caller stores (ctypes.addressof, data_ptr()).
        ok = element in allowed(ctype) | ({ctypes.c_void_p} if "*" in ctype else set())
        if not ok or (length and declared_type._length_ != length):
            problems.append(f"{name}.{field}: {ctype}{f'[{length}]' if length else ''} in the header, "
                            f"{declared_type} in ctypes")
    return problems


def macro(header: str, name: str) -> int:
    value = re.search(rf"#define {name}\s+\(?(-?\w+)\)?", header).group(1)
    return int(value.rstrip("u"), 0)


@pytest.mark.parametrize(("header", "table"), [(PRODUCT_HEADER, fastvideo_kernel.SIGNATURES),
                                               (TESTING_HEADER, kernel_testing.TESTING_SIGNATURES)],
                         ids=["product", "testing"])
def test_every_prototype_has_its_signature_and_back(header: Path, table: dict):
    text = header.read_text()
    assert len(prototypes(text)) == len(table) > 5
    assert table_problems(text, table) == []


def test_the_structs_match_their_ctypes_structures():
    product, testing = PRODUCT_HEADER.read_text(), TESTING_HEADER.read_text()
    assert struct_problems(product, "fvk_call", fastvideo_kernel.Call) == []
    assert struct_problems(product, "fvk_vote", fastvideo_kernel.Vote) == []
    assert struct_problems(testing, "fvk_sim_call", kernel_testing.SimCall) == []
    # The library's static_assert: fvk_call is 96 bytes since ABI 4 (ABI 5 gave its split tables meaning, no new
    # field); the size field versions it.
    assert ctypes.sizeof(fastvideo_kernel.Call) == 96


def test_negative_controls_the_comparison_reports_each_kind_of_drift():
    text = PRODUCT_HEADER.read_text()
    narrowed = text.replace("int mode, int dtype, int64_t B, int64_t S,", "int mode, int dtype, int B, int64_t S,", 1)
    assert narrowed != text
    assert table_problems(narrowed, fastvideo_kernel.SIGNATURES) == [
        "fvk_a2a_original: parameter 5 is int, the table says c_long"]
    dropped = text.replace("FVK_API int fvk_lsa_info(", "int fvk_lsa_info(", 1)
    assert table_problems(dropped, fastvideo_kernel.SIGNATURES) == ["fvk_lsa_info: in the table, not in the header"]
    extra = {**fastvideo_kernel.SIGNATURES}
    del extra["fvk_launch"]
    assert table_problems(text, extra) == ["fvk_launch: in the header, not in the table"]
    field = text.replace("  int32_t ctas;", "  int64_t ctas;", 1)
    assert struct_problems(field, "fvk_call", fastvideo_kernel.Call) == [
        "fvk_call.ctas: int64_t in the header, <class 'ctypes.c_int'> in ctypes"]


def test_the_headers_constants_are_the_loaders():
    product, testing = PRODUCT_HEADER.read_text(), TESTING_HEADER.read_text()
    k, t = fastvideo_kernel, kernel_testing
    assert macro(product, "FVK_ABI_VERSION") == k.ABI_VERSION
    assert macro(testing, "FVK_TESTING_ABI_VERSION") == t.TESTING_ABI_VERSION
    pairs = {"FVK_KIND_SM": k.KIND_SM, "FVK_KIND_CE": k.KIND_CE, "FVK_CALL_CAPTURE": k.CALL_CAPTURE,
             "FVK_CALL_DEBUG": k.CALL_DEBUG, "FVK_CALL_DEBUG_MOVING_LAYOUT": k.CALL_DEBUG_MOVING_LAYOUT,
             "FVK_STAGE_REFUSED": k.STAGE_REFUSED, "FVK_STAGE_EXCHANGE_FAILED": k.STAGE_EXCHANGE_FAILED,
             "FVK_STAGE_NOT_LAUNCHED": k.STAGE_NOT_LAUNCHED, "FVK_STAGE_LAUNCHED": k.STAGE_LAUNCHED}
    assert {name: macro(product, name) for name in pairs} == pairs
    pairs = {"FVK_SIM_SKEW": t.SIM_SKEW, "FVK_SIM_EPOCH_CHECK": t.SIM_EPOCH_CHECK,
             "FVK_SIM_MOVING_LAYOUT": t.SIM_MOVING_LAYOUT, "FVK_SYNC_NO_FIRST_ENTRY": t.SYNC_NO_FIRST_ENTRY,
             "FVK_SYNC_KERNEL": t.SYNC_KERNEL, "FVK_SYNC_NO_ENTRY": t.SYNC_NO_ENTRY,
             "FVK_SYNC_NO_MIDDLE": t.SYNC_NO_MIDDLE, "FVK_CE_CHECK_SWAP_BUFFERS": t.CE_CHECK_SWAP_BUFFERS,
             "FVK_LAYOUT_STATIC": t.LAYOUT_STATIC, "FVK_LAYOUT_MOVING": t.LAYOUT_MOVING,
             "FVK_LAYOUT_EVEN_ONLY": t.LAYOUT_EVEN_ONLY,
             "FVK_FABRIC_COPY_ENGINE": t.FABRIC_COPY_ENGINE, "FVK_FABRIC_SM": t.FABRIC_SM}
    assert {name: macro(testing, name) for name in pairs} == pairs
    plan = (CSRC / "ce_plan.h").read_text()
    drops = {"kCeDropWaitCopied": t.CE_DROP_WAIT_COPIED, "kCeDropEntryBarrier": t.CE_DROP_ENTRY_BARRIER,
             "kCeDropLandedBarrier": t.CE_DROP_LANDED_BARRIER, "kCeDropFork": t.CE_DROP_FORK,
             "kCeDropJoin": t.CE_DROP_JOIN, "kCeModelStreamPerCall": t.CE_MODEL_STREAM_PER_CALL,
             "kCeDropDoneWait": t.CE_DROP_DONE_WAIT, "kCeDropSmEntryBarrier": t.CE_DROP_SM_ENTRY_BARRIER}
    assert {n: int(re.search(rf"\b{n} = (-?\d+)", plan).group(1)) for n in drops} == drops


def test_the_offerings_table_covers_the_transport_entries_and_the_table_every_needed_symbol():
    """The transport's entry names are offerings of the newest ABI; every offering of every ABI names the
    functions it needs, and those of the newest ABI are all in the product's signature table."""
    newest = fastvideo_kernel.OFFERINGS[fastvideo_kernel.ABI_VERSION]
    assert transport.ENTRIES <= newest
    assert set(fastvideo_kernel.OFFERINGS) == set(range(fastvideo_kernel.OLDEST_ABI, fastvideo_kernel.ABI_VERSION + 1))
    assert all(set(offered) <= set(fastvideo_kernel.NEEDS) for offered in fastvideo_kernel.OFFERINGS.values())
    needed = set(fastvideo_kernel.LIFECYCLE).union(*(fastvideo_kernel.NEEDS[o] for o in newest))
    assert needed == set(fastvideo_kernel.SIGNATURES)  # and nothing the product exports goes unused
