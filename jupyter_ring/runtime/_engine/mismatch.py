"""Explaining a mismatch: the ranks exchange full descriptions of the collective each called, and
every rank raises the same ``CollectiveMismatchError`` naming the field and the ranks that differ.

The slow path of the agreement (``agreement``), taken once the headers say the ranks disagree;
``describe_mismatch`` and ``collective_title`` also word the device transport's errors.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal, NoReturn, TypedDict, cast

import numpy as np

from .errors import CollectiveMismatchError
from .wire import OP_NAMES, TAG_DESC, Desc

if TYPE_CHECKING:
    from .core import Runtime

__all__ = ["Description", "explain_mismatch", "describe_mismatch", "collective_title"]

_DESC_BYTES = 1 << 16  # the longest description a rank sends (a huge group's is cut to fit)


class Description(TypedDict):
    """One rank's full description of a collective, exchanged to explain a mismatch."""

    kind: str
    name: str
    op: str | int            # the op's name (OP_NAMES), or the unknown value itself
    root: int
    dtype: str | None
    desc: Desc


def explain_mismatch(rt: Runtime, kind: str, name: str, dtype: np.dtype | None, op: int, root: int,
                     desc: Desc) -> NoReturn:
    """Slow path: exchange full descriptions so every rank raises the same precise error."""
    mine: Description = {"kind": kind, "name": name, "op": OP_NAMES.get(op, op), "root": root,
                         "dtype": str(dtype) if dtype is not None else None, "desc": desc}
    comm = rt.comm
    data = pickle.dumps(mine)
    if len(data) > _DESC_BYTES:  # a huge group: describe its first tensors only
        # the members' label is "tensors (name, shape)" (allreduce_desc): cut their list
        mine["desc"] = tuple((label, value if not label.startswith("tensors")
                              else cast("tuple[object, ...]", value)[:100]) for label, value in desc)
        data = pickle.dumps(mine)[:_DESC_BYTES]
    peers = rt.active
    bufs = {p: bytearray(_DESC_BYTES) for p in peers}
    recvs = [comm.Irecv(bufs[p], p, TAG_DESC) for p in peers]
    sends = [comm.Isend(data, p, TAG_DESC) for p in peers]
    rt.inflight = recvs + sends
    rt.keep.append(data)
    rt.waits.wait(recvs + sends, f"{kind} '{name}' (comparing descriptions)", peers + peers)
    descs = {rt.world[rt.rank]: mine}
    for p in peers:
        descs[rt.world[p]] = pickle.loads(bufs[p])  # pickle stops at its STOP opcode: padding is ignored
    raise CollectiveMismatchError(describe_mismatch(descs))


def collective_title(kind: str, name: str) -> str:
    """``allreduce 'fc1.weight'`` for a user's name; ``allreduce (unnamed)`` for the name the
    runtime made up (``allreduce.noname.3``), which only adds noise to a message."""
    if name.startswith(f"{kind}.noname."):
        return f"{kind} (unnamed)"
    return f"{kind} '{name}'"


def describe_mismatch(descs: Mapping[int, Description]) -> str:
    """One message naming the op, the ranks and the values that differ."""
    ranks = sorted(descs)
    ref = descs[ranks[0]]
    title = collective_title(ref["kind"], ref["name"])
    field: Literal["kind", "name", "dtype", "op", "root"]
    values: dict[int, object]
    for field, label in (("kind", "called"), ("name", "name"), ("dtype", "dtype"), ("op", "reduce op"),
                         ("root", "root rank")):
        values = {r: descs[r][field] for r in ranks}
        if len(set(map(repr, values.values()))) > 1:
            return _differ(title, label, values, _hint(label))
    # desc tuples: first element is a tuple of labelled fields
    for index, (label, _value) in enumerate(ref["desc"]):
        values = {}
        for r in ranks:
            entries = descs[r]["desc"]
            values[r] = entries[index][1] if index < len(entries) else None
        if len(set(map(repr, values.values()))) > 1:
            return _differ(title, label, values, _hint(label))
    lengths = {r: len(descs[r]["desc"]) for r in ranks}
    return _differ(title, "description length", lengths, _hint(""))


def _fmt(value: object) -> str:
    if isinstance(value, tuple) and all(isinstance(v, int) for v in value):
        return "(" + ", ".join(map(str, value)) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, str):
        return value
    return repr(value)


def _differ(title: str, label: str, values: Mapping[int, object], hint: str) -> str:
    groups: dict[str, list[int]] = {}
    for r, value in values.items():
        groups.setdefault(_fmt(value), []).append(r)
    parts = [f"{value} on {_ranks(rs)}" for value, rs in groups.items()]
    text = f"{title}: {label} {parts[0]} but " + ", ".join(parts[1:])
    return text + ". " + hint


def _ranks(rs: Sequence[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def _hint(field: str) -> str:
    return {
        "called": "Every rank must call the same collectives in the same order.",
        "name": "Every rank must pass the same name= to the same collective.",
        "dtype": "Cast the tensor to one dtype on every rank before the collective.",
        "shape": "Every rank must pass a tensor of the same shape (allgather: same trailing dims).",
        "number of tensors": "Every rank must pass the same number of tensors.",
        "root rank": "Pass the same root_rank on every rank.",
        "reduce op": "Pass the same op= on every rank.",
        "trailing shape": "allgather/alltoall tensors may differ in dim 0 only; the other dims must match.",
    }.get(field, "Every rank must call the collective with the same arguments.")
