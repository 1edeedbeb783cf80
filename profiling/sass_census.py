"""SASS census per loop: instruction classes of each loop of a cubin's kernels, and the order of the events that matter
for overlap (wgmma groups, their waits, exponentials, barriers, smem stores) inside each loop body.

No GPU needed: disassembles with cuobjdump (pip install nvidia-cuda-cuobjdump; found on PATH or in the nvidia
wheel's bin folder). A loop is the address range [target, branch] of a backward BRA; loops without any of the
instructions named by --min-class (default: HGMMA or UTMALDG or UBLKRED, i.e. the consumer, producer and dQ-writer
loops) are skipped, which drops the mbarrier retry spins.

    python -m profiling.sass_census A.cubin [B.cubin ...] [--sections] [--order] [--json]
    python -m profiling.sass_census --sass A.sass            # text from cuobjdump -sass

Counts are static (one pass over the loop body, i.e. one iteration); out-of-line retry blocks of mbarrier waits are
outside the body and not counted.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter, OrderedDict
from typing import Dict, List, Tuple
from profiling import HelpFormatter

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_FUNC = re.compile(r"Function : (\S+)")

_INT_OPS = ("IMAD", "IADD", "VIADD", "LOP", "SHF", "LEA", "IABS", "IMNMX", "FLO", "POPC", "BMSK", "I2F", "F2I")

# (class name, predicate on the opcode with modifiers); first match wins, order matters.
CLASSES: List[Tuple[str, callable]] = [
    ("HGMMA", lambda o: o.startswith("HGMMA")),
    ("WG.ARRIVE", lambda o: o.startswith("WARPGROUP.ARRIVE")),
    ("WG.DEPBAR", lambda o: o.startswith("WARPGROUP.DEPBAR")),
    ("MUFU.EX2", lambda o: o.startswith("MUFU.EX2")),
    ("MUFU.other", lambda o: o.startswith("MUFU")),
    ("FFMA", lambda o: o.startswith("FFMA")),
    ("FMUL", lambda o: o.startswith("FMUL")),
    ("FADD", lambda o: o.startswith("FADD")),
    ("FSEL/FMNMX", lambda o: o.startswith(("FSEL", "FMNMX"))),
    ("FSETP", lambda o: o.startswith("FSETP")),
    ("F2FP(cvt)", lambda o: o.startswith(("F2FP", "F2F"))),
    ("SHFL", lambda o: o.startswith("SHFL")),
    ("BAR.SYNC", lambda o: o.startswith("BAR.SYNC") or o == "BAR"),
    ("BAR.ARV", lambda o: o.startswith("BAR.ARV") or o.startswith("BAR.RED")),
    ("SYNCS.wait", lambda o: o.startswith("SYNCS.PHASECHK")),
    ("SYNCS.arrive", lambda o: o.startswith("SYNCS.ARRIVE")),
    ("SYNCS.other", lambda o: o.startswith("SYNCS")),
    ("MEMBAR/FENCE", lambda o: o.startswith(("MEMBAR", "FENCE", "CCTL"))),
    ("LDS", lambda o: o.startswith("LDS") and not o.startswith("LDSM")),
    ("LDSM", lambda o: o.startswith("LDSM")),
    ("STS", lambda o: o.startswith("STS") and not o.startswith("STSM")),
    ("STSM", lambda o: o.startswith("STSM")),
    ("LDG/STG", lambda o: o.startswith(("LDG", "STG", "RED", "ATOM"))),
    ("UTMA*", lambda o: o.startswith("UTMA")),
    ("UBLK*", lambda o: o.startswith("UBLK")),
    ("R2UR", lambda o: o.startswith("R2UR")),
    ("NANOSLEEP", lambda o: o.startswith("NANOSLEEP")),
    ("WARPSYNC", lambda o: o.startswith("WARPSYNC")),
    ("ELECT", lambda o: o.startswith("ELECT")),
    ("BRA", lambda o: o.startswith(("BRA", "BRX", "JMP", "CALL", "RET", "EXIT", "BSSY", "BSYNC"))),
    ("ISETP/PLOP", lambda o: o.startswith(("ISETP", "PLOP3", "P2R", "R2P", "VOTE"))),
    ("MOV/SEL/PRMT", lambda o: o.startswith(("MOV", "SEL", "PRMT", "CS2R", "S2R", "S2UR", "IMAD.MOV"))),
    ("DEPBAR", lambda o: o.startswith("DEPBAR")),
    ("U*(uniform)", lambda o: o.startswith("U")),
    ("INT", lambda o: o.startswith(_INT_OPS)),
    ("NOP", lambda o: o.startswith("NOP")),
]


def classify(op: str) -> str:
    for name, pred in CLASSES:
        if pred(op):
            return name
    return "other:" + op.split(".")[0]


def find_tool(name: str) -> str:
    path = shutil.which(name)
    if path:
        return path
    for site in sys.path:
        for cand in glob.glob(os.path.join(site, "nvidia", "*", "bin", name)) + glob.glob(
            os.path.join(site, "nvidia", "cuda_*", "bin", name)
        ):
            return cand
    raise SystemExit(f"{name} not found: pip install nvidia-cuda-cuobjdump (into the environment, not the project)")


def disassemble(cubin: str) -> str:
    return subprocess.run([find_tool("cuobjdump"), "-sass", cubin], check=True, capture_output=True, text=True).stdout


def parse(sass: str) -> Dict[str, List[Tuple[int, str, str, str]]]:
    """{function: [(address, predicate, opcode, operands)]}"""
    funcs: Dict[str, List] = OrderedDict()
    cur = None
    for line in sass.splitlines():
        m = _FUNC.search(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = _LINE.search(line)
        if not m or cur is None:
            continue
        addr, text = int(m.group(1), 16), m.group(2).strip()
        pred = ""
        if text.startswith("@"):
            pred, text = text.split(None, 1)
        parts = text.split(None, 1)
        cur.append((addr, pred, parts[0], parts[1] if len(parts) > 1 else ""))
    return funcs


def loops(instrs) -> List[Tuple[int, int]]:
    out = []
    for addr, pred, op, operands in instrs:
        # conditional backward branches only: the unconditional BRA back from an out-of-line mbarrier retry block
        # is not a loop
        if op.startswith("BRA") and pred:
            m = re.search(r"0x([0-9a-f]+)", operands)
            if m and int(m.group(1), 16) < addr:
                out.append((int(m.group(1), 16), addr))
    return out


def body(instrs, lo, hi):
    return [i for i in instrs if lo <= i[0] <= hi]


def census(instrs) -> Counter:
    return Counter(classify(op) for _a, _p, op, _o in instrs)


def order(instrs) -> List[str]:
    """Run-length compressed sequence of the events that matter for overlap."""
    keep = {
        "HGMMA",
        "WG.DEPBAR",
        "MUFU.EX2",
        "BAR.SYNC",
        "BAR.ARV",
        "SYNCS.wait",
        "SYNCS.arrive",
        "STS",
        "STSM",
        "LDS",
        "MEMBAR/FENCE",
        "SHFL",
        "UTMA*",
        "UBLK*",
        "F2FP(cvt)",
    }
    seq: List[List] = []
    for _a, pred, op, operands in instrs:
        c = classify(op)
        if c not in keep:
            continue
        label = c
        if c == "HGMMA":
            shape = op.split(".")[1]
            rs = "RS" if re.match(r"R\d+, R\d+, gdesc", operands) else "SS"
            label = f"HGMMA.{shape}.{rs}" + (" [commit]" if "gsb0" in operands else "")
        elif c == "WG.DEPBAR":
            label = "wait_group(" + operands.split(",")[-1].strip() + ")"
        elif c in ("BAR.SYNC", "BAR.ARV"):
            label = f"{op} {operands}"
        if seq and seq[-1][0] == label and not label.endswith("[commit]"):
            seq[-1][1] += 1
        else:
            seq.append([label, 1])
    return [f"{n}x {l}" if n > 1 else l for l, n in seq]


SECTION_KEYS = ("HGMMA", "MUFU.EX2", "FFMA", "FMUL", "FADD", "FSEL/FMNMX", "F2FP(cvt)", "SHFL", "LDS", "STSM", "STS")


def sections(instrs) -> List[Dict]:
    """The loop body cut at every wgmma wait and named barrier: what each stretch between two waits holds. The
    stretch after the first wait_group(1) and before the next wait is where the exponentials can overlap dP's
    product; the one after a named barrier up to the next wait is where the tensor pipe may idle."""
    out, cur, name = [], [], "top"
    for _a, _p, op, operands in instrs:
        cur.append(op)
        c = classify(op)
        if c in ("WG.DEPBAR", "BAR.SYNC", "BAR.ARV"):
            out.append((name, cur))
            cur, name = [], f"after {op.split('.')[0]} {operands.replace('gsb0, ', '')}"
    out.append((name, cur))
    rows = []
    for name, ops in out:
        c = Counter(classify(o) for o in ops)
        alu = sum(v for k, v in c.items() if k.startswith(("INT", "U*", "MOV", "ISETP")))
        row = {"section": name, "n": len(ops), "int/uniform": alu}
        row.update({k: c[k] for k in SECTION_KEYS if c[k]})
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("files", nargs="+", help="cubins (or SASS text with --sass)")
    ap.add_argument("--sass", action="store_true", help="inputs are cuobjdump -sass text")
    ap.add_argument("--order", action="store_true", help="print the event order of each loop body")
    ap.add_argument("--sections", action="store_true", help="print the loop body cut at wgmma waits and barriers")
    ap.add_argument("--json", action="store_true", help="print the census as JSON")
    ap.add_argument("--min-class", default="HGMMA,UTMA*,UBLK*", help="report loops holding one of these classes")
    args = ap.parse_args(argv)
    wanted = set(args.min_class.split(","))
    results = []
    for f in args.files:
        sass = open(f).read() if args.sass else disassemble(f)
        for func, instrs in parse(sass).items():
            for lo, hi in loops(instrs):
                b = body(instrs, lo, hi)
                c = census(b)
                if not wanted & set(c):
                    continue
                results.append(
                    {
                        "file": os.path.basename(f),
                        "function": func[:60],
                        "loop": f"0x{lo:x}-0x{hi:x}",
                        "instructions": len(b),
                        "census": dict(sorted(c.items(), key=lambda kv: -kv[1])),
                        "order": order(b) if args.order else None,
                        "sections": sections(b) if args.sections else None,
                    }
                )
    if args.json:
        for r in results:
            print(json.dumps(r))
        return
    for r in results:
        print(f"== {r['file']}  loop {r['loop']}  {r['instructions']} instructions")
        print("   " + ", ".join(f"{k} {v}" for k, v in r["census"].items()))
        if r["sections"]:
            for row in r["sections"]:
                rest = ", ".join(f"{k} {v}" for k, v in row.items() if k not in ("section", "n"))
                print(f"     {row['section']:<34} {row['n']:4d}  {rest}")
        if r["order"]:
            for e in r["order"]:
                print("     " + e)


if __name__ == "__main__":
    main()
