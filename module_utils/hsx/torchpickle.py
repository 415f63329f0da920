"""torch.save's data.pkl read as data, never run: which tensors a shard holds, and where.

read_tensor_pickle understands only the opcodes torch's writer emits and the globals a tensor
dict needs, builds plain descriptions (TensorMeta, StorageRef) instead of calling anything, and
refuses everything else with ShardBad: a pickle from an untrusted file never executes code here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from .errors import ShardBad
from .layout import STORAGE_DTYPES

MAX_PICKLE = 1 << 20  # a shard's data.pkl is ~400 bytes (check.py refuses a larger record unread)
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")


@dataclass
class StorageRef:
    key: str
    dtype: str
    location: str
    numel: int


@dataclass
class TensorMeta:
    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class _Global:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


_REBUILD = "torch._utils._rebuild_tensor_v2"
_ORDERED_DICT = "collections.OrderedDict"
_ALLOWED_GLOBALS = {_REBUILD, _ORDERED_DICT} | {f"torch.{s}" for s in STORAGE_DTYPES}


def read_tensor_pickle(data: bytes) -> dict[str, TensorMeta]:
    """Interpret torch.save's data.pkl as data, never as code.

    Only the opcodes torch's writer emits are understood; GLOBAL may name only the tensor
    rebuild function, OrderedDict and the storage classes, and nothing is ever called:
    REDUCE/BINPERSID build plain descriptions. Any other opcode or global -> ShardBad.
    Hot opcodes are inlined (this loop is most of `quick`'s time); marks live on a separate
    stack as in CPython's own unpickler.
    """
    if len(data) > MAX_PICKLE:
        raise ShardBad(f"pickle too large ({len(data)} bytes)")
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    pos, end = 0, len(data)
    u32 = _U32.unpack_from
    try:
        while True:
            op = data[pos]
            pos += 1
            if op == 0x71:  # BINPUT
                memo[data[pos]] = stack[-1]
                pos += 1
            elif op == 0x68:  # BINGET
                stack.append(memo[data[pos]])
                pos += 1
            elif op == 0x4B:  # BININT1
                stack.append(data[pos])
                pos += 1
            elif op == 0x28:  # MARK
                marks.append(len(stack))
            elif op == 0x58:  # BINUNICODE
                (n,) = u32(data, pos)
                pos += 4 + n
                if pos > end:
                    raise ShardBad("pickle truncated in a string")
                stack.append(data[pos - n : pos].decode("utf-8"))
            elif 0x85 <= op <= 0x87:  # TUPLE1..3
                n = op - 0x84
                if len(stack) < n:
                    raise ShardBad("pickle stack underflow")
                items = tuple(stack[-n:])
                del stack[-n:]
                stack.append(items)
            elif op == 0x52:  # REDUCE
                args = stack.pop()
                stack[-1] = _reduce(stack[-1], args, pos - 1)
            elif op == 0x74:  # TUPLE
                k = marks.pop()
                items = tuple(stack[k:])
                del stack[k:]
                stack.append(items)
            elif op == 0x51:  # BINPERSID
                stack[-1] = _storage_ref(stack[-1])
            elif op == 0x89:  # NEWFALSE
                stack.append(False)
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(())
            elif op == 0x63:  # GLOBAL
                nl1 = data.index(b"\n", pos)
                nl2 = data.index(b"\n", nl1 + 1)
                name = f"{_utf8(data[pos:nl1])}.{_utf8(data[nl1 + 1 : nl2])}"
                stack.append(_allowed_global(name, pos - 1))
                pos = nl2 + 1
            elif op == 0x75:  # SETITEMS
                k = marks.pop()
                items = stack[k:]
                del stack[k:]
                if len(items) % 2:
                    raise ShardBad("pickle SETITEMS with an odd item count")
                target = stack[-1]
                for i in range(0, len(items), 2):
                    _setitem(target, items[i], items[i + 1])
            elif op == 0x73:  # SETITEM
                value = stack.pop()
                key = stack.pop()
                _setitem(stack[-1], key, value)
            elif op == 0x7D:  # EMPTY_DICT
                stack.append({})
            elif op == 0x80:  # PROTO
                pos += 1
            elif op == 0x95:  # FRAME
                pos += 8
            elif op == 0x8C:  # SHORT_BINUNICODE
                n = data[pos]
                pos += 1 + n
                if pos > end:
                    raise ShardBad("pickle truncated in a string")
                stack.append(data[pos - n : pos].decode("utf-8"))
            elif op == 0x72:  # LONG_BINPUT
                memo[u32(data, pos)[0]] = stack[-1]
                pos += 4
            elif op == 0x94:  # MEMOIZE
                memo[len(memo)] = stack[-1]
            elif op == 0x6A:  # LONG_BINGET
                stack.append(memo[u32(data, pos)[0]])
                pos += 4
            elif op == 0x93:  # STACK_GLOBAL
                qual = stack.pop()
                module = stack.pop()
                if not isinstance(qual, str) or not isinstance(module, str):
                    raise ShardBad("pickle STACK_GLOBAL without names")
                stack.append(_allowed_global(f"{module}.{qual}", pos - 1))
            elif op == 0x4D:  # BININT2
                stack.append(data[pos] | data[pos + 1] << 8)
                pos += 2
            elif op == 0x4A:  # BININT
                stack.append(_I32.unpack_from(data, pos)[0])
                pos += 4
            elif op == 0x8A:  # LONG1
                n = data[pos]
                pos += 1 + n
                if pos > end:
                    raise ShardBad("pickle truncated in LONG1")
                stack.append(int.from_bytes(data[pos - n : pos], "little", signed=True))
            elif op == 0x88:  # NEWTRUE
                stack.append(True)
            elif op == 0x4E:  # NONE
                stack.append(None)
            elif op == 0x2E:  # STOP
                if len(stack) != 1 or marks:
                    raise ShardBad("pickle leaves data on the stack")
                if pos != end:
                    raise ShardBad("pickle has bytes after STOP")
                result = stack[0]
                if not isinstance(result, dict) or not all(
                    isinstance(v, TensorMeta) for v in result.values()
                ):
                    raise ShardBad("pickle is not a dict of tensors")
                return result
            else:
                raise ShardBad(f"pickle opcode 0x{op:02x} at byte {pos - 1} is not one torch.save writes")
    except IndexError:
        raise ShardBad("pickle truncated or stack underflow") from None
    except KeyError as e:
        raise ShardBad(f"pickle refers to unknown memo {e.args[0]}") from None
    except (struct.error, ValueError) as e:  # short struct read, missing newline, bad UTF-8
        raise ShardBad(f"pickle malformed: {e}") from None


def _utf8(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ShardBad("pickle string is not UTF-8") from None


def _allowed_global(name: str, at: int) -> _Global:
    if name not in _ALLOWED_GLOBALS:
        raise ShardBad(f"pickle names {name!r} at byte {at}: not a tensor (refused, nothing executed)")
    return _Global(name)


def _storage_ref(pid: Any) -> StorageRef:
    if (
        not isinstance(pid, tuple)
        or len(pid) != 5
        or pid[0] != "storage"
        or not isinstance(pid[1], _Global)
        or not pid[1].name.startswith("torch.")
        or not isinstance(pid[2], str)
        or not isinstance(pid[3], str)
        or not _is_int(pid[4])
        or pid[4] < 0
    ):
        raise ShardBad("pickle persistent id is not a torch storage reference")
    return StorageRef(key=pid[2], dtype=STORAGE_DTYPES[pid[1].name[6:]], location=pid[3], numel=pid[4])


def _reduce(func: Any, args: Any, at: int) -> Any:
    if not isinstance(func, _Global) or not isinstance(args, tuple):
        raise ShardBad(f"pickle REDUCE at byte {at} on something that is not an allowed global")
    if func.name == _ORDERED_DICT:
        if args:
            raise ShardBad("pickle builds an OrderedDict with arguments")
        return {}
    if func.name == _REBUILD:
        if len(args) not in (6, 7):
            raise ShardBad("tensor rebuild with unexpected arguments")
        storage, offset, shape, stride, requires_grad, hooks = args[:6]
        if (
            not isinstance(storage, StorageRef)
            or not _is_int(offset)
            or not _int_tuple(shape)
            or not _int_tuple(stride)
            or len(shape) != len(stride)
            or not isinstance(requires_grad, bool)
            or not isinstance(hooks, dict)
            or hooks
            or (len(args) == 7 and args[6] not in (None, {}))
        ):
            raise ShardBad("tensor rebuild with malformed arguments")
        return TensorMeta(storage, offset, shape, stride)
    raise ShardBad(f"pickle REDUCE at byte {at} calls {func.name!r} (refused, nothing executed)")


def _setitem(target: Any, key: Any, value: Any) -> None:
    if not isinstance(target, dict) or not isinstance(key, str):
        raise ShardBad("pickle SETITEM on something that is not a dict with string keys")
    target[key] = value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_tuple(v: Any) -> bool:
    return isinstance(v, tuple) and len(v) <= 8 and all(_is_int(x) for x in v)
