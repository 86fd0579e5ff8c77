"""Expert weights on the block itself (issue 31 item 3): 3-D parameters a routing loop slices by its expert id.

Research and remote code keeps its experts as ``(E, ., .)`` parameters of the block (or of a child the block never
calls, beside other things of its own) and applies expert ``i`` inside its own routing loop::

    for i in range(E):
        tok, slot = torch.where(selected == i)
        h = F.silu(x[tok] @ self.w1[i]) @ self.w2[i]          # or self._expert(i, x[tok]), a method taking the id
        out.index_add_(0, tok, h * weights[tok, slot, None])

There is no expert call to move. What is proven here makes one: each *site* is an expression ``g(R, self.w1[i],
self.w2[i], ...)`` whose value is a function of one rows tensor ``R`` and expert ``i``'s weight slices alone, row by
row; under EP the site becomes one expert call of expert ``i`` on ``R`` (``autoep.runtime.recipes.block_weights``):
``R`` is evaluated where the token is, as the model evaluates it, and ``g`` runs on ``i``'s owner on the rows every
rank sent it, with the owner's slice of each weight.

What is proven, from the block's source (nothing is run):

- **where the weights are**: the block's own ``(E, ., .)`` parameters (E >= 2, one E), or those of one child the
  forward never calls and only subscripts (``self.experts.w1[i]``); the child's other parameters stay dense.
- **every read is a slice by the loop's id**: in the forward, every read of a weight is ``self.<w>[<id>]`` with
  ``<id>`` a name that an enclosing loop binds to its expert id (``for i in range(E)``, ``for i in ids.tolist()``),
  one id per site, or a read of its metadata (``self.w1.shape[0]``, ``.dtype``, ``.size()``: a ``Shard(0)`` DTensor
  answers them as the whole tensor). ``self.w1[i + 1]``, ``self.w1.mean(0)`` and ``self.w1[i].sum(0)`` are refused.
- **a site**: inline, the largest expression around the reads that the value domain below accepts, with exactly one
  rows expression ``R`` (a sub-expression without weights that is not a constant; the same text wherever it occurs,
  and then built of names, subscripts and attributes only, so evaluating it once is evaluating it each time) that
  reads a name the loop derived from its id: rows the id picks (``x @ self.w1[i]`` on every row is refused). Or a
  method call ``self.<m>(<id>, R)``, where ``<m>`` is a plain method of the class whose body is assignments to names
  and a return over the same domain, its first parameter the id and its second the rows.
- **row-local in R** (the value domain, ``autoep.detect.site_domain``): matmuls of rows by a 2-D weight, element-wise
  torch functions, arithmetic with numbers and 1-D slices, casts; names resolved to the objects they denote. The
  site's value must be rows (one output row per row of ``R``): that is what makes running it on the owner, on every
  rank's rows concatenated, exact.
- **nothing else reads the weights**: every function the forward, its hooks and its helpers reach is followed
  (``autoep.detect.expert_reads``): a read of a weight's name (or the child's) outside the sites, or of every
  parameter (``self.parameters()``), refuses.

``prove(block)`` returns a ``BlockWeightsProof`` (plain values: where each site is in the forward's source) or raises
``Refusal``; ``holder(block)`` says whether the block keeps its experts this way at all. The forward with its sites
made expert calls: ``autoep.detect.site_calls``.
"""
from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass

import torch.nn as nn

from autoep.detect import expert_reads
from autoep.detect.expert_roles import id_loops
from autoep.detect.site_domain import SiteDomain
from autoep.detect.source import Refusal, function_tree


@dataclass(frozen=True)
class Site:
    """One expert expression in the forward, by its position in the forward's source (``ast`` line and column
    offsets): ``inline`` (the expression itself; ``rows``: the text of its rows expression) or ``method`` (the
    call ``self.<method>(<id>, <rows>)``)."""

    kind: str  # inline | method
    position: tuple[int, int, int, int]  # lineno, col_offset, end_lineno, end_col_offset of the expression
    id_name: str  # the loop's id the weights are sliced by (inline), or the call's id argument
    rows: str  # the rows expression as written
    method: str = ""  # kind method: the method called


@dataclass(frozen=True)
class BlockWeightsProof:
    holder: str  # "" (the block itself) or the child holding the weights
    weights: tuple[str, ...]  # the (E, ., .) parameters' names under ``holder``
    num_experts: int
    sites: tuple[Site, ...]
    dense: tuple[str, ...] = ()  # the holder's other parameters (a child's: not experts, never sharded)

    def describe(self) -> str:
        where = f"self.{self.holder}." if self.holder else "self."
        return f"{len(self.sites)} expert expression(s) over {', '.join(where + w for w in self.weights)}"


# ---------------------------------------------------------------------------------------------
# Where the weights are
# ---------------------------------------------------------------------------------------------


def own_3d(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module._parameters.items() if p is not None and p.dim() == 3}


def holder(block: nn.Module) -> str | None:
    """``""`` where the block holds 3-D parameters of its own that its forward (or a method the forward calls)
    subscripts, the child's name where a child (not a container) holds them and is subscripted through
    (``self.experts.w1[...]``), else None. Reads the source only."""
    cls = type(block)
    try:
        tree = function_tree(cls.forward)
        trees = [tree] + [function_tree(getattr(cls, n.func.attr)) for n in ast.walk(tree) if isinstance(n, ast.Call)
                          and isinstance(n.func, ast.Attribute) and _is_self(n.func.value)
                          and inspect.isfunction(getattr(cls, n.func.attr, None))]
    except Exception:  # noqa: BLE001 - a source it cannot read: not this kind of block (the other proofs say why)
        return None
    own = own_3d(block)
    called = {n.func.attr for t in trees for n in ast.walk(t) if isinstance(n, ast.Call)
              and isinstance(n.func, ast.Attribute) and _is_self(n.func.value)}
    for node in (n for t in trees for n in ast.walk(t)):
        if not isinstance(node, ast.Subscript) or not isinstance(node.value, ast.Attribute):
            continue
        base, attr = node.value.value, node.value.attr
        if _is_self(base) and attr in own:
            return ""
        if isinstance(base, ast.Attribute) and _is_self(base.value):
            child = block._modules.get(base.attr)
            if child is not None and not isinstance(child, (nn.ModuleList, nn.ModuleDict)) and attr in own_3d(child) \
                    and base.attr not in called:  # an experts module the block calls is the batched proofs'
                return base.attr
    return None


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _weights(block: nn.Module, path: str) -> tuple[dict[str, int], int, tuple[str, ...]]:
    """``({name: dims of one expert's slice}, E, dense params)`` of the holder at ``path``."""
    module = block.get_submodule(path) if path else block
    own = own_3d(module)
    sizes = {p.shape[0] for p in own.values()}
    if len(sizes) != 1 or min(sizes) < 2:
        raise Refusal(f"the 3-D parameters on {'the block' if not path else 'self.' + path} "
                      f"({', '.join(f'{n} {tuple(p.shape)}' for n, p in own.items())}) do not share one leading "
                      "expert dim of 2 or more; which dim is the experts' would be a guess")
    dense = tuple(n for n, p in module._parameters.items() if p is not None and n not in own) if path else ()
    if path and any(True for _ in module.buffers()):
        raise Refusal(f"self.{path} holds buffers beside its expert weights; autoep shards only the weights and "
                      "would not know whose each buffer is")
    if path and any(any(True for _ in m.parameters()) for m in module.children()):
        raise Refusal(f"self.{path} has submodules holding parameters beside its expert weights; which expert they "
                      "belong to would be a guess")
    return {n: p.dim() - 1 for n, p in own.items()}, sizes.pop(), dense


# ---------------------------------------------------------------------------------------------
# The proof
# ---------------------------------------------------------------------------------------------


def prove(block: nn.Module) -> BlockWeightsProof:
    """Every site of the block's forward (module docstring), or ``Refusal`` naming the line and what fails."""
    path = holder(block)
    if path is None:
        raise Refusal("no 3-D expert parameters the forward slices by an expert id")
    weights, num_experts, dense = _weights(block, path)
    cls = type(block)
    forward = cls.forward
    if not inspect.isfunction(forward) or "forward" in vars(block) or getattr(forward, "__wrapped__", None):
        raise Refusal(f"{cls.__name__}.forward is not a plain function of the class (decorated, or set on the "
                      "instance); autoep recompiles the forward it proves")
    if forward.__code__.co_freevars:
        raise Refusal(f"{cls.__name__}.forward reads variables of an enclosing function "
                      f"({', '.join(forward.__code__.co_freevars)}); autoep recompiles it with its expert expressions "
                      "moved and proves only module-level names")
    tree = function_tree(forward)
    if len(tree.args.args) < 1 or tree.args.args[0].arg != "self":
        raise Refusal(f"{cls.__name__}.forward's first parameter is not `self`")
    scan = _Scan(block, cls, forward, tree, path, weights)
    sites = scan.sites()
    if not sites:
        raise Refusal("no expert expression reads the 3-D weights")
    allowed = [forward, *(getattr(cls, s.method) for s in sites if s.kind == "method")]
    for name in ([path] if path else list(weights)):
        expert_reads.experts_read_elsewhere(block, allowed, name)
    return BlockWeightsProof(path, tuple(weights), num_experts, tuple(sites), dense)


def facts(proof: BlockWeightsProof) -> dict:
    """The ``MoeStructure`` fields the proof decides."""
    return {"expert_storage": "block_weights", "experts_path": proof.holder, "expert_projs": proof.weights,
            "dense_params": proof.dense, "expert_kind": "row_local", "execution": "replay", "idle_experts": ("touch",)}


def _by_name(node: ast.AST, names: set[str]) -> bool:
    """``getattr(self, ...)`` (``setattr``, ``delattr``) of one of ``names``, or of a name computed at run time."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
            "getattr", "setattr", "delattr", "hasattr") and len(node.args) >= 2 and _is_self(node.args[0])):
        return False
    key = node.args[1]
    return not (isinstance(key, ast.Constant) and isinstance(key.value, str)) or key.value in names


def position(node: ast.AST) -> tuple[int, int, int, int]:
    return node.lineno, node.col_offset, node.end_lineno, node.end_col_offset


class _Scan:
    """The sites of one forward: every weight read found, climbed to its site, each checked."""

    def __init__(self, block, cls, fn, tree, path: str, weights: dict[str, int]):
        self.block, self.cls, self.fn, self.tree, self.path, self.weights = block, cls, fn, tree, path, weights
        self.parents = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        self.loops = id_loops(tree)

    def where(self, node: ast.AST) -> str:
        return f"{self.cls.__name__}.forward line {self.fn.__code__.co_firstlineno + node.lineno - 1}"

    def sites(self) -> list[Site]:
        sites, covered = [], set()
        for site, call in _method_sites(self):
            sites.append(site)
            covered |= {id(n) for n in ast.walk(call)}
        for node in ast.walk(self.tree):
            read = self._weight_attr(node)
            if read is not None and self._metadata(node):
                continue  # ``self.w1.shape[0]``: the global shape, as the model's (a DTensor's is)
            if read is not None and id(node) not in covered:
                site, top = self._site(node)
                sites.append(site)
                covered |= {id(n) for n in ast.walk(top)}
            elif self._holder_read(node) and id(node) not in covered:
                raise Refusal(f"{self.where(node)}: `{ast.unparse(self.parents.get(id(node), node))[:80]}` reads "
                              f"self.{self.path} other than by slicing its expert weights by the loop's id")
            elif _by_name(node, set(self.weights) | {self.path} - {""}):
                raise Refusal(f"{self.where(node)}: `{ast.unparse(node)[:80]}` reads an attribute of the block by "
                              "name; autoep proves reads of its expert weights as written (self.w1[i])")
        methods = [s.method for s in sites if s.kind == "method"]
        for node in ast.walk(self.tree):  # an expert method called anywhere else would read the weights unproven
            if isinstance(node, ast.Attribute) and _is_self(node.value) and node.attr in methods and not any(
                    position(self.parents[id(node)]) == s.position for s in sites if s.method == node.attr):
                raise Refusal(f"{self.where(node)}: self.{node.attr} is read other than as the expert call "
                              f"self.{node.attr}(<id>, <rows>)")
        return sites

    def _weight_attr(self, node: ast.AST) -> str | None:
        """The weight's name where ``node`` is ``self.<w>`` (``self.<holder>.<w>``)."""
        if not isinstance(node, ast.Attribute) or node.attr not in self.weights:
            return None
        if self.path:
            base = node.value
            return node.attr if isinstance(base, ast.Attribute) and base.attr == self.path and _is_self(base.value) \
                else None
        return node.attr if _is_self(node.value) else None

    def _metadata(self, node: ast.AST) -> bool:
        """``node`` (a weight) read for its metadata only: ``.shape``, ``.dtype``, ``.ndim``, ``.size(...)``,
        ``.dim()``, which a ``Shard(0)`` DTensor answers as the whole tensor does."""
        parent = self.parents.get(id(node))
        if not isinstance(parent, ast.Attribute) or parent.value is not node:
            return False
        if parent.attr in ("shape", "dtype", "ndim"):
            return True
        call = self.parents.get(id(parent))
        return parent.attr in ("size", "dim") and isinstance(call, ast.Call) and call.func is parent

    def _holder_read(self, node: ast.AST) -> bool:
        """``self.<holder>`` read other than for one of its attributes (``self.experts.act_fn``, a submodule called;
        its weights are the sites' own): the whole child handed on, every parameter of it, a method of it called
        (``self.experts.forward(x)`` would read its weights whole)."""
        if not self.path or not (isinstance(node, ast.Attribute) and node.attr == self.path and _is_self(node.value)):
            return False
        parent = self.parents.get(id(node))
        called = isinstance(self.parents.get(id(parent)), ast.Call) and self.parents[id(parent)].func is parent \
            and parent.attr not in self.block.get_submodule(self.path)._modules  # a method of it, not a submodule
        return called or not (isinstance(parent, ast.Attribute) and parent.attr not in expert_reads.WHOLE_MODULE_READS)

    def _site(self, read: ast.Attribute) -> tuple[Site, ast.AST]:
        sub = self.parents.get(id(read))
        shown = ast.unparse(sub if isinstance(sub, ast.Subscript) else read)
        if not isinstance(sub, ast.Subscript) or sub.value is not read or not isinstance(sub.slice, ast.Name):
            raise Refusal(f"{self.where(read)}: `{shown[:80]}` reads an expert weight other than sliced by a name "
                          "(self.w[i], i the routing loop's expert id)")
        loop = self._loop_of(sub, sub.slice.id)
        if loop is None:
            raise Refusal(f"{self.where(read)}: `{shown}` slices the weight by `{sub.slice.id}`, which no enclosing "
                          "loop binds to its expert id")
        top, rows = None, None
        node = sub
        while True:
            try:
                found = SiteDomain(self, sub.slice.id, inline=True).site(node)
            except Refusal:
                if top is None:
                    raise
                break
            if found is not None:
                top, rows = node, found
            parent = self.parents.get(id(node))
            if isinstance(parent, ast.keyword):
                parent = self.parents.get(id(parent))
            if not isinstance(parent, ast.expr):
                break
            node = parent
        if top is None:
            raise Refusal(f"{self.where(read)}: `{shown}` is read outside an expression that applies it to rows "
                          "the routing picked")
        self._rows_picked(rows, loop, top)
        return Site("inline", position(top), sub.slice.id, ast.unparse(rows)), top

    def _loop_of(self, node: ast.AST, name: str):
        enclosing = [loop for loop in self.loops if name in loop.ids and any(
            n is node for part in loop.body for n in ast.walk(part))]
        return enclosing[-1] if enclosing else None

    def _rows_picked(self, rows: ast.AST, loop, top: ast.AST) -> None:
        names = {n.id for n in ast.walk(rows) if isinstance(n, ast.Name)}
        if not names & loop.tainted:
            raise Refusal(f"{self.where(top)}: `{ast.unparse(top)[:80]}` applies the expert's weights to "
                          f"`{ast.unparse(rows)}`, which reads no name the loop derives from its expert id (rows the "
                          "routing picked for it); autoep moves an expert's routed rows, not every row")


def _method_sites(scan: _Scan) -> list[tuple[Site, ast.AST]]:
    """The calls ``self.<m>(<id>, <rows>)`` in the forward of methods that read the expert weights, each proven."""
    found = []
    for node in ast.walk(scan.tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_self(node.func.value)):
            continue
        fn = getattr(scan.cls, node.func.attr, None)
        if not inspect.isfunction(fn) or not _reads_weights(fn, scan):
            continue
        found.append(_method_site(scan, node, fn))
    return found


def _reads_weights(fn, scan: _Scan) -> bool:
    try:
        tree = function_tree(fn)
    except Refusal:
        return False
    return any(isinstance(n, ast.Attribute) and (n.attr in scan.weights or n.attr == scan.path) for n in ast.walk(tree))


def _method_site(scan: _Scan, call: ast.Call, fn) -> tuple[Site, ast.AST]:
    name = call.func.attr
    where = scan.where(call)
    if name in vars(scan.block) or fn.__code__.co_freevars or getattr(fn, "__wrapped__", None) is not None:
        raise Refusal(f"{where}: self.{name} reads the expert weights, and is decorated, set on the instance or "
                      "reads variables of an enclosing function; autoep proves plain methods")
    if call.keywords or len(call.args) != 2 or not isinstance(call.args[0], ast.Name):
        raise Refusal(f"{where}: `{ast.unparse(call)[:80]}` calls self.{name}, which reads the expert weights; autoep "
                      f"proves a call self.{name}(<expert id>, <rows>)")
    loop = scan._loop_of(call, call.args[0].id)
    if loop is None:
        raise Refusal(f"{where}: `{ast.unparse(call)[:80]}` passes `{call.args[0].id}`, which no enclosing loop binds "
                      "to its expert id")
    rows = call.args[1]
    if any(scan._weight_attr(n) for n in ast.walk(rows)):
        raise Refusal(f"{where}: the rows argument of `{ast.unparse(call)[:80]}` reads an expert weight")
    scan._rows_picked(rows, loop, call)
    tree = function_tree(fn)
    params = [a.arg for a in tree.args.args]
    a = tree.args
    if len(params) != 3 or a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or a.defaults:
        raise Refusal(f"{scan.cls.__name__}.{name} takes ({', '.join(params)}); autoep proves an expert method "
                      "(self, <expert id>, <rows>)")
    SiteDomain(scan, params[1], inline=False, rows_name=params[2], fn=fn).body(tree)
    return Site("method", position(call), call.args[0].id, ast.unparse(rows), name), call
