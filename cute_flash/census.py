"""What a compiled kernel is made of, read without a GPU: instruction census of the PTX, registers and stack frame
from the cubin's `.nv.info` attributes, and spill bytes from ptxas' own report.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import struct
import sys
import tempfile
from typing import Dict, Iterator, List, Optional, Tuple

# Each counted pattern is an instruction prefix; the census counts lines that start with it (after predicates).
CENSUS_PATTERNS: Dict[str, str] = {
    "mma.sync": r"mma\.sync\.",
    "ldmatrix": r"ldmatrix\.",
    "cp.async": r"cp\.async\.(?:ca|cg)\.",
    "cp.async.bulk.tensor": r"cp\.async\.bulk\.tensor\.",
    "wgmma.mma_async": r"wgmma\.mma_async\.",
    "wgmma.mma_async.rs": r"wgmma\.mma_async\.[^\s]+\s+\{[^}]*\},\s*\{",  # A operand is a register list: the RS form
    "wgmma.mma_async.e4m3": r"wgmma\.mma_async\.[^\s]*e4m3",
    "setmaxnreg": r"setmaxnreg\.",
    "cp.reduce.async.bulk": r"cp\.reduce\.async\.bulk\.",  # bulk reduce-add (the sm90 backward's dQ)
    "griddepcontrol.wait": r"griddepcontrol\.wait",  # programmatic dependent launch
    "griddepcontrol.launch_dependents": r"griddepcontrol\.launch_dependents",
    "mbarrier.expect_tx": r"mbarrier\.expect_tx",  # extra bytes on a stage's barrier (K / V with the first Q / dO)
    "red.global.add.v4.f32": r"red\.global\.add\.v4\.f32",  # vector reductions (sm80 dQ on sm_90a, sm90 dq_red)
    "stmatrix.trans": r"stmatrix\.sync\.aligned\.[^\s]*\.trans",  # transposing stores (the sm90 dQᵀ conversion)
    "shfl.sync": r"shfl\.sync\.",  # warp shuffles (the sm90 backward's LSE / D without BwdTileConfig.stats_at_use)
    "tcgen05.mma": r"tcgen05\.mma\.",
    "tcgen05.mma.cta_group::2": r"tcgen05\.mma\.cta_group::2",
    "tcgen05.alloc.cta_group::2": r"tcgen05\.alloc\.cta_group::2",
    "tcgen05.mma.kind::f8f6f4": r"tcgen05\.mma\.[^\s]*kind::f8f6f4",
}

_INSTR = re.compile(r"^\s*(?:@!?%\w+\s+)?(.*)$")
_COMPILED = {k: re.compile(v) for k, v in CENSUS_PATTERNS.items()}


def ptx_census(ptx: str) -> Dict[str, int]:
    counts = {k: 0 for k in CENSUS_PATTERNS}
    for line in ptx.splitlines():
        body = _INSTR.match(line).group(1)
        if not body or body.startswith("//"):
            continue
        for key, pat in _COMPILED.items():
            if pat.match(body):
                counts[key] += 1
    return counts


def ptx_threads(ptx: str) -> int:
    """Threads per CTA from `.reqntid`/`.maxntid` of the entry (0 when the PTX does not say)."""
    m = re.search(r"\.(?:reqntid|maxntid)\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", ptx)
    if not m:
        return 0
    n = 1
    for g in m.groups():
        if g:
            n *= int(g)
    return n


# --- cubin (ELF) ----------------------------------------------------------------------------------------------
_EIATTR_REGCOUNT = 0x2F
_EIATTR_FRAME_SIZE = 0x11


def _sections(elf: bytes):
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_off = raw[shstrndx][4]

    def name(off: int) -> str:
        end = elf.index(b"\0", names_off + off)
        return elf[names_off + off : end].decode()

    return [(name(r[0]), r[1], r[4], r[5], r[6], r[7]) for r in raw]  # name, type, offset, size, link, info


def _symbols(elf: bytes, sections) -> List[str]:
    for _, typ, off, size, link, _ in sections:
        if typ == 2:  # SHT_SYMTAB
            str_off = sections[link][2]
            names = []
            for i in range(size // 24):
                st_name = struct.unpack_from("<I", elf, off + i * 24)[0]
                end = elf.index(b"\0", str_off + st_name)
                names.append(elf[str_off + st_name : end].decode())
            return names
    return []


def _nv_info(data: bytes) -> Iterator[tuple]:
    i = 0
    while i + 2 <= len(data):
        fmt, attr = data[i], data[i + 1]
        i += 2
        if fmt == 4:  # EIFMT_SVAL: u16 size, payload
            size = struct.unpack_from("<H", data, i)[0]
            yield attr, data[i + 2 : i + 2 + size]
            i += 2 + size
        elif fmt == 3:  # EIFMT_HVAL
            yield attr, data[i : i + 2]
            i += 2
        elif fmt == 2:  # EIFMT_BVAL
            i += 1
        else:  # EIFMT_NVAL
            pass


def cubin_resources(cubin: bytes) -> Dict[str, Dict[str, int]]:
    """Per kernel: registers, stack frame bytes and static shared bytes, read from the cubin."""
    sections = _sections(cubin)
    symbols = _symbols(cubin, sections)
    res: Dict[str, Dict[str, int]] = {}
    for name, _, off, size, _, _ in sections:
        if name == ".nv.info":
            for attr, payload in _nv_info(cubin[off : off + size]):
                if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and len(payload) == 8:
                    sym, value = struct.unpack("<II", payload)
                    entry = res.setdefault(symbols[sym] if sym < len(symbols) else str(sym), {})
                    entry["registers" if attr == _EIATTR_REGCOUNT else "stack_frame_bytes"] = value
    for name, _, off, size, _, _ in sections:
        if name.startswith(".nv.shared.") and name[len(".nv.shared.") :] in res:
            res[name[len(".nv.shared.") :]]["static_shared_bytes"] = size
    return {k: v for k, v in res.items() if "registers" in v}


# --- ptxas report ---------------------------------------------------------------------------------------------
# CuTe DSL wraps long remark lines, so a kernel name may start on the line after its label: match across whitespace.
_PTXAS_EVENT = re.compile(
    r"Compiling entry function\s+'(?P<entry>[^']+)'"
    r"|Function properties for\s+(?P<props>[^\s']+)"
    r"|(?P<frame>\d+) bytes stack frame,\s+(?P<stores>\d+) bytes spill stores,\s+(?P<loads>\d+) bytes spill loads"
    r"|Used\s+(?P<regs>\d+) registers"
)


def parse_ptxas_reports(text: str) -> List[Tuple[str, Dict[str, int]]]:
    """Every entry ptxas compiled, in order, with its registers and spill bytes (ptxas -v output, which CuTe DSL
    prints under `remarks{ptx}`).

    Order matters: two builds of one kernel class (say with and without GQA) can share an entry name. Spill lines
    belong to the function named by the "Function properties for" line just before them, which is not always the
    entry being compiled (callees get their own).
    """
    entries: List[Tuple[str, Dict[str, int]]] = []
    props: Optional[str] = None
    for m in _PTXAS_EVENT.finditer(text):
        if m.group("entry"):
            entries.append((m.group("entry"), {}))
        elif m.group("props"):
            props = m.group("props")
        elif m.group("frame") is not None:
            current = entries[-1] if entries else None
            if current is not None and props == current[0]:
                current[1]["stack_frame_bytes"] = int(m.group("frame"))
                current[1]["spill_bytes"] = int(m.group("stores")) + int(m.group("loads"))
            props = None  # one report per "Function properties" line: never reuse a stale name
        elif m.group("regs") is not None and entries:
            entries[-1][1]["registers"] = int(m.group("regs"))
    return entries


def parse_ptxas_report(text: str) -> Dict[str, Dict[str, int]]:
    """`parse_ptxas_reports` by entry name (the last report wins when a name repeats)."""
    return dict(parse_ptxas_reports(text))


@contextlib.contextmanager
def capture_fd_stderr() -> Iterator[List[str]]:
    """Captures what is written to stderr during the block, at both levels: file descriptor 2 (native code) and
    `sys.stderr` (CuTe DSL prints ptxas remarks from Python, and pytest replaces `sys.stderr`)."""
    sink: List[str] = []
    py_err = io.StringIO()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            with contextlib.redirect_stderr(py_err):
                yield sink
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            sink.append(tmp.read().decode(errors="replace"))
            sink.append(py_err.getvalue())


def read_artifacts(compiled):
    """(PTX text, cubin bytes) of a kernel compiled with keep_artifacts_options (the DSL may hand back file paths)."""
    ptx, cubin = compiled.artifacts.PTX, compiled.artifacts.CUBIN
    if isinstance(ptx, str) and os.path.isfile(ptx):
        with open(ptx) as f:
            ptx = f.read()
    if isinstance(cubin, str) and os.path.isfile(cubin):
        with open(cubin, "rb") as f:
            cubin = f.read()
    return ptx, cubin
