"""Recognise what kind of MoE block a module is by reading its source, never by running it.

``detect_moe_structure(module)`` returns a ``MoeStructure`` or raises ``UnsupportedModuleStructure``.
Rules: never call a forward, never allocate, never read a model's or class's name; refuse rather
than guess. Source parsing and proofs are cached per class.
"""
from __future__ import annotations

import ast
import inspect
from dataclasses import asdict, dataclass

import torch.nn as nn

from autoep.detect import (
    block_weights,
    elementwise,
    equal_groups_proof,
    expert_reads,
    expert_roles,
    experts_proof,
    genuine,
    grouped_proof,
    module_list_proof,
    replay_proof,
    routing_proof,
    sharing,
    source,
)
from autoep.detect.source import Refusal
from autoep.errors import UnsupportedModuleStructure

# 3: expert_projs is a list of names (was one comma-joined string); 4: experts_path, expert_kind; 5: idle_experts,
# execution; 6: record/exchange/replay (now the one pass) is the automatic fallback for module experts (blocks refused before may be
# accepted with execution=replay); 7: no container-loop, selected-loop or masked-sum splice (experts containers with a
# forward of their own, the 4.57 Switch selected-rows loop and VitPose's masked sum run by record/exchange/replay;
# idle_experts "selected" is gone); 8: expert_members (experts by role: several aligned containers, or a list the
# forward builds, one expert's modules together; replay only); 9: experts not in one container (numbered attributes,
# lists built with extend/slices, per-task lists: expert_members), a slice of a container lists only its experts;
# 10: expert_storage block_weights (3-D weights on the block, or on a child it never calls, that its own routing
# loop slices by the expert id: refused before)
# 11: experts found where they sit (wrappers down, per-row extras, two-level routing: per-group routers are no
# longer taken for the experts), experts slicing their own weights
DETECTOR_VERSION = "11"

ROUTER_KINDS = ("softmax_topk", "sigmoid_group", "topk_router_module", "other")
SHARED_KINDS = ("none", "gated", "additive")
STORAGE_KINDS = ("module_list", "batched_parameters", "grouped", "equal_groups", "block_weights")
EXPERT_KINDS = ("swiglu", "row_local")
EXECUTIONS = ("spliced", "grouped", "replay")


@dataclass(frozen=True)
class MoeStructure:
    """What a recipe needs to know about an MoE block, every field proven from source and attributes."""

    router: str  # softmax_topk | sigmoid_group | topk_router_module | other (vocabulary: routing runs as written)
    shared_experts: str  # none | gated | additive (vocabulary: the shared branch always runs as written)
    expert_storage: str  # module_list | batched_parameters | grouped (experts(x_sorted, num_tokens_per_expert))
    # | equal_groups (experts(rows): E equal groups of rows, row block e for expert e) | block_weights (3-D weights
    # on the block, or on a child it never calls, sliced by the block's own routing loop: ``autoep.detect.
    # block_weights``; experts_path the holder, "" for the block, expert_projs the weights' names; execution replay)
    jitter: bool  # the block has ``jitter_noise`` (vocabulary: jitter always runs as written)
    # Expert layout facts (batched_parameters; module_list experts are stacked to the default layout).
    expert_bias: bool = False  # gate_up_proj_bias / down_proj_bias are added
    expert_transposed: bool = False  # weights stored (E, in, out) and applied as x @ w
    # concatenated [gate | up] | interleaved [g0, u0, g1, u1, ...] | separate (grouped, and batched flattened
    # experts: two gate, up weights)
    gate_up_layout: str = "concatenated"
    # glu: the experts' forward computes act_fn(gate) * up itself | clamped_glu, own_gate: it calls its
    # own proven-row-local ``_apply_gate`` (with a clamp / without), which the recipe then calls |
    # plain: no gate half, down(act_fn(up(x))) with an ``up_proj`` (gate_up_layout "none").
    activation: str = "glu"
    # module_list experts: attribute names of the gate, up and down projections (e.g.
    # ("gate_proj", "up_proj", "down_proj") or ("w1", "w3", "w2")), and the activation: "act_fn" = the expert's
    # own ``act_fn`` module, else the name of the torch function written in its forward (e.g. "silu").
    # grouped experts: the weights by path under ``experts`` (gate, up, down or gate_up, down), e.g.
    # ("fc1.weight", "fc2.weight"). batched experts with flattened (E*F, D) weights on a submodule (DBRX):
    # gate, up, down by path, e.g. ("mlp.w1", "mlp.v1", "mlp.w2") (gate, up applied as x @ w[e].T, down as h @ w[e]), and expert_act the path of
    # their activation module ("mlp.activation_fn").
    expert_projs: tuple[str, ...] = ()
    expert_act: str = ""
    # param: the experts compute in their weights' dtype | float32: their forward upcasts the routed rows
    # and every expert weight to float32 (the recipe does the same).
    expert_dtype: str = "param"
    # module_list: trailing ``nn.Identity`` experts (zero-compute experts, LongCat-Flash): ids past the
    # computing experts add ``w * x`` where the token is; they are not sharded.
    identity_experts: int = 0
    # batched experts: the attribute name of their submodule applied to each expert's output rows after the
    # down projection and before the routing weight (a post-expert norm, proven row-local: ``autoep.detect.row_norm``;
    # its parameters stay dense), "" for none. The recipe calls that module on the rows it computes.
    post_expert_norm: str = ""
    # grouped experts: parameters registered directly on the experts that are not expert weights, by name (a
    # per-feature scale of their own their forward multiplies its output by, ``out * self.gamma``): replicated,
    # never sharded (``apply_plan`` leaves them dense; their gradients are summed over ranks as dense ones are).
    dense_params: tuple[str, ...] = ()
    # The attribute path of the experts (the ModuleList/ModuleDict the proven region indexes by expert id, or the
    # module holding the 3-D expert parameters) inside the block, found by data flow. Runtime code reaches the
    # experts only through ``autoep.runtime.recipes.experts_of(block, structure)``.
    experts_path: str = "experts"
    # swiglu: every expert is proven the bias-free SwiGLU the grouped-GEMM fast path computes (expert_projs,
    # expert_act filled) | row_local: proven row-local, deterministic and stateless only (``autoep.detect.row_local``);
    # only the experts' own forward may run it (expert_projs=(), expert_act="").
    expert_kind: str = "swiglu"
    # row_local experts: the constant instance attributes their proof read (branches folded, numbers computed
    # with), ``<experts_path>.<e or *>.<attr>=<repr>``; the block's flags its experts call runs under
    # (``if self.<flag>:``, folded True), ``<flag>=True``; a change after detection is drift (``folded_drift``).
    folded: tuple[str, ...] = ()
    # What the expert region does with an expert that no row reaches, one entry per region (module_list blocks
    # may have several, e.g. a training and an inference loop; one for the others): "call" (runs it on zero
    # rows: zero gradients), "skip" (never calls it: its parameters keep ``grad is None``), "touch" (zero
    # gradients without a call), "touch_training" (touch only while training). The runtime follows it exactly
    # (``autoep.runtime.dispatch.Idle``).
    idle_experts: tuple[str, ...] = ()
    # How the expert work runs under EP: spliced (module experts: the block's proven loop replaced by the
    # exchange) | grouped (batched/grouped experts: their forward replaced by the
    # exchange + grouped compute) | replay (module experts whose loop is not proven: the block's forward runs
    # once, its expert outputs deferred to the exchange, ``autoep.runtime.recipes.replay``; the fallback).
    execution: str = "spliced"
    # row_local experts under ``PlanEntry.expert_draws=on_owner``: their random draws (an element-wise dropout with
    # p > 0), ``<experts_path>.<e or *>.<where>=<what>``, each made on the expert's owner rank: equal in
    # distribution to the model's, not bit-equal. Empty without the opt-in, and with it where nothing draws
    # (p=0: the same structure, the same results).
    expert_draws: tuple[str, ...] = ()
    # replay only, where one expert is several modules (issue 31, ``autoep.detect.expert_roles``): per expert, the
    # paths of its modules in the block, placed together on its owner (``(("lora_A.0", "lora_B.0"), ...)``: containers
    # the routed loop indexes by one expert id; ``(("base_layer",), ("adapters.0",), ...)``: a list the forward
    # builds); experts_path is then the first one's container. () where the experts are the entries of
    # experts_path.
    expert_members: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self):
        # A resolved config gives the names back as a list (YAML has no tuples): held as a tuple, so two
        # structures compare and hash by value.
        if isinstance(self.expert_projs, str):
            raise ValueError(f"expert_projs={self.expert_projs!r} is one comma-joined string, as detector version 2 "
                             f"wrote it; it is a list of names now: regenerate the resolved config with autoep-plan")
        for name in ("expert_projs", "folded", "idle_experts", "expert_draws", "dense_params"):
            if not isinstance(getattr(self, name), tuple):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "expert_members", tuple(tuple(m) for m in self.expert_members))

    def as_dict(self) -> dict:
        """Every field as plain YAML values (the names as a list; each expert's members as a list)."""
        return {k: [list(m) for m in v] if k == "expert_members" else list(v) if isinstance(v, tuple) else v
                for k, v in asdict(self).items()}


def _refuse(module: nn.Module, exc: Refusal) -> UnsupportedModuleStructure:
    return UnsupportedModuleStructure(type(module).__name__, str(exc))


def detect_router_kind(module: nn.Module) -> str:
    """``softmax_topk`` | ``sigmoid_group`` | ``topk_router_module``, proven from source; never calls the gate."""
    try:
        return routing_proof.router_kind(module)
    except Refusal as exc:
        raise _refuse(module, exc) from None
    except Exception as exc:  # noqa: BLE001 - the detector raises nothing but UnsupportedModuleStructure
        raise UnsupportedModuleStructure(type(module).__name__, f"router proof failed ({type(exc).__name__}: {exc})") from None


# ---------------------------------------------------------------------------------------------
# The public detector
# ---------------------------------------------------------------------------------------------


_UNKNOWN = object()


def find_experts(module: nn.Module, looped=_UNKNOWN) -> str | None:
    """The attribute of the block's experts, found by data flow, not by the name ``experts``: the
    ``ModuleList``/``ModuleDict`` its expert loop indexes by expert id; else the one child holding 3-D
    (expert, ., .) parameters; else the child called ``experts`` (batched experts with flattened weights, or
    an experts module whose proof names what it lacks); ``None`` for a module with none of these (a dense
    MLP). A lone ``ModuleList`` child the forward never loops over is returned too, so its refusal says so."""
    name = module_list_proof.expert_container(module) if looped is _UNKNOWN else looped
    if name is not None:
        return name
    batched = [n for n, m in module._modules.items() if m is not None and type(m) not in (nn.ModuleList, nn.ModuleDict)
               and any(p.dim() == 3 for p in m.parameters())]
    if len(batched) == 1:
        return batched[0]
    own_forward = [n for n, m in module._modules.items() if _own_forward_container(m)]
    if len(own_forward) == 1 and not batched:  # a ModuleDict/ModuleList subclass the block hands the routing to
        return own_forward[0]
    if isinstance(getattr(module, "experts", None), nn.Module):
        return "experts"
    if batched:
        raise Refusal(f"several children hold 3-D expert parameters ({batched}); which one holds the experts is "
                      "ambiguous")
    lists = [n for n, m in module._modules.items() if type(m) is nn.ModuleList]
    return lists[0] if len(lists) == 1 else None


def _structure(module: nn.Module, draws_on_owner: bool = False) -> MoeStructure:
    patched = genuine.patched_torch_objects(elementwise.activation_classes(), module_call=False)
    if patched:  # the proofs below resolve names to objects; a patch would be taken for torch's own
        raise Refusal(f"{', '.join(patched)} is not torch's own (patched process-wide): the model's experts would "
                      f"run the patch and autoep's grouped GEMM would not")
    router = routing_proof.router_kind(module)
    shared = routing_proof.shared_kind(module)
    looped = module_list_proof.expert_container(module)
    path = looped if looped is not None else find_experts(module, looped)
    experts = module._modules.get(path) if path is not None else None
    guards: tuple[str, ...] = ()
    uncallable = _uncallable_experts(module, path, experts)
    if uncallable is not None:
        raise uncallable
    if looped is None and _own_forward_container(experts):
        # Switch, NLLB (transformers 5): the block hands the routing to its experts container, whose own forward
        # is the loop; no fast path reads a loop there, the one-pass execution runs it as written
        raise Refusal(f"{path} is a {type(experts).__name__} with a forward of its own: no fast path proves a loop "
                      "inside the experts container")
    if looped is not None or type(experts) is nn.ModuleList:
        storage = "module_list"
        facts = module_list_proof.module_list_facts(experts, path, draws_on_owner)
        plans = module_list_proof.module_list_plan(module, path)  # the expert regions autoep splices out
        facts["idle_experts"] = tuple(plan.idle for plan in plans)
    elif isinstance(experts, nn.Module) and grouped_proof.takes_groups(experts):
        storage = "grouped"  # its per-group loops run every expert (3-D weights: zero gradients where idle)
        facts = dict(grouped_proof.grouped_experts_facts(experts), idle_experts=("call",))
        guards = routing_proof.experts_call(module, path)
    elif isinstance(experts, nn.Module) and equal_groups_proof.takes_rows(experts):
        storage = "equal_groups"  # experts(rows) on E equal groups of rows (Llama-4), every expert on its group
        facts = dict(equal_groups_proof.equal_groups_facts(experts), idle_experts=("call",))
        guards = routing_proof.experts_call(module, path)
    elif isinstance(experts, nn.Module):
        storage = "batched_parameters"
        facts, roles = experts_proof.batched_proof(experts)
        facts = dict(facts, idle_experts=(roles.idle,))
        guards = routing_proof.experts_call(module, path)
    elif block_expert_params(module):
        raise _block_params_refusal(module)
    else:
        raise Refusal("no experts: no ModuleList/ModuleDict its forward loops over by expert id, no child holding "
                      "3-D expert parameters, no `experts` submodule")
    if guards:  # the block's flags that keep its experts call on (folded, watched)
        facts = {**facts, "folded": tuple(facts.get("folded", ())) + guards}
    structure = MoeStructure(
        router=router, shared_experts=shared, expert_storage=storage, jitter=hasattr(module, "jitter_noise"),
        experts_path=path, execution="spliced" if storage == "module_list" else "grouped", **facts
    )
    _live_state(module, structure)
    # The vocabulary is closed: autoep.plan.archetypes.TABLE has a row for every (router, storage) pair of it
    # (tests/plan/test_archetypes.py), so a structure outside it is refused here, before any plan is made.
    if router not in ROUTER_KINDS or storage not in STORAGE_KINDS or structure.expert_kind not in EXPERT_KINDS:
        raise Refusal(f"router={router} with expert_storage={storage} is outside the detector's vocabulary")
    return structure


def _uncallable_experts(module: nn.Module, path: str | None, experts) -> Refusal | None:
    """A refusal where the experts module's forward only raises (JetMoE's mixture of attention): the block reaches
    its experts through other methods (``self.experts.map(...)``, ``.reduce(...)``, around its own attention), and
    every recipe moves calls of an experts forward; the refusal names the methods the block calls instead."""
    if not isinstance(experts, nn.Module) or isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
        return None
    try:
        body = source.function_tree(inspect.unwrap(type(experts).forward)).body
    except Exception:  # noqa: BLE001 - no source: the proofs below say what they cannot read
        return None
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if len(body) != 1 or not isinstance(body[0], ast.Raise):
        return None
    try:
        tree = source.function_tree(inspect.unwrap(type(module).forward))
    except Exception:  # noqa: BLE001
        tree = None
    methods = sorted({f"self.{path}.{node.func.attr}" for node in ast.walk(tree) if tree is not None
                      and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == path
                      and isinstance(node.func.value.value, ast.Name) and node.func.value.value.id == "self"})
    calls = f"the block calls {', '.join(methods)} instead" if methods else "the block never calls it"
    return Refusal(f"{path} ({type(experts).__name__}) cannot be called: its forward raises "
                   f"(`{ast.unparse(body[0])[:80]}`), and {calls}; autoep moves calls of an experts module's forward "
                   f"(or of expert modules), not of its other methods (experts applied in two halves around the "
                   f"block's own computation, a mixture of attention, are not supported)")


def _own_forward_container(experts) -> bool:
    """A ``ModuleList``/``ModuleDict`` subclass with a forward of its own."""
    return isinstance(experts, (nn.ModuleList, nn.ModuleDict)) and type(experts).forward is not nn.Module.forward


_BLOCK_PARAMS = ("experts are 3-D parameters on the block itself ({}), and its forward never slices them by an "
                 "expert id (self.w1[i] in a routing loop: autoep.detect.block_weights); autoep's batched and grouped "
                 "proofs read an experts submodule the block calls; slice the weights by the routing loop's id, or move "
                 "them into an experts module (batched: experts(hidden, top_k_index, top_k_weights); grouped: "
                 "experts(x_sorted, counts)), or opt out")
_BLOCK_WEIGHTS_FAST = ("its experts are 3-D weights its own routing loop slices by the expert id ({}); only the "
                       "one-pass execution runs them (record_replay: false refuses it)")


def _block_weights_structure(module: nn.Module, replay: bool) -> MoeStructure | None:
    """The structure of a block whose experts are 3-D weights its own routing loop slices (``autoep.detect.
    block_weights``: on the block, or on the child ``find_experts`` names, which the block never calls); None for
    any other block. Run by the one pass only: refused where ``replay`` is off."""
    held = block_weights.holder(module)
    if held is None:
        return None
    try:  # module experts the forward loops over, or another experts child: the other proofs' (their refusals too)
        if module_list_proof.expert_container(module) is not None or held and held != find_experts(module, None):
            return None
    except Refusal:
        return None
    if genuine.patched_torch_objects(elementwise.activation_classes(), module_call=False):
        return None  # ``_structure`` names the patch
    proof = block_weights.prove(module)
    if not replay:
        raise Refusal(_BLOCK_WEIGHTS_FAST.format(proof.describe()))
    return MoeStructure(router=routing_proof.router_kind(module), shared_experts=routing_proof.shared_kind(module),
                        jitter=hasattr(module, "jitter_noise"), **block_weights.facts(proof))


def block_expert_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The block's own (E, ., .) parameters, E >= 2 and the same for all, in a block that routes itself (a
    submodule holding parameters, its router, and a forward taking the rows alone): expert weights held on the
    block itself, no experts module to call. [] where it has none, 3-D parameters of different leading sizes,
    or a module that is batched experts itself (the routing reaches it as arguments, or it has no router)."""
    own = [(n, p) for n, p in module._parameters.items() if p is not None and p.dim() == 3]
    sizes = {p.shape[0] for _, p in own}
    if not own or len(sizes) != 1 or sizes.pop() < 2:
        return []
    routed = any(m is not None and next(m.parameters(), None) is not None for m in module._modules.values())
    return own if routed and _rows_alone(type(module)) else []


def _rows_alone(cls: type) -> bool:
    """``cls.forward`` takes one required argument besides ``self`` (the block's rows)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1


def _block_params_refusal(module: nn.Module) -> Refusal | None:
    own = block_expert_params(module)
    return Refusal(_BLOCK_PARAMS.format(", ".join(f"{n} {tuple(p.shape)}" for n, p in own))) if own else None


def _replay_structure(module: nn.Module, refused: Refusal, draws_on_owner: bool = False) -> MoeStructure:
    """The fallback where the proofs of the fast paths refuse (``refused``): module experts of one container
    the forward calls, each proven row-local, run by the one-pass execution (``autoep.detect.replay_proof``);
    its loop needs no proof. Raises ``refused`` where the block has no such container, else both reasons."""
    if genuine.patched_torch_objects(elementwise.activation_classes(), module_call=False):
        raise refused
    try:
        path = replay_proof.find_container(module)
    except expert_roles.Misplaced as exc:  # experts found by role, their placement a guess: both reasons
        raise Refusal(_both(refused, exc)) from None
    except Refusal:  # no module experts to call: the fast paths' reason is the one about this block's experts
        raise refused from None
    try:
        facts = replay_proof.replay_facts(module, path, draws_on_owner)
        structure = MoeStructure(router=routing_proof.router_kind(module), expert_storage="module_list",
                                 shared_experts=routing_proof.shared_kind(module), jitter=hasattr(module, "jitter_noise"),
                                 experts_path=path, execution="replay", **facts)
        _live_state(module, structure)
    except Refusal as exc:  # module experts found and refused: replay's reason names what in them it cannot run
        raise Refusal(_both(refused, exc)) from None
    return structure


def _both(fast: Refusal, replay: Refusal) -> str:
    """Record/replay's refusal of module experts it found (what in them it cannot run), then the fast paths'
    (their loop proofs), once where both say the same."""
    return str(replay) if str(fast) == str(replay) else f"{replay} (record/replay; no fast path either: {fast})"


def _live_state(module: nn.Module, structure: MoeStructure) -> None:
    """Issue 17: every other read of the experts (any depth of calls, hooks on the block, cached references)
    and expert tensors reached by two names inside the block (the whole model: ``resolve_plan``)."""
    # module experts (spliced or replayed): the forward and the methods it calls run as written, only their
    # expert loops (spliced) or calls of the experts (replay) move
    in_methods = structure.expert_storage == "module_list"
    checked = [f for f, _, _ in module_list_proof.block_methods(module).values()] if in_methods else [type(module).forward]
    for path in expert_paths(structure):
        expert_reads.experts_read_elsewhere(module, checked, path)
        tied = sharing.shared_expert_tensors(module, {"": module}, path)
        if tied:
            raise Refusal(f"{tied[0]}: {sharing.SHARING_FIX}")


def expert_paths(structure: MoeStructure) -> list[str]:
    """The block's children holding its experts: ``experts_path``, or the ones holding ``expert_members``."""
    return replay_proof.member_roots(structure.expert_members) if structure.expert_members else [structure.experts_path]


def detect_moe_structure(module: nn.Module, *, replay: bool = True, draws_on_owner: bool = False) -> MoeStructure:
    """What kind of MoE block ``module`` is, proven from its source and attributes: the fastest proven
    execution (``MoeStructure.execution``: a fast path's spliced loop or grouped compute where its proof holds,
    else the one-pass execution for module experts; ``replay=False``, ``PlanEntry.record_replay: false``,
    refuses where the fast paths do). ``draws_on_owner`` (``PlanEntry.expert_draws=on_owner``): module experts
    may draw random numbers (an element-wise dropout with p > 0), each expert's draws made on its owner rank
    (``MoeStructure.expert_draws`` records where); without it they are refused.

    Never calls a forward and allocates nothing (works on ``torch.device("meta")`` modules).
    Raises ``UnsupportedModuleStructure`` naming the class, the failed proof and the opt-out hint.
    """
    return _detected(module, replay=replay, draws_on_owner=draws_on_owner)


def replay_structure(module: nn.Module, *, draws_on_owner: bool = False) -> MoeStructure:
    """``module`` run by the one-pass execution even where a fast path is proven too (``PlanEntry.execution=
    replay``): its module experts proven as the fallback proves them; refusals as ``detect_moe_structure``'s."""
    return _detected(module, replay=True, fast=False, draws_on_owner=draws_on_owner)


def fast_path_structure(module: nn.Module) -> MoeStructure:
    """``detect_moe_structure`` without the the one-pass execution fallback: the fast paths' proofs alone
    (their refusal names the construct they do not read)."""
    return _detected(module, replay=False)


def _detected(module: nn.Module, replay: bool, fast: bool = True, draws_on_owner: bool = False) -> MoeStructure:
    try:
        held = _block_weights_structure(module, replay)
        if held is not None:
            return held
        try:
            if not fast:  # the reason replay gives where it finds no container
                raise _block_params_refusal(module) or Refusal("execution=replay needs module experts of one "
                                                               "container its forward calls")
            return _structure(module, draws_on_owner)
        except Refusal as exc:
            if not replay:
                raise
            return _replay_structure(module, exc, draws_on_owner)
    except Refusal as exc:
        raise _refuse(module, exc) from None
    except UnsupportedModuleStructure:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure inside a proof is a refusal, never a crash
        reason = f"the proof could not follow the source ({type(exc).__name__}: {str(exc)[:120]})"
        raise UnsupportedModuleStructure(type(module).__name__, reason) from None


def count_experts(module: nn.Module, structure: MoeStructure | None = None) -> int:
    """Number of routed (sharded) experts of an MoE block (from the experts' shapes; reads no data). For
    ModuleList/ModuleDict experts: every entry, less the trailing ``nn.Identity`` experts the SwiGLU fast path
    computes where the token is (``structure.identity_experts``; without a structure, every trailing one)."""
    if structure is not None and structure.expert_members:
        return len(structure.expert_members)  # one expert across several modules (``expert_roles``)
    if structure is not None and structure.expert_storage == "block_weights":
        holder = module.get_submodule(structure.experts_path) if structure.experts_path else module
        return int(holder._parameters[structure.expert_projs[0]].shape[0])  # (E, ., .), one E for all
    if structure is not None and structure.execution == "replay":
        try:  # the leading entries up to one the forward reads by name: every one travels
            return replay_proof.num_experts(module, structure.experts_path)
        except Refusal as exc:
            raise UnsupportedModuleStructure(type(module).__name__, f"cannot count experts: {exc}") from None
    try:
        path = structure.experts_path if structure is not None else find_experts(module)
    except Refusal as exc:
        raise UnsupportedModuleStructure(type(module).__name__, f"cannot count experts: {exc}") from None
    experts = getattr(module, path, None) if path is not None else None
    if isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
        members = list(experts.values()) if isinstance(experts, nn.ModuleDict) else list(experts)
        if structure is not None:
            return len(members) - structure.identity_experts
        return sum(type(e) is not nn.Identity for e in members)  # identity experts are not sharded
    p = getattr(experts, "down_proj", None)
    if isinstance(experts, nn.Module) and not isinstance(p, nn.Parameter) and grouped_proof.takes_groups(experts):
        # grouped experts: the weights may live on submodules (experts.fc1.weight); all are (E, ., .)
        p = next((w for w in experts.parameters() if w.dim() == 3), None)
    if isinstance(p, nn.Parameter) and p.dim() == 3:
        return int(p.shape[0])
    if isinstance(experts, nn.Module) and not experts._parameters:  # flattened (E*F, D) weights (DBRX): as proven
        try:
            flat = experts_proof.batched_proof(experts)[1].flat
        except Refusal:
            flat = None
        if flat is not None:
            return flat.num_experts
    raise UnsupportedModuleStructure(type(module).__name__, "cannot count experts: no ModuleList or 3-D down_proj")


def clear_caches() -> None:
    """Forget every per-function proof (benchmarks measure a cold detection with this). Proofs of a function
    are cached by its code object too (``source.cached_by_code``): a swapped ``__code__`` is proven again."""
    from autoep.detect import expert_loop, loop_context, wrappers

    for fn in (source.code_tree, routing_proof._router_module_proof, routing_proof._experts_call_source,
               module_list_proof._swiglu_shape, expert_loop.local_names, expert_loop.stored_names,
               loop_context.self_reads, expert_reads._names, expert_reads._self_whole_reads,
               expert_reads._class_reads, expert_reads._carried, expert_reads._global_names, wrappers._digest):
        fn.cache_clear()


def has_experts(module: nn.Module, *, replay: bool = True) -> bool:
    """``module`` holds experts as the detector finds them (``find_experts``; with ``replay``, the default, also
    an experts container its forward calls, ``replay_proof.find_container``); a module whose experts cannot be told apart
    (an ambiguity, unreadable source) counts as having them, so detection names why."""
    if replay and _replay_container(module):
        return True
    try:
        name = find_experts(module)
        if name is None:
            return bool(block_expert_params(module))  # detection refuses it, naming them
        # a lone ModuleList no loop indexes (a decoder's ``layers``) is returned for the refusal's sake only
        return type(module._modules.get(name)) is not nn.ModuleList or module_list_proof.expert_container(module) == name
    except Refusal:
        return True
    except Exception:  # noqa: BLE001 - any failure reading its source: let detection say what it is
        return True


def _replay_container(module: nn.Module) -> bool:
    try:
        return bool(replay_proof.find_container(module))
    except expert_roles.Misplaced:  # module experts found by role, their placement a guess: detection names why
        return True
    except Exception:  # noqa: BLE001 - a Refusal or a source it cannot read: has_experts' own reading decides
        return False
