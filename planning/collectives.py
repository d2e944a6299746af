"""Collectives of a compiled XLA program, per step: parsed from ``compiled.as_text()``.

A collective inside a loop runs once per iteration, so each one is weighted by the trip counts
of the ``while`` loops around it (XLA annotates ``known_trip_count``): the scan over layers and
the ring's rounds turn a handful of HLO instructions into thousands of transfers per step.
A ``conditional`` whose branch is read from a constant table by the loop's counter (the scan over
a layer pattern switching to each layer's kind, model/decoder.py) runs each branch as often as
the table names it; any other counts each branch as if it always ran (an upper bound).

Bytes are what one device sends or receives per execution: the gathered result of an
all-gather, the operand of the others. XLA CPU has no bf16 collectives and promotes them to
f32 around a convert; such operands are counted at 2 bytes an element, as the accelerator
would move them (``bytes``), next to the bytes as compiled here (``cpu_bytes``).
"""
from __future__ import annotations

import dataclasses
import math
import re
from fractions import Fraction

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
_OPCODE_KIND = {k: k for k in KINDS}
_OPCODE_KIND.update({k + "-start": k for k in KINDS})
_OPCODE_KIND["ragged-all-to-all"] = "all-to-all"

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
               "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
               "c128": 16, "token": 0}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_PASS_THROUGH = ("bitcast", "copy", "reshape", "transpose", "broadcast")


@dataclasses.dataclass
class Instr:
    name: str
    type: str  # "f32[4,8]{1,0}" or a tuple "(f32[], s32[2]{0})"
    opcode: str
    operands: list[str]
    attrs: str
    literal: str = ""  # a constant's value, as written


@dataclasses.dataclass
class Collective:
    kind: str
    count: int  # executions per step (static count x loop trip counts)
    bytes: float  # per execution per device, at the accelerator's dtype
    cpu_bytes: float  # per execution per device, as compiled for CPU
    group_size: int  # devices taking part in each group (2 for a permute pair)
    groups: list  # device groups (lists of logical ids; pairs for a permute)
    name: str
    op_name: str = ""  # JAX's name for the op (metadata op_name: its named scopes)


def _matching(s: str, i: int) -> int:
    """Index just past the bracket that closes the one at ``s[i]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    want = []
    for j in range(i, len(s)):
        c = s[j]
        if c in pairs:
            want.append(pairs[c])
        elif want and c == want[-1]:
            want.pop()
            if not want:
                return j + 1
    return len(s)


def _split_top(s: str) -> list[str]:
    out, depth, cur = [], 0, []
    for c in s:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    name, rest = m.group(1), m.group(2)
    if rest.startswith("("):
        end = _matching(rest, 0)
    else:
        end = rest.find(" ")
        if end < 0:
            return None
    typ, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    close = _matching(rest, op.end() - 1)
    inside = rest[op.end():close - 1]
    if op.group(1) == "constant":
        return Instr(name, typ, "constant", [], rest[close:], inside)
    operands = [o.split()[-1].lstrip("%") for o in _split_top(inside) if o]
    return Instr(name, typ, op.group(1), operands, rest[close:])


@dataclasses.dataclass
class Module:
    comps: dict[str, dict[str, Instr]]  # computation -> instruction name -> Instr, in order
    roots: dict[str, str]  # computation -> name of its ROOT instruction
    entry: str


def parse_module(text: str) -> Module:
    comps, roots, entry, cur = {}, {}, None, None
    for line in text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            head = line.split()
            is_entry = head[0] == "ENTRY"
            cur = (head[1] if is_entry else head[0]).lstrip("%")
            comps[cur] = {}
            if is_entry:
                entry = cur
            continue
        if line.startswith("}"):
            cur = None
            continue
        if cur is not None:
            ins = parse_instr(line)
            if ins:
                comps[cur][ins.name] = ins
                if line.lstrip().startswith("ROOT"):
                    roots[cur] = ins.name
    return Module(comps, roots, entry)


def _called(ins: Instr, comp: dict | None = None,
            mod: Module | None = None) -> list[tuple[str, int | Fraction]]:
    """Computations an instruction of ``comp`` runs and how many times per execution of it (a
    branch of a conditional: its share of the executions, when ``_branch_table`` reads it)."""
    a = ins.attrs
    if ins.opcode == "while":
        body = re.search(r"body=%?([\w.\-]+)", a)
        trip = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', a)
        return [(body.group(1), int(trip.group(1)) if trip else 1)] if body else []
    out = []
    if ins.opcode == "call":  # a call names its callee to_apply, like a reducer does
        m = re.search(r"to_apply=%?([\w.\-]+)", a)
        out += [(m.group(1), 1)] if m else []
    for key in ("calls", "true_computation", "false_computation"):
        for m in re.finditer(key + r"=%?([\w.\-]+)", a):
            out.append((m.group(1), 1))
    br = re.search(r"branch_computations=\{([^}]*)\}", a)
    if br:
        branches = [b.strip().lstrip("%") for b in br.group(1).split(",") if b.strip()]
        table = _branch_table(ins.operands[0], comp, mod) if comp and mod else None
        if table and all(0 <= t < len(branches) for t in table):
            out += [(b, Fraction(table.count(i), len(table))) for i, b in enumerate(branches)]
        else:
            out += [(b, 1) for b in branches]
    return out


def _branch_table(name: str, comp: dict, mod: Module, outer=None,
                  depth: int = 0) -> list[int] | None:
    """The branch each iteration of a loop takes, when a conditional's index ``name`` is an
    entry of a constant table read at the loop's counter (a dynamic-slice of it, clamped into
    the branches as lax.switch does): the table. None for any other index."""
    ins = comp.get(name)
    if ins is None or depth > 12:
        return None
    if ins.opcode == "clamp" and len(ins.operands) == 3:
        lo, values, hi = (_branch_table(o, comp, mod, outer, depth + 1) for o in ins.operands)
        if not (lo and hi and values) or len(lo) != 1 or len(hi) != 1:
            return None
        return [min(max(v, lo[0]), hi[0]) for v in values]
    if ins.opcode == "constant":
        integral = re.match(r"[su]\d+\[", ins.type)
        return [int(x) for x in re.findall(r"-?\d+", ins.literal)] if integral else None
    if ins.opcode in ("bitcast", "reshape", "copy", "convert") and ins.operands:
        return _branch_table(ins.operands[0], comp, mod, outer, depth + 1)
    if ins.opcode == "dynamic-slice" and ins.operands:
        return _branch_table(ins.operands[0], comp, mod, outer, depth + 1)
    across = _across_fusion(ins, comp, mod, outer)
    return _branch_table(*across, depth + 1) if across else None


def _across_fusion(ins, comp: dict, mod: Module, outer):
    """Where a value traced back to its source goes on from a fusion (into its fused root) or
    from a fused computation's parameter (out to that operand of the fusion):
    (name, computation, mod, outer) to trace next, or None."""
    if ins.opcode == "fusion":
        callee = re.search(r"calls=%?([\w.\-]+)", ins.attrs)
        fused = callee and callee.group(1)
        if fused in mod.comps and fused in mod.roots:
            return mod.roots[fused], mod.comps[fused], mod, (ins, comp)
    elif ins.opcode == "parameter" and outer is not None:
        idx = int(re.match(r"\s*(\d+)", ins.operands[0]).group(1)) if ins.operands else 0
        fusion, parent = outer
        if idx < len(fusion.operands):
            return fusion.operands[idx], parent, mod, None
    return None


def multiplicities(mod: Module) -> dict[str, int]:
    """How many times each computation runs per execution of the entry computation.

    A computation reached along several paths adds up; the call graph is a DAG, walked in
    topological order over the part reachable from the entry."""
    edges = {c: [e for ins in instrs.values() for e in _called(ins, instrs, mod)
                 if e[0] in mod.comps]
             for c, instrs in mod.comps.items()}
    reach, stack = {mod.entry}, [mod.entry]
    while stack:
        for callee, _ in edges[stack.pop()]:
            if callee not in reach:
                reach.add(callee)
                stack.append(callee)
    indeg = {c: 0 for c in reach}
    for c in reach:
        for callee, _ in edges[c]:
            indeg[callee] += 1
    mult = {c: 0 for c in reach}
    mult[mod.entry] = 1
    ready = [c for c in reach if indeg[c] == 0]
    while ready:
        c = ready.pop()
        for callee, times in edges[c]:
            mult[callee] += mult[c] * times
            indeg[callee] -= 1
            if indeg[callee] == 0:
                ready.append(callee)
    return {c: int(round(m)) for c, m in mult.items()}


def array_bytes(typ: str, dtype_override: str | None = None) -> float:
    total = 0.0
    for dt, dims in _ARRAY.findall(typ):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * DTYPE_BYTES.get(dtype_override or dt, 4)
    return total


def _dtype(typ: str) -> str | None:
    m = _ARRAY.search(typ)
    return m.group(1) if m else None


def _promoted_bf16(name: str, comp: dict, mod: Module, outer=None, depth: int = 0) -> bool:
    """True when an f32 value is a bf16 value converted up (XLA CPU's float normalization)."""
    ins = comp.get(name)
    if ins is None or depth > 12:
        return False
    if ins.opcode == "convert":
        src = comp.get(ins.operands[0])
        return src is not None and _dtype(src.type) == "bf16"
    if ins.opcode in _PASS_THROUGH and ins.operands:
        return _promoted_bf16(ins.operands[0], comp, mod, outer, depth + 1)
    across = _across_fusion(ins, comp, mod, outer)
    return _promoted_bf16(*across, depth + 1) if across else False


def _iota(spec: str) -> np.ndarray:
    """``[4,2]T(1,0)``: iota over the dims, transposed (XLA's IotaTileAssignment)."""
    m = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    dims = [int(x) for x in m.group(1).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose([int(x) for x in m.group(2).split(",")]) if m.group(2) else ids


def _groups(attrs: str, num_devices: int) -> list[list[int]]:
    """Device groups of a collective from its replica_groups / source_target_pairs text."""
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if pairs:
        return [[int(x) for x in p.split(",")] for p in re.findall(r"\{(\d+,\d+)", pairs.group(0))]
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]"
                  r"(?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[\d,\s]+)\))?"
                  r"(?:\s*\{('[^}]*)\})?", attrs)
    if m:
        # Shardy's form: devices laid out as a mesh of named sizes (in device_ids order, iota
        # when absent); each group is the devices that vary along the braced axes.
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        ids = np.arange(math.prod(sizes))
        if m.group(2):
            ids = _iota(m.group(2)) if m.group(2).startswith("[") else np.array(
                [int(x) for x in m.group(2).split(",") if x.strip()])
        ids = ids.reshape(sizes)
        varying = re.findall(r"'(\w+)'", m.group(3)) if m.group(3) else names
        keep = [names.index(v) for v in varying if v in names]
        rest = [i for i in range(len(names)) if i not in keep]
        size = math.prod(sizes[i] for i in keep)
        return ids.transpose(rest + keep).reshape(-1, size).tolist()
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)", attrs)
    if m:
        return _iota(m.group(3)).reshape(int(m.group(1)), int(m.group(2))).tolist()
    m = re.search(r"replica_groups=\{(.*?)\}(?:,|$)", attrs)
    if m and m.group(1).strip():
        return [[int(x) for x in grp.split(",") if x] for grp in re.findall(r"\{([\d,]*)\}", m.group(0))]
    return [list(range(num_devices))]


def program_text(compiled) -> str:
    """A compiled program's HLO text with every constant written out: ``as_text()`` elides a
    large one as ``{...}``, and a layer pattern's table of kinds is one (``_branch_table``)."""
    try:
        from jax._src.lib import hlo
        options = hlo.HloPrintOptions()
        options.print_large_constants = True
        return "\n".join(m.to_string(options)
                         for m in compiled.runtime_executable().hlo_modules())
    except (ImportError, AttributeError):  # another JAX: the upper bound for such branches
        return compiled.as_text()


def collectives(text: str, num_devices: int) -> list[Collective]:
    """Every collective of the compiled module with its executions per step."""
    mod = parse_module(text)
    mult = multiplicities(mod)
    out = []
    for cname, comp in mod.comps.items():
        times = mult.get(cname, 0)
        if not times:
            continue
        for ins in comp.values():
            kind = _OPCODE_KIND.get(ins.opcode)
            if kind is None:
                continue
            groups = _groups(ins.attrs, num_devices)
            gsize = max((len(g) for g in groups), default=1)
            cpu = acc = 0.0
            for op in ins.operands:
                src = comp.get(op)
                if src is None:
                    continue
                b = array_bytes(src.type)
                cpu += b
                promoted = _dtype(src.type) == "f32" and _promoted_bf16(op, comp, mod)
                acc += b / 2 if promoted else b
            if kind == "all-gather":
                cpu, acc = cpu * gsize, acc * gsize
            op_name = re.search(r'op_name="([^"]*)"', ins.attrs)
            out.append(Collective(kind, times, acc, cpu, 2 if kind == "collective-permute" else gsize,
                                  groups, ins.name, op_name.group(1) if op_name else ""))
    return out


def summarize(colls: list[Collective]) -> dict[str, dict]:
    """Per kind: executions per step and bytes per step per device (both dtypes)."""
    out = {k: {"count": 0, "bytes": 0.0, "cpu_bytes": 0.0, "instructions": 0} for k in KINDS}
    for c in colls:
        s = out[c.kind]
        s["count"] += c.count
        s["instructions"] += 1
        s["bytes"] += c.count * c.bytes
        s["cpu_bytes"] += c.count * c.cpu_bytes
    return out


def link_traffic(c: Collective) -> float:
    """Bytes one device pushes through its link per execution, for bandwidth-optimal ring
    algorithms: an all-reduce is a reduce-scatter plus an all-gather."""
    n = c.group_size
    if c.kind == "collective-permute":
        return c.bytes
    if n <= 1:
        return 0.0
    share = (n - 1) / n
    return c.bytes * (2 * share if c.kind == "all-reduce" else share)


def crosses_nodes(c: Collective, node_size: int) -> bool:
    """Whether any group spans more than one node of ``node_size`` consecutive logical ids."""
    if not node_size:
        return False
    return any(len({d // node_size for d in g}) > 1 for g in c.groups)
