"""What the one-pass execution needs of a block with module experts (``autoep.runtime.recipes.replay``): no
proof of its loop at all, only of where its experts are and what they are.

The block's forward runs as written, once; only its calls into the experts travel, and what depends on their
outputs waits for the exchange (``autoep.runtime.recipes.deferred``: a value needed on the host before it
raises at run time, naming the line). Proven here, from source and attributes, never by running anything:

- the experts: the modules of one container the block's forward reads (``self.<name>`` in its forward or the
  methods it calls), a ``ModuleList``/``ModuleDict`` (a subclass with a forward of its own too), a child of the
  block or of a child module the block calls (``self.moe`` whose forward reads ``self.experts``), or a plain
  dict/list attribute of the block whose values are its registered children (``autoep.detect.plain_experts``:
  every entry an expert, none read by its name), found by data flow, not by the name ``experts``; one whose
  modules a loop chains (``x = layer(x)``: a stack of layers a model walks) is refused;
- several such containers, or a list the forward builds of the block's modules, told apart by role
  (``autoep.detect.expert_roles``, issue 31): the containers a routed loop indexes by its expert id are the
  experts, one expert across them where they are several (``lora_A[i]``, ``lora_B[i]``: aligned, the same entries
  and loops; those holding no tensor, ``lora_dropout[i]``, stay where the token is), recorded per expert in
  ``Experts.members`` (``MoeStructure.expert_members``); a container every row reaches (a shared list, per-adapter
  routers) stays where the token is; a list the forward builds (``[self.base_layer] + list(self.adapters)``) whose
  entries the routed loop calls is the experts, one module each, rather than the one container the forward reads
  (lists of several loops or values of a task counter: every module once, a shared expert each task routes one
  expert); numbered attributes reached by ``getattr(self, f"expert_{i}")`` are sources as containers are (their
  first member's path is ``path``); a misaligned use, or containers of no known role, is refused;
- which entries of the container are the experts: its leading entries, up to the first one the forward (or
  a method it calls, or the container's own forward) reads by name (``self.token_dropout``,
  ``self.experts.norm``, ``getattr(self, "norm")``): such a module is the block's own code, run where the
  token is, never sharded (NLLB-MoE keeps its token dropout in the experts' ModuleDict); an expert after a
  named entry is refused (which ids are experts would be a guess);
- each expert row-local, deterministic and stateless (``autoep.detect.row_local``, through
  ``module_list_proof.row_local_facts``): heterogeneous experts are fine, each runs its own forward;
- ``block.experts`` holds no parameter of its own (``apply_plan`` shards those as batched expert weights);
- the block's forward is its class's, undecorated, its ``__call__`` nn.Module's (the runtime calls the class
  forward inside one call of the block).

``find_experts(block)`` returns the ``Experts`` (``find_container(block)`` their path) or raises ``Refusal``;
``replay_facts(block, path)`` returns the ``MoeStructure`` facts or raises ``Refusal``; ``num_experts(block,
path)`` how many of the container's entries are experts; ``expert_labels(block, path)`` how the model names each
entry (``experts[2]``, ``expert_by_id[3]``) and the entries; ``leading_dims_pinned(block, path)`` which experts
may be called on ``(..., D)`` tensors (moved as their rows); ``is_plain(block, path)`` whether ``path`` is a plain
dict/list attribute.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

import torch.nn as nn

from autoep.detect import call_chain, expert_roles, module_list_proof, plain_experts, row_local
from autoep.detect.expert_reads import WHOLE_MODULE_READS
from autoep.detect.loop_context import plain_method, self_reads
from autoep.detect.source import Refusal, function_tree


def members(container: nn.Module) -> list[nn.Module]:
    """The entries of a container: a ModuleDict's values in insertion order, a ModuleList's in index order."""
    return list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)


def num_experts(block: nn.Module, path: str) -> int:
    """How many leading entries of the container at ``path`` are experts (module docstring): every entry up
    to the first one read by name. ``Refusal`` where an entry read by name comes before an expert, or the
    first entry is read by name. A plain dict/list attribute (``plain_experts``) holds experts only: every entry,
    ``Refusal`` where one is read by name."""
    if is_plain(block, path):
        return _plain_num_experts(block, plain_experts.holder(block, path))
    container = block.get_submodule(path)
    keys = module_list_proof.expert_keys(container)
    named = _named_entries(block, path, set(keys))
    n = next((i for i, key in enumerate(keys) if key in named), len(keys))
    cls = type(block).__name__
    if n == 0:
        raise Refusal(f"{cls}: the first entry of {path} ({keys[0]!r}) is read by name, not called as an expert")
    late = [key for key in keys[n:] if key not in named]
    if late:
        raise Refusal(f"{cls}: {path} holds {keys[n]!r}, which the forward reads by name (not an expert), before "
                      f"{late[0]!r}; which entries are experts would be a guess")
    return n


def is_plain(block: nn.Module, path: str) -> bool:
    """``path`` names a plain dict/list attribute of the block (``plain_experts``), not a submodule."""
    return "." not in path and path not in block._modules and path in plain_experts.candidates(block)


def _plain_num_experts(block: nn.Module, found: plain_experts.PlainExperts) -> int:
    """Every entry of a plain dict/list attribute is an expert: ``Refusal`` where the block's forward (or a method
    it calls) reads one by its registered name (``self.expert_3``, ``getattr(self, "expert_3")``) or by a string
    key (``self.expert_by_id["gate"]``): such a module is the block's own code (a gate, a norm) or an expert also
    used elsewhere, and replay would move each of its calls to one rank as an expert's."""
    strings = {k for k in found.keys or () if isinstance(k, str)}
    named = _named_entries(block, "", set(found.names))
    for _, tree, _ in module_list_proof.block_methods(block).values():
        named |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in strings}
    for i, (name, key) in enumerate(zip(found.names, found.keys or found.names)):
        if name in named or key in named:
            raise Refusal(f"{type(block).__name__}.{found.label(i)} (self.{name}) is read by name in the forward, not "
                          f"only called as an expert through {found.attr}; hold only the experts in {found.attr} (the "
                          "gate, a norm or a shared expert as attributes of their own)")
    return len(found.names)


def _named_entries(block: nn.Module, path: str, keys: set[str]) -> set[str]:
    """The container's keys read by name (an attribute ``.key`` or ``getattr(..., "key")``) in the forward of
    the block and of every module on ``path`` (the container's own forward included) and the methods they
    call. A key spelled as an attribute elsewhere counts too: reading too many as named can only refuse or
    keep an expert unsharded, never move a module that is no expert."""
    owners = [block] + [block.get_submodule(".".join(path.split(".")[:i + 1])) for i in range(path.count(".") + 1)
                        if path]
    named = set()
    for owner in owners:
        if owner is not block and type(owner).forward is nn.Module.forward:
            continue
        for _, tree, _ in module_list_proof.block_methods(owner).values():
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in keys:
                    named.add(node.attr)
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                      and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                      and node.args[1].value in keys):
                    named.add(node.args[1].value)
    return named


def _is_container(m) -> bool:
    return call_chain.is_container(m)


def _is_nested(m) -> bool:
    """A ``ModuleList`` of containers of modules (two-level routing: ``self.experts[g][j]``, group g's expert j)."""
    return isinstance(m, nn.ModuleList) and len(m) > 0 and all(_is_container(e) for e in m)


def _one_source(block: nn.Module, name: str) -> Experts:
    """The experts of one container: the container, or, for a container of containers, every leaf one expert, in
    order (``experts.0.0``, ``experts.0.1``, ``experts.1.0``: expert ids ``g * per_group + j``)."""
    container = block.get_submodule(name)
    if not _is_nested(container):
        return Experts(name)
    return Experts(name, tuple((f"{name}.{g}.{k}",) for g, group in enumerate(container)
                               for k in module_list_proof.expert_keys(group)))


def _reads(fns, attr: str) -> bool:
    return any(self_reads(function_tree(fn), attr) for fn in fns)


def _chained(fns, attr: str) -> ast.Assign | None:
    """A statement ``x = member(... x ...)`` in a loop over ``self.<attr>`` that does not bind ``x`` afresh
    before it: each member's input is the previous member's output (a stack of layers a model walks, not
    experts: sharding them would send every row through every rank, one exchange per layer)."""
    for fn in fns:
        for loop in ast.walk(function_tree(fn)):
            if not (isinstance(loop, ast.For) and self_reads(loop.iter, attr)):
                continue
            members = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
            bound: set[str] = set()
            for stmt in loop.body:
                if (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call)
                        and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id in members):
                    # Names the statement binds (``x = ...``), not names read in a subscript it assigns into
                    # (DeepSeek's ``y[flat == i] = expert(x[flat == i])`` writes rows, it chains nothing).
                    targets = {n.id for t in stmt.targets for n in ast.walk(t)
                               if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
                    args = {n.id for a in [*stmt.value.args, *stmt.value.keywords] for n in ast.walk(a)
                            if isinstance(n, ast.Name)}
                    if (targets & args) - bound:
                        return stmt
                bound |= {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return None


def find_container(block: nn.Module) -> str:
    """The path of the block's experts (``find_experts(block).path``), or ``Refusal`` naming what was seen."""
    return find_experts(block).path


@dataclass(frozen=True)
class Experts:
    """Where a block's experts are: one container at ``path`` (``members`` empty), or, per expert, the paths of its
    modules (``(("lora_A.0", "lora_B.0"), ...)``: aligned containers; ``(("base_layer",), ("adapters.0",), ...)``:
    a list the forward builds), ``path`` then the first one's container (``lora_A``, ``base_layer``)."""

    path: str
    members: tuple[tuple[str, ...], ...] = ()


def find_experts(block: nn.Module) -> Experts:
    """The block's experts (module docstring), or ``Refusal`` naming what was seen. Several containers the forward
    reads are told apart by role (``autoep.detect.expert_roles``): the routed ones, aligned, are the experts (one
    expert across them), the ones every row reaches stay where the token is; one container alone keeps its
    decision, unless the routed calls select from a list the forward builds and that container is not routed."""
    cls = type(block)
    forward_fns = [fn for fn, _, _ in module_list_proof.block_methods(block).values()]
    found = []
    for name, child in block._modules.items():
        if child is None or not _reads(forward_fns, name):
            continue
        if _is_nested(child):
            found.append(name)  # two-level routing: told apart by role, never taken without (``_by_role``)
            continue
        if _is_container(child):
            chained = _chained(forward_fns, name)
            if chained is not None:
                raise Refusal(f"{cls.__name__}.forward chains the modules of self.{name} (`{ast.unparse(chained)}`): "
                              "each one's input is the previous one's output, a stack of layers, not experts")
            found.append(name)
            continue
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) or type(child).forward is nn.Module.forward:
            continue
        found += call_chain.descend(block, name, child, find_experts, deep=False)  # ``moe.experts``
    call_chain.through_super(block, forward_fns, found)  # a container read in a parent's method only: refused
    # A plain dict/list of modules the forward reads, only where no registered container is: a block that was
    # taken for its ModuleList/ModuleDict keeps that decision (no detector outcome changes but refusals lifted).
    for name in plain_experts.candidates(block) if not found else ():
        if _reads(forward_fns, name):
            chained = _chained(forward_fns, name)
            if chained is not None:
                raise Refusal(f"{cls.__name__}.forward chains the modules of self.{name} (`{ast.unparse(chained)}`): "
                              "each one's input is the previous one's output, a stack of layers, not experts")
            found.append(name)
    # Wrappers down (``ffn.moe.experts``), only where nothing nearer is found: a block whose experts are nearer keeps
    # that decision (a container deeper under another child, an attention's, neither counts nor refuses it).
    for name, child in block._modules.items() if not found else ():
        if child is not None and not isinstance(child, (nn.ModuleList, nn.ModuleDict)) and _reads(forward_fns, name) \
                and type(child).forward is not nn.Module.forward:
            found += call_chain.descend(block, name, child, find_experts)
    plain = [name for name in found if is_plain(block, name)]
    if len(found) > 1 and (plain or any("." in name for name in found)):
        raise Refusal(f"{cls.__name__}.forward reads several module containers ({found}); which one holds the "
                      "experts is ambiguous")
    if plain:
        return Experts(found[0])
    return _by_role(block, forward_fns, found)


def _by_role(block: nn.Module, fns: list, found: list[str]) -> Experts:
    """The experts among the containers ``found`` (direct children, or one of a child), the numbered attributes the
    forward reaches by ``getattr`` and the lists the forward builds, by role (``expert_roles``)."""
    cls = type(block).__name__
    try:
        roles = expert_roles.roles(block, fns, [name for name in found if "." not in name])
    except Exception as exc:  # noqa: BLE001 - a Refusal, or a source the roles cannot follow
        numbered = any(expert_roles.family_ref(n) for fn in fns for n in ast.walk(function_tree(fn)))
        if len(found) == 1 and not numbered and not _is_nested(block.get_submodule(found[0])):
            return Experts(found[0])  # one container keeps its decision (only refusals lifted)
        if isinstance(exc, expert_roles.Misplaced):
            raise
        if not found or not isinstance(exc, Refusal):
            raise Refusal(f"{cls}: no ModuleList/ModuleDict (or plain dict/list) of expert modules that its forward "
                          "(or a module it calls) reads" if not found else f"{cls}.forward reads several module "
                          f"containers ({found}) and their roles could not be read ({type(exc).__name__}: {exc})"
                          ) from None
        raise
    iterated = [why for fn in fns for node in ast.walk(function_tree(fn)) if isinstance(node, (ast.For, ast.comprehension))
                for name in _iterated_names(node.iter) if name in roles.unread for why in [roles.unread[name]]]
    # a loop over a list of modules whose entries are not known, and no container to place: which modules the ids
    # select is a guess (one container keeps its decision: the one pass moves its entries' calls wherever they are)
    if iterated and not found:
        raise expert_roles.Misplaced(f"{cls}: a loop iterates a list of the block's modules that autoep does not "
                                     f"read: {iterated[0]}; build it by assignment, `extend`/`append` (also "
                                     "in a loop over range(...)) or iterate the container itself")
    lists = [source for source in roles.routed() if source.startswith("list:")]
    families = [source for source in roles.routed() if source.startswith("attr:")]
    routed = [name for name in found if roles.role.get(name) == expert_roles.ROUTED]
    routers = [name for name in found if roles.role.get(name) == expert_roles.ROUTER]
    if routers and not routed and not lists and not families:
        raise expert_roles.Misplaced(f"{cls}: the entries of self.{routers[0]} route (their outputs pick the rows of "
                                     "another loop's id), and no other module container holds experts the routing "
                                     "selects; autoep never shards a router")
    nested = [name for name in found if _is_nested(block.get_submodule(name))]
    if set(nested) & set(routed):  # two-level routing: ``self.experts[g][j]``, each leaf one expert
        if len(routed) != 1 or lists or families:
            raise expert_roles.Misplaced(f"{cls}: self.{routed[0]} holds containers of modules called as "
                                         f"self.{routed[0]}[g][j], beside other sources of routed calls "
                                         f"({[*routed, *lists, *families]}); autoep places the leaves of one")
        return _one_source(block, routed[0])
    if len(found) == 1 and not families and (routed or not lists):
        if nested:  # a container of containers no routed call reaches (its lists, when built, are read as lists)
            raise expert_roles.Misplaced(f"{cls}: self.{nested[0]} holds containers of modules, and no routed call "
                                         f"selects their entries (self.{nested[0]}[g][j], or a list built of them)")
        return Experts(found[0])
    if lists:
        if routed or families:
            raise expert_roles.Misplaced(f"{cls}: its routed calls select from "
                          f"{', '.join(_shown(s) for s in [*routed, *families, *lists])} "
                          f"({', '.join(roles.lines[s] for s in [*routed, *families, *lists])}); autoep places the "
                          "experts of lists the forward builds, or of containers aligned by the expert id, not both")
        return _built(block, {s[5:]: roles.lists[s] for s in lists})
    if not found and not families:
        raise Refusal(f"{cls}: no ModuleList/ModuleDict (or plain dict/list) of expert modules that its forward (or "
                      "a module it calls) reads")
    unknown = [name for name in found if name not in roles.role]
    if not (routed or families) or unknown and not families:
        unread = "".join(f"; {why}" for why in roles.unread.values())
        raise expert_roles.Misplaced(f"{cls}.forward reads several module containers ({found}); which one holds the experts is "
                      f"ambiguous (none called on rows a loop's expert id picks{'' if not unknown else ', or '}"
                      f"{'' if not unknown else f'{unknown} not called in the forward'}{unread})")
    order = {name: i for i, name in enumerate(block._modules)}  # one expert's modules in the block's order
    first = {name: roles.families[name][0] if name in roles.families else name for name in [*routed, *families]}
    return _aligned(block, sorted([*routed, *families], key=lambda name: order[first[name]]), roles)


def _iterated_names(it: ast.AST) -> list[str]:
    """The local names a loop's iterable iterates: ``xs``, ``enumerate(xs)``, ``zip(xs, ys)``, ``list(xs)``."""
    if isinstance(it, ast.Name):
        return [it.id]
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id in ("enumerate", "zip", "list",
                                                                                     "tuple", "reversed"):
        return [n for a in it.args for n in _iterated_names(a)]
    return []


def _shown(source: str) -> str:
    if source.startswith("attr:"):
        return f"self.{source[5:]}<id>"
    return f"the list {source[5:]}" if source.startswith("list:") else f"self.{source}"


def _entries(block: nn.Module, source: str, roles) -> tuple[tuple[str, ...], list[str], list[nn.Module]]:
    """A routed source's keys (a ModuleDict's, or the indices), its entries' paths and modules: a container child's,
    or a family of numbered attributes' (``attr:expert_``: ``expert_0``, ``expert_1``, ...)."""
    if source.startswith("attr:"):
        names = roles.families[source]
        return tuple(str(k) for k in range(len(names))), list(names), [block._modules[n] for n in names]
    keys = tuple(module_list_proof.expert_keys(block._modules[source]))
    return keys, [f"{source}.{k}" for k in keys], members(block._modules[source])


def _aligned(block: nn.Module, routed: list[str], roles) -> Experts:
    """Sources the routed loops index by one expert id: one expert across them (``lora_A[i]``, ``lora_B[i]``;
    ``getattr(self, f"lora_A{i}")``, ...), placed together. Of the same length and keys (a ModuleDict's, in order);
    sources whose entries hold no tensor (``lora_dropout[i]``: a Dropout, an Identity) have nothing to place and stay
    where the token is."""
    cls = type(block).__name__
    entries = {name: _entries(block, name, roles) for name in routed}
    kinds = {name: isinstance(block._modules.get(name), nn.ModuleDict) for name in routed}
    first = routed[0]
    for name in routed[1:]:
        if roles.loops[name] != roles.loops[first]:
            raise expert_roles.Misplaced(f"{cls}.forward reads several module containers by expert id in different loops "
                          f"({_shown(first)}: {sorted(roles.loops[first])}, "
                          f"{_shown(name)}: {sorted(roles.loops[name])}); "
                          "which one holds the experts is ambiguous (containers of one expert are called in one loop)")
        keys, first_keys = entries[name][0], entries[first][0]
        if roles.selectors.get(name) != roles.selectors.get(first):
            raise expert_roles.Misplaced(f"{cls}: {_shown(first)} and {_shown(name)} are indexed by the routing loops' "
                          f"ids differently ({sorted(roles.selectors.get(first, ()))}, "
                          f"{sorted(roles.selectors.get(name, ()))}); aligned containers are selected alike")
        if keys != first_keys or kinds[name] != kinds[first]:
            raise expert_roles.Misplaced(f"{cls}: {_shown(first)} and {_shown(name)} are both indexed by the expert id "
                          f"({roles.lines[first]}, {roles.lines[name]}) but hold different entries "
                          f"({len(first_keys)}: {list(first_keys)[:4]}, {len(keys)}: {list(keys)[:4]}); "
                          "aligned containers hold one entry per expert, in one order")
    placed = [name for name in routed if any(True for e in entries[name][2] for _ in (*e.parameters(), *e.buffers()))]
    numbered = [name for name in routed if name.startswith("attr:")]
    if numbered and not placed:
        raise expert_roles.Misplaced(f"{cls}: the experts the forward reaches by id ({_shown(numbered[0])}) hold no "
                                     "tensor")
    if len(placed) <= 1 and not set(placed) & set(numbered):
        return Experts(placed[0] if placed else first)
    paths = {name: entries[name][1] for name in placed}
    path = paths[placed[0]][0] if placed[0] in numbered else placed[0]  # numbered: no container to name
    return Experts(path, tuple(tuple(paths[name][k] for name in placed) for k in range(len(entries[first][0]))))


def _built(block: nn.Module, lists: dict[str, tuple[tuple[str, ...], ...]]) -> Experts:
    """Lists the forward builds of the block's modules (``[self.base_layer] + list(self.adapters)``; per task,
    ``task_experts[t]`` and the shared ones), one expert per module: every module an entry of some list in some
    variant, once, in order of first appearance (a shared expert that each task's loop reaches under another id is
    one expert on one owner: the one-pass execution moves each call of it there, whichever loop makes it). Refused
    where one module is at two entries of one list (two ids of one routing would select it), or an entry is a
    container."""
    cls = type(block).__name__
    union: dict[int, str] = {}
    for name, variants in lists.items():
        for paths in variants:
            modules = [block.get_submodule(p) for p in paths]
            for i, m in enumerate(modules):
                j = next(j for j, other in enumerate(modules) if other is m)
                if j != i:
                    raise expert_roles.Misplaced(f"{cls}.forward builds {name} with the module {paths[i]} at entries "
                                                 f"{j} and {i}; one module is one expert: give each entry its own module")
                if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
                    raise expert_roles.Misplaced(f"{cls}.forward builds {name} with the container {paths[i]} as an "
                                                 "entry")
                union.setdefault(id(m), paths[i])
    paths = list(union.values())
    return Experts(paths[0].split(".")[0], tuple((p,) for p in paths))


def replay_facts(block: nn.Module, path: str, draws_on_owner: bool = False) -> dict:
    """The facts a replay structure records: the experts at ``path`` proven row-local (``expert_kind``,
    ``folded``, ``expert_draws`` under ``draws_on_owner``), the block's forward fit to be run by the one-pass
    execution. ``Refusal`` otherwise."""
    cls = type(block)
    plain_method(cls, "forward", block)  # no instance forward, no decorator (the runtime calls the class forward)
    if cls.__call__ is not nn.Module.__call__:
        raise Refusal(f"{cls.__name__} overrides __call__")
    found = find_experts(block)
    if found.path != path:
        raise Refusal(f"{cls.__name__}: its experts are not at {path!r}")
    named = block._modules.get("experts")
    own = [n for n, _ in named.named_parameters(recurse=False)] if isinstance(named, nn.Module) else []
    if own:  # apply_plan splits the parameters of ``block.experts`` itself over the ep ranks (batched experts)
        raise Refusal(f"{cls.__name__}.experts holds a parameter of its own ({own[0]}), not in an expert module; "
                      "autoep would split it over the ep ranks as a batched expert weight")
    if is_plain(block, path):
        # Named as the block names them (``expert_3.dropout.p=0.0``): the attribute holds no state of its own.
        n = num_experts(block, path)  # ``Refusal`` naming an entry that is not a registered expert
        view, _ = plain_experts.resolve(block, path)
        _no_whole_module_reads(block, None)
        return module_list_proof.row_local_facts(view, path, members(view)[:n], folded_path="",
                                                 draws_on_owner=draws_on_owner)
    if found.members:
        return _member_facts(block, found.members, draws_on_owner)
    container = block.get_submodule(path)
    _no_whole_module_reads(block, container)
    return module_list_proof.row_local_facts(container, path, members(container)[:num_experts(block, path)],
                                             draws_on_owner=draws_on_owner)


def _member_facts(block: nn.Module, experts: tuple[tuple[str, ...], ...], draws_on_owner: bool = False) -> dict:
    """``replay_facts`` of experts whose modules are several (``Experts.members``): every module proven row-local
    on its own (the owner runs each called one on every rank's rows), no tensor in two of them, no entry of an
    aligned container read by name (it would be the block's own code, not an expert's), ``folded`` entries by
    each module's path (``expert_draws`` too, under ``draws_on_owner``); ``expert_members`` records them."""
    cls = type(block).__name__
    _no_whole_module_reads(block, None)
    for root in member_roots(experts):
        container = block.get_submodule(root)
        if isinstance(container, (nn.ModuleList, nn.ModuleDict)):
            keys = module_list_proof.expert_keys(container)
            named = _named_entries(block, root, set(keys))
            if named:
                raise Refusal(f"{cls}: the forward reads {root}.{sorted(named)[0]} by name; the entries of an "
                              f"expert container are the experts, called by the expert id only")
    if module_list_proof.global_hooks():
        raise Refusal("global module hooks are registered; under EP they would see other batches of rows")
    slots = [p for expert in experts for p in expert]
    owner: dict[int, str] = {}
    per_slot, per_slot_draws = [], []
    for slot in slots:
        module = block.get_submodule(slot)
        for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
            if owner.setdefault(id(t), slot) != slot:
                raise Refusal(f"{cls}.{slot}.{name} is the same tensor as one of {owner[id(t)]}: a tensor in two "
                              "expert modules would be placed, and get its gradient, on two ranks")
        proof = row_local.prove_expert(module, member_label(slot), draws_on_owner)
        per_slot.append(proof.folded)
        per_slot_draws.append(proof.draws)
    return dict(expert_kind="row_local", expert_projs=(), expert_act="", identity_experts=0,
                folded=module_list_proof.fold_entries("", per_slot, slots),
                expert_draws=module_list_proof.fold_entries("", per_slot_draws, slots), expert_members=experts)


def member_roots(experts: tuple[tuple[str, ...], ...]) -> list[str]:
    """The children of the block that hold the modules of ``experts`` (``lora_A``, ``lora_B``; ``base_layer``,
    ``adapters``), in order of first appearance."""
    return list(dict.fromkeys(p.split(".")[0] for expert in experts for p in expert))


def member_label(path: str) -> str:
    """How the model names a module of an expert: ``lora_A[2]``, ``adapters['x']``, ``base_layer``, ``expert_3``,
    ``task_experts[1][0]``, ``experts[1][0]``."""
    root, *keys = path.split(".")
    return root + "".join(f"[{key if key.isdigit() else repr(key)}]" for key in keys)


def leading_dims_pinned(block: nn.Module, path: str, draws_on_owner: bool = False,
                        experts: tuple[tuple[str, ...], ...] = ()) -> tuple[str, ...]:
    """Per expert at ``path`` (the proven ones, ``num_experts``): "" where ``expert(x)`` on ``(..., D)`` is its
    ``(prod(...), D)`` rows' output reshaped (``row_local.ExpertProof.leading_dims_free``), else the construct
    of its forward that reads a leading dim or the input's rank. ``Refusal`` where an expert is not row-local.
    ``experts``: ``Experts.members`` where the experts are several modules each: per module, in their order."""
    if experts:
        return tuple(row_local.prove_expert(block.get_submodule(p), member_label(p), draws_on_owner).pinned_by
                     for expert in experts for p in expert)
    labels, experts = expert_labels(block, path)
    return tuple(row_local.prove_expert(expert, label, draws_on_owner).pinned_by
                 for label, expert in zip(labels, experts[:num_experts(block, path)]))


def expert_labels(block: nn.Module, path: str) -> tuple[list[str], list[nn.Module]]:
    """How the model names each entry of the experts at ``path`` (``experts[2]``, ``experts['a']``,
    ``expert_by_id[3]``) and the entries, in expert-id order."""
    if is_plain(block, path):
        found = plain_experts.holder(block, path)
        return [found.label(i) for i in range(len(found.names))], [block._modules[n] for n in found.names]
    container = block.get_submodule(path)
    keys = module_list_proof.expert_keys(container)
    return [f"{path}[{k if k.isdigit() else repr(k)}]" for k in keys], members(container)


def _no_whole_module_reads(block: nn.Module, container: nn.Module | None) -> None:
    """Refuse a forward that reads every tensor of a module (``expert.parameters()``, ``self.state_dict()``,
    ...): under EP another rank's experts are stand-ins there, so such a read (minimind's ``0 * sum(p.sum() for p
    in expert.parameters())``) raises on the ranks that do not own the expert. Only calls of the experts move."""
    fns = [fn for fn, _, _ in module_list_proof.block_methods(block).values()]
    owner = block
    for part in container_path_parts(block, container) if container is not None else ():
        owner = owner._modules[part]
        if type(owner).forward is not nn.Module.forward and not type(owner).__module__.startswith("torch.nn"):
            fns.append(type(owner).forward)
    for fn in fns:
        for node in ast.walk(function_tree(fn)):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name in WHOLE_MODULE_READS:
                raise Refusal(f"{type(block).__name__}: {getattr(fn, '__qualname__', fn)} line "
                              f"{getattr(node, 'lineno', '?')} reads .{name} of a module; the one-pass execution "
                              "moves only the calls of the experts, and other ranks' experts are stand-ins there")


def container_path_parts(block: nn.Module, container: nn.Module) -> list[str]:
    """The attribute names from the block down to ``container`` (``["moe", "experts"]``)."""
    for name, module in block.named_modules():
        if module is container:
            return name.split(".") if name else []
    return []
