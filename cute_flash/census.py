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
from typing import Dict, Iterator, List

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
_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_PROPERTIES = re.compile(r"Function properties for (\S+)")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas_report(text: str) -> Dict[str, Dict[str, int]]:
    """Per kernel from ptxas -v output (CuTe DSL's `remarks{ptx}`): registers and spill bytes.

    Spill lines belong to the function named by the "Function properties for" line just before them, which is not
    always the entry being compiled (callees get their own), so each line is keyed by the name it follows.
    """
    out: Dict[str, Dict[str, int]] = {}
    entry = None
    props = None
    for line in text.splitlines():
        m = _PTXAS_ENTRY.search(line)
        if m:
            entry = m.group(1)
            out.setdefault(entry, {})
            continue
        m = _PTXAS_PROPERTIES.search(line)
        if m:
            props = m.group(1)
            continue
        m = _PTXAS_SPILL.search(line)
        if m and props is not None:
            rec = out.setdefault(props, {})
            rec["stack_frame_bytes"] = int(m.group(1))
            rec["spill_bytes"] = int(m.group(2)) + int(m.group(3))
            continue
        m = _PTXAS_REGS.search(line)
        if m and entry is not None:
            out[entry]["registers"] = int(m.group(1))
    return out


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
