"""Which part of the model each HLO instruction belongs to, from XLA's optimized HLO text.

XLA's CPU runtime names each executed operation (a *thunk*) after an
instruction of the optimized HLO module (``fusion.12``, ``dot.3``,
``while.2``). ``--xla_dump_to`` writes that module as text
(``*.cpu_after_optimizations.txt``); every instruction carries
``metadata={op_name=... stack_frame_id=...}``: the JAX primitive's path
(``jit(run_body)/jit(ragged_paged_attention_reference)/.../dot_general``,
including any ``jax.named_scope``) and the innermost Python frame that
created it (file and qualified function name, from the module's
``FileNames`` / ``FunctionNames`` / ``FileLocations`` / ``StackFrames``
tables). A fusion's instructions live in its called computation.

Categories (CATEGORIES), first rule that matches:

1. ``attention``: a frame in ``pallas_kernels/`` or ``jaxserve/model/attention.py``,
   a ``paged_attention`` function, or a ``paged_attention`` / ``attention``
   component in the op name;
2. ``kv_write``: a frame in ``write_kv`` / ``kv_cache.py``, or a ``kv_write``
   op-name component;
3. ``sampler``: a frame in ``jaxserve/worker/sampler/``, a ``sampler``
   op-name component, or anything else in a module whose name says
   ``sampl``;
4. ``other``: norms, RoPE, the embedding gather, residual adds, copies.

Matmuls: a ``dot`` / ``convolution``, or a custom call made by the C++ CPU
product (innermost frame ``cpu_kernels`` ``matmul``), is ``matmul`` (the LM
head included) unless it belongs to attention. A fusion takes the category of its dot if
it has one, else of its root instruction, else its members' majority
(``categorize``).
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
import re

CATEGORIES = ("attention", "matmul", "kv_write", "sampler", "other")

_TABLE = re.compile(r"^(\d+) (.*)$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"(?<![\w\-])([a-z][a-z0-9\-]*)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_FIELD = re.compile(r"(\w+)=(\d+)")
_COMP_START = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_TOKENS = re.compile(r"input_ids[\w.]*: s32\[(\d+)\]")
# The worker's compiled step functions are named after their executable
# ("body[T=64]" → module jit_body_T64; jaxserve/worker/compile_manager.py).
_BODY_MODULE = re.compile(r"^jit_body_T(\d+)\b")

_ATTN_NAME = re.compile(r"(^|[/(])(ragged_)?paged_attention\w*|(^|/)attention(/|$)")
_KV_NAME = re.compile(r"(^|/)(kv_write|write_kv)(/|$)")
_SAMPLER_NAME = re.compile(r"(^|/)sampler(/|$)")


@dataclasses.dataclass(frozen=True, slots=True)
class Instruction:
    name: str
    opcode: str
    op_name: str
    frame: tuple[str, str] | None  # (file, qualified function) of the innermost frame
    calls: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class HloModule:
    """One optimized module: name, T (``input_ids`` length or the body's module name), categories."""

    name: str
    num_tokens: int | None
    categories: dict[str, str]  # instruction name -> category


def _tables(lines: list[str]) -> dict[str, dict[int, str]]:
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in lines:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        if current is not None:
            match = _TABLE.match(line)
            if match is None:
                current = None
                continue
            current[int(match.group(1))] = match.group(2)
    return tables


def _frames(tables: dict[str, dict[int, str]]) -> dict[int, tuple[str, str]]:
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    funcs = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locations = {}
    for k, v in tables.get("FileLocations", {}).items():
        fields = dict((a, int(b)) for a, b in _FIELD.findall(v))
        locations[k] = (files.get(fields.get("file_name_id", 0), ""),
                        funcs.get(fields.get("function_name_id", 0), ""))
    frames = {}
    for k, v in tables.get("StackFrames", {}).items():
        fields = dict((a, int(b)) for a, b in _FIELD.findall(v))
        frames[k] = locations.get(fields.get("file_location_id", 0), ("", ""))
    return frames


def parse(text: str) -> tuple[str, dict[str, list[Instruction]], dict[str, Instruction],
                             int | None]:
    """(module name, computation -> instructions, instruction name -> instruction, T or None)."""
    lines = text.splitlines()
    header = lines[0] if lines else ""
    module = header.split()[1].rstrip(",") if header.startswith("HloModule") else "?"
    frames = _frames(_tables(lines))
    computations: dict[str, list[Instruction]] = {}
    by_name: dict[str, Instruction] = {}
    current: list[Instruction] | None = None
    num_tokens = None
    for line in lines:
        if current is None:
            start = _COMP_START.match(line)
            if start is not None:
                current = computations.setdefault(start.group(1), [])
                if line.startswith("ENTRY"):
                    tokens = _TOKENS.search(line) or _BODY_MODULE.search(module)
                    num_tokens = int(tokens.group(1)) if tokens else None
            continue
        if line.startswith("}"):
            current = None
            continue
        match = _INSTR.match(line)
        if match is None:
            continue
        name, rest = match.groups()
        opcode = _OPCODE.search(rest)
        op_name = _OP_NAME.search(rest)
        frame = _FRAME.search(rest)
        calls = _CALLS.search(rest)
        instr = Instruction(name, opcode.group(1) if opcode else "",
                            op_name.group(1) if op_name else "",
                            frames.get(int(frame.group(1))) if frame else None,
                            calls.group(1) if calls else None)
        current.append(instr)
        by_name[name] = instr
    return module, computations, by_name, num_tokens


def _is_attention(i: Instruction) -> bool:
    if _ATTN_NAME.search(i.op_name):
        return True
    if i.frame is None:
        return False
    file, func = i.frame
    return ("pallas_kernels/" in file or file.endswith("model/attention.py")
            or "paged_attention" in func)


def _is_kv_write(i: Instruction) -> bool:
    if _KV_NAME.search(i.op_name):
        return True
    return i.frame is not None and (i.frame[1].endswith("write_kv") or
                                    i.frame[0].endswith("kv_cache.py"))


def _is_sampler(i: Instruction) -> bool:
    return bool(_SAMPLER_NAME.search(i.op_name)) or (
        i.frame is not None and "/worker/sampler/" in i.frame[0])


def _is_product(i: Instruction) -> bool:
    """A dot, or a C++ CPU product's custom call (``cpu_kernels.matmul`` / ``matmul_i8``)."""
    return i.opcode in ("dot", "convolution") or (
        i.opcode == "custom-call" and i.frame is not None
        and i.frame[0].endswith("cpu_kernels/__init__.py")
        and i.frame[1] in ("matmul", "matmul_i8"))


_TRIVIAL = frozenset(("parameter", "constant", "bitcast", "get-tuple-element", "tuple"))


def _member_category(i: Instruction) -> str:
    if _is_attention(i):
        return "attention"
    if _is_kv_write(i):
        return "kv_write"
    if _is_sampler(i):
        return "sampler"
    return "other"


def categorize(instr: Instruction, computations: dict[str, list[Instruction]],
               module_name: str) -> str:
    """The category of one (top-level or nested) instruction; see the module docstring.

    For a fusion: a dot inside decides (attention's dots are attention, the
    others matmul); otherwise its root instruction (what it computes), then
    the most common category of its members.
    """
    members = list(computations.get(instr.calls, ())) if instr.calls else []
    members = [m for m in members if m.opcode not in _TRIVIAL] or [instr]
    dots = [m for m in members if _is_product(m)]
    if dots:
        return "attention" if any(_is_attention(d) for d in dots) else "matmul"
    category = _member_category(members[-1])  # the ROOT is printed last
    if category == "other":
        votes = collections.Counter(_member_category(m) for m in members)
        votes.pop("other", None)
        if votes:
            category = votes.most_common(1)[0][0]
    if category == "other" and "sampl" in module_name:
        return "sampler"
    return category


def categorize_by_name(op: str, module_name: str) -> str:
    """Fallback without the module text: a guess from the thunk's name alone."""
    if "sampl" in module_name:
        return "matmul" if op.startswith("dot") else "sampler"
    if op.startswith(("dot", "convolution")):
        return "matmul"
    if "scatter" in op:
        return "kv_write"
    return "other"


def load_module(path: str | pathlib.Path) -> HloModule:
    """Parses one ``*.cpu_after_optimizations.txt`` dump."""
    name, computations, by_name, num_tokens = parse(pathlib.Path(path).read_text())
    return HloModule(name, num_tokens,
                     {n: categorize(i, computations, name) for n, i in by_name.items()})


def load_dump(directory: str | pathlib.Path) -> list[HloModule]:
    """Every optimized module in an ``--xla_dump_to`` folder (in dump order).

    CPU dumps end ``.cpu_after_optimizations.txt``, GPU ones e.g.
    ``.sm_9.0_gpu_after_optimizations.txt``.
    """
    paths = sorted(pathlib.Path(directory).glob("*after_optimizations.txt"))
    return [load_module(p) for p in paths]
