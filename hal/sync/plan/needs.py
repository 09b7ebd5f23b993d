"""What one engine worker needs of each checkpoint tensor, and where it lands: `WorkerNeeds`.

Recorded inside the worker from the engine's own weight loaders (for vLLM:
hal.integrations.vllm.recording), never from a table of models:

- a `Target` is one loadable tensor of one layer of the worker (a parameter or buffer in
  the checkpoint layout of the worker's shard: `qkv_proj.weight` with its q, k and v rows);
- a `Need` is one box of one checkpoint tensor (offsets and sizes per dimension: rows of
  `q_proj`, columns of `o_proj`, one expert, the whole norm) and the strided region of one
  target it lands in: element `i` of the box (an index per checkpoint dimension, from the
  box's corner) lands at `dst_offset + sum(i[d] * dst_strides[d])` of the target;
- a `Fill` is a region of a target a loader sets to a constant (vLLM zeroes the rows of a
  vocabulary padded to a multiple of 64).

`coverage_problems` checks that the record can rebuild every layer it touches: each
element of each target of such a layer written exactly once, by a need or a fill, but for
the padding a target's creator declared (`Target.padding`: zeroed at landing). The record
travels as JSON of int arrays (`encode_needs` / `decode_needs`, never pickled) and is
agreed by its `digest`. Pure data: no engine, nothing per sync.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

import torch

from hal.sync import errors
from hal.sync.spec import TensorSpec
from hal.sync.wire.header_json import dtype_from_name, dtype_name

FORMAT = 1  # of the encoding; a worker of another format is refused by name
View = tuple[int, tuple[int, ...], tuple[int, ...]]  # (storage offset, shape, strides) in elements


class UnexpressibleLoad(errors.SpecMismatchError):
    """A loader does something a shard receive cannot express (computes from a checkpoint
    tensor, copies a region that is no box, leaves a hole): the message names the parameter,
    the loader, the op and the checkpoint tensor. Such an engine receives whole tensors."""


@dataclass(frozen=True, slots=True)
class Target:
    """A loadable tensor of the worker: `name` of the module `layer`, of `shape`
    (contiguous, in the checkpoint layout of the worker's shard)."""

    layer: str
    name: str
    shape: tuple[int, ...]
    padding: int = 0
    """Elements its creator declared as padding, which no loader writes: a landing zeroes
    the target before anything lands in it (vLLM's `weight_loader_numel`)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        return f"{self.layer}.{self.name}" if self.layer else self.name


@dataclass(frozen=True, slots=True)
class Need:
    """A box of checkpoint tensor `tensor` (an index into `WorkerNeeds.specs`) landing in
    target `target`: box element `i` goes to `dst_offset + sum(i[d] * dst_strides[d])`."""

    tensor: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    target: int
    dst_offset: int
    dst_strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def destination(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> View:
        """Where the sub-box at `offsets` (in the checkpoint tensor) of `sizes` lands in the
        target: `target.as_strided(shape, strides, offset)` takes it as it is (checkpoint order)."""
        shift = sum((o - b) * s for o, b, s in zip(offsets, self.offsets, self.dst_strides))
        return self.dst_offset + shift, tuple(sizes), self.dst_strides


@dataclass(frozen=True, slots=True)
class Fill:
    """The region `target.as_strided(shape, stride, offset)` set to `value` by a loader."""

    target: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    value: float


@dataclass(frozen=True, slots=True)
class WorkerNeeds:
    """Everything one worker needs, recorded against the checkpoint `specs` (wire dtypes)."""

    worker: int
    specs: tuple[TensorSpec, ...]
    targets: tuple[Target, ...]
    needs: tuple[Need, ...]  # in checkpoint order, then destination order
    fills: tuple[Fill, ...] = ()
    _digest: list[int] = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def digest(self) -> int:
        """Of the encoded record; computed once, when first asked."""
        if not self._digest:
            self._digest.append(needs_digest(encode_needs(self)))
        return self._digest[0]

    @property
    def nbytes(self) -> int:
        """The bytes this worker receives: every need at its tensor's wire dtype."""
        return sum(n.numel * self.specs[n.tensor].dtype.itemsize for n in self.needs)

    def unused(self) -> tuple[str, ...]:
        """Checkpoint tensors no loader of this worker consumed (vLLM ignores rotary caches,
        a tied `lm_head`; another expert-parallel rank's experts)."""
        used = {n.tensor for n in self.needs}
        return tuple(s.name for i, s in enumerate(self.specs) if i not in used)


# ---- geometry -----------------------------------------------------------------------------
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))


def view_to_box(shape: tuple[int, ...], view: View) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, ...], ...]] | None:
    """The box a strided view of a contiguous tensor of `shape` covers: (offsets, sizes, and
    per view dimension the tensor's dimensions it walks, outer first), or None when the
    view is not one box (a step, a broadcast, a reshape that wraps around a row).

    A view dimension walks one dimension of the tensor (a narrow, a transpose), or several
    trailing ones whole (a reshape of a contiguous block); a dimension of size 1 walks none."""
    offset, vshape, vstride = view
    if not shape:
        return ((), (), tuple(() for _ in vshape)) if offset == 0 and all(n == 1 for n in vshape) else None
    strides = contiguous_strides(shape)
    start, rest = [], offset
    for st in strides:
        q, rest = divmod(rest, st) if st else (0, rest)
        start.append(q)
    if any(s >= d for s, d in zip(start, shape)) and math.prod(vshape):
        return None
    size = [1] * len(shape)
    walked = [False] * len(shape)
    walks: list[tuple[int, ...]] = []
    for n, st in zip(vshape, vstride):
        if n == 1:
            walks.append(())
            continue
        if n == 0:
            return None  # an empty view copies nothing: no box to name
        hits = [d for d in range(len(shape)) if strides[d] == st and shape[d] > 1]
        if not hits:
            return None
        d, dims = hits[0], []
        while True:
            if walked[d]:
                return None
            walked[d] = True
            dims.append(d)
            if start[d] + n <= shape[d]:
                size[d] = n
                break
            if start[d] != 0 or n % shape[d]:
                return None
            size[d], n = shape[d], n // shape[d]
            d -= 1
            while d >= 0 and shape[d] == 1:
                d -= 1
            if d < 0:
                return None
        walks.append(tuple(reversed(dims)))
    return tuple(start), tuple(size), tuple(walks)


def need_of_copy(tensor: int, spec: TensorSpec, src: View, target: int, dst: View) -> Need | str:
    """The `Need` of one recorded copy (`dst.copy_(src)`: `src` a view of checkpoint tensor
    `spec`, `dst` a view of the target, same number of elements), or what it copies that no
    need can say (a phrase: "the region at ..., which is not one box")."""
    box = view_to_box(spec.shape, src)
    if box is None:
        return f"{_view_text(src)}, which is not one box"
    offsets, sizes, walks = box
    src_shape, dst_shape = _squeeze_leading(src[1]), _squeeze_leading(dst[1])
    walks = walks[len(src[1]) - len(src_shape) :]
    dst_stride = dst[2][len(dst[1]) - len(dst_shape) :]
    if src_shape != dst_shape:
        return f"{list(src[1])} elements into a region of {list(dst[1])} (a broadcast)"
    dst_strides = [0] * len(spec.shape)
    for walk, step in zip(walks, dst_stride):
        for d in reversed(walk):  # the innermost dimension steps by the view's stride
            dst_strides[d] = step
            step *= sizes[d]
    return Need(tensor, offsets, sizes, target, dst[0], tuple(dst_strides))


def _squeeze_leading(shape: tuple[int, ...]) -> tuple[int, ...]:
    i = 0
    while i < len(shape) and shape[i] == 1:
        i += 1
    return tuple(shape[i:])


def _view_text(view: View) -> str:
    return f"the region at offset {view[0]} of shape {list(view[1])} and strides {list(view[2])}"


def box_text(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> str:
    """'rows 0..64, columns 32..64' / 'the whole tensor'-like words for a box."""
    if not offsets:
        return "the scalar"
    words = ["rows", "columns"] if len(offsets) == 2 else [f"dim {d}" for d in range(len(offsets))]
    if len(offsets) == 1:
        words = ["elements"]
    if len(offsets) == 3:
        words = ["dim 0", "rows", "columns"]
    return ", ".join(f"{w} {o}..{o + n}" for w, o, n in zip(words, offsets, sizes))


# ---- coverage -----------------------------------------------------------------------------
GRID_LIMIT = 1 << 22  # cells of one target's grid of box edges; beyond it the check refuses


def coverage_problems(needs: WorkerNeeds) -> list[str]:
    """Why the record cannot rebuild each layer it touches, one line per target (empty
    when it can): in a touched layer every element of every target is written exactly once
    by needs and fills, but for the target's declared padding."""
    boxes: dict[int, list[tuple[tuple[int, ...], tuple[int, ...], str]]] = {t: [] for t in range(len(needs.targets))}
    problems: list[str] = []

    def place(target_index: int, view: tuple[int, tuple[int, ...], tuple[int, ...]], what: str, region: str) -> None:
        target = needs.targets[target_index]
        box = view_to_box(target.shape, view)
        if box is None or not _inside(target.shape, box[0], box[1]):
            problems.append(f"parameter {target.describe()!r}: {region} that is not a box of {target.shape}")
        else:
            boxes[target_index].append((box[0], box[1], what))

    for need in needs.needs:
        name = needs.specs[need.tensor].name
        place(need.target, (need.dst_offset, need.sizes, need.dst_strides), f"checkpoint tensor {name!r}", f"checkpoint tensor {name!r} lands in a region")
    for fill in needs.fills:
        place(fill.target, (fill.offset, fill.shape, fill.stride), f"a fill with {fill.value:g}", "a loader fills a region")
    touched = {needs.targets[t].layer for t, b in boxes.items() if b}
    for index, target in enumerate(needs.targets):
        if target.layer in touched:
            problem = _tiling(target, boxes[index])
            if problem is not None:
                problems.append(f"parameter {target.describe()!r}: {problem}")
    return problems


def _inside(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
    return all(0 <= o and o + n <= d for o, n, d in zip(offsets, sizes, shape))


def _tiling(target: Target, boxes: list[tuple[tuple[int, ...], tuple[int, ...], str]]) -> str | None:
    """Counts writes per cell of the grid the boxes' edges cut the target into (a
    difference array, summed along each dimension): overlaps and holes, exactly."""
    shape = target.shape or (1,)  # a 0-d target: one element
    boxes = [(o or (0,), s or (1,), what) for o, s, what in boxes if math.prod(s)]
    if not boxes:
        return None if target.numel <= target.padding else f"{target.numel} of {target.numel} elements are written by no loader"
    if len(boxes) == 1 and boxes[0][1] == shape:
        return None  # the common case, one box of the whole target (a norm, a TP=1 weight): nothing to count
    if all(b[1][1:] == shape[1:] for b in boxes):  # row blocks (q, k, v into qkv; an expert's gate and up): intervals
        at, holes, first_hole = 0, 0, None
        for lo, hi, what in sorted((b[0][0], b[0][0] + b[1][0], b[2]) for b in boxes):
            if lo < at:
                by = [w for o, s, w in boxes if o[0] < at and lo < o[0] + s[0]]
                return f"{box_text((lo,) + (0,) * (len(shape) - 1), (min(at, hi) - lo,) + shape[1:])} are written twice (by {' and '.join(by[:2])})"
            if lo > at:
                holes, first_hole = holes + (lo - at), first_hole or (at, lo)
            at = hi
        if at < shape[0]:
            holes, first_hole = holes + (shape[0] - at), first_hole or (at, shape[0])
        row = math.prod(shape[1:])
        if holes * row > target.padding:
            where = box_text((first_hole[0],) + (0,) * (len(shape) - 1), (first_hole[1] - first_hole[0],) + shape[1:])
            return f"{holes * row} of {target.numel} elements are written by no loader ({where} among them)"
        return None
    n = len(shape)
    lo = torch.tensor([b[0] for b in boxes], dtype=torch.int64)
    hi = lo + torch.tensor([b[1] for b in boxes], dtype=torch.int64)
    edges = [torch.unique(torch.cat([lo[:, d], hi[:, d], torch.tensor([0, shape[d]])])) for d in range(n)]
    cells = [len(e) - 1 for e in edges]
    if math.prod(cells) > GRID_LIMIT:
        return f"{len(boxes)} regions cut it into more than {GRID_LIMIT} cells: too many to check"
    li = torch.stack([torch.searchsorted(edges[d], lo[:, d].contiguous()) for d in range(n)], 1)
    hj = torch.stack([torch.searchsorted(edges[d], hi[:, d].contiguous()) for d in range(n)], 1)
    diff = torch.zeros([c + 1 for c in cells], dtype=torch.int64)
    for corner in range(1 << n):  # inclusion-exclusion over the box's 2^n corners
        pick = [(corner >> d) & 1 for d in range(n)]
        index = tuple(hj[:, d] if pick[d] else li[:, d] for d in range(n))
        diff.index_put_(index, torch.full((len(boxes),), -1 if sum(pick) % 2 else 1, dtype=torch.int64), accumulate=True)
    for d in range(n):
        diff = diff.cumsum(d)
    count = diff[tuple(slice(0, c) for c in cells)]
    volume = torch.ones(cells, dtype=torch.int64)
    for d in range(n):
        widths = (edges[d][1:] - edges[d][:-1]).reshape([-1 if e == d else 1 for e in range(n)])
        volume = volume * widths
    if bool((count > 1).any()):
        cell = [int(i) for i in (count > 1).nonzero()[0]]
        at = tuple(int(edges[d][cell[d]]) for d in range(n))
        size = tuple(int(edges[d][cell[d] + 1]) - a for d, a in enumerate(at))
        by = [what for o, s, what in boxes if _covers(o, s, at)]
        return f"{box_text(at, size)} are written twice (by {' and '.join(by[:2])})"
    holes = int(volume[count == 0].sum())
    if holes > target.padding:
        cell = [int(i) for i in (count == 0).nonzero()[0]]
        at = tuple(int(edges[d][cell[d]]) for d in range(n))
        size = tuple(int(edges[d][cell[d] + 1]) - a for d, a in enumerate(at))
        return f"{holes} of {target.numel} elements are written by no loader ({box_text(at, size)} among them)"
    return None


def _covers(offsets: tuple[int, ...], sizes: tuple[int, ...], at: tuple[int, ...]) -> bool:
    return all(o <= a < o + s for o, s, a in zip(offsets, sizes, at))


# ---- the record as it travels ------------------------------------------------------------
def encode_needs(needs: WorkerNeeds) -> bytes:
    """JSON of names and int arrays: specs once, targets once, needs and fills as rows of ints."""
    rest = {
        "targets": [[t.layer, t.name, list(t.shape), t.padding] for t in needs.targets],
        "needs": [[n.tensor, n.target, n.dst_offset, *n.offsets, *n.sizes, *n.dst_strides] for n in needs.needs],
        "fills": [[f.target, f.offset, len(f.shape), *f.shape, *f.stride] for f in needs.fills],
        "values": [f.value for f in needs.fills],
    }
    head = json.dumps({"format": FORMAT, "worker": needs.worker}, separators=(",", ":"))[:-1]
    return f'{head},"specs":{_specs_json(needs.specs)},{json.dumps(rest, separators=(",", ":"))[1:]}'.encode()


_SPECS_JSON: dict[int, tuple[tuple[TensorSpec, ...], str]] = {}


def _specs_json(specs: tuple[TensorSpec, ...]) -> str:
    """The specs' rows as JSON, kept for the last few spec lists: every worker of an engine
    records against the same checkpoint (91k rows for DeepSeek-V3), encoded once."""
    kept = _SPECS_JSON.get(id(specs))
    if kept is not None and kept[0] is specs:
        return kept[1]
    text = json.dumps([[s.name, list(s.shape), dtype_name(s.dtype)] for s in specs], separators=(",", ":"))
    if len(_SPECS_JSON) >= 4:
        _SPECS_JSON.pop(next(iter(_SPECS_JSON)))
    _SPECS_JSON[id(specs)] = (specs, text)
    return text


def decode_needs(payload: bytes, known: tuple[TensorSpec, ...] | None = None) -> WorkerNeeds:
    """A worker's record from its JSON (never pickled); `HeaderError` naming what is wrong.
    `known`: specs already decoded (another worker's), taken instead of equal ones."""
    worker: object = "?"
    try:
        data = json.loads(payload)
        worker = data["worker"]
        if data["format"] != FORMAT:
            raise ValueError(f"format {data['format']!r}, this hal reads {FORMAT}")
        specs = tuple(TensorSpec(str(n), tuple(int(d) for d in shape), dtype_from_name(dt)) for n, shape, dt in data["specs"])
        specs = known if known is not None and known == specs else specs
        targets = tuple(Target(str(l), str(n), tuple(int(d) for d in shape), int(p)) for l, n, shape, p in data["targets"])
        out = []
        for row in data["needs"]:
            tensor, target, offset, *rest = (int(x) for x in row)
            dims = len(specs[tensor].shape)
            if len(rest) != 3 * dims or not 0 <= target < len(targets):
                raise ValueError(f"need {row!r} does not fit tensor {specs[tensor].name!r} or the {len(targets)} targets")
            out.append(Need(tensor, tuple(rest[:dims]), tuple(rest[dims : 2 * dims]), target, offset, tuple(rest[2 * dims :])))
        fills = []
        for row, value in zip(data["fills"], data["values"], strict=True):
            target, offset, dims, *rest = (int(x) for x in row)
            if len(rest) != 2 * dims or not 0 <= target < len(targets):
                raise ValueError(f"fill {row!r} is malformed")
            fills.append(Fill(target, offset, tuple(rest[:dims]), tuple(rest[dims:]), float(value)))
        return WorkerNeeds(int(worker), specs, targets, tuple(out), tuple(fills))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise errors.HeaderError(f"engine worker {worker}'s record of its needs is unreadable: {exc}") from None


def needs_digest(encoded: bytes) -> int:
    """A non-negative 63-bit digest of an encoded record (as `declared_digest`)."""
    return int.from_bytes(hashlib.sha256(encoded).digest()[:8], "little") >> 1
