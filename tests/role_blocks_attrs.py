"""MoE blocks whose experts are not in one registered container (issue 31, ``autoep.detect.expert_roles``), each
accepted spelling with a one-edit harmful twin that must be refused:

- ``NumberedExpertsMoE``: experts as numbered block children ``self.expert_0 ... self.expert_{E-1}`` (set with
  ``setattr`` in ``__init__``), reached in the routed loop with ``getattr(self, f"expert_{i}")``. Twins: the next
  expert's attribute (``f"expert_{(i + 1) % E}"``, misaligned), a family with a gap (a stray ``expert_{E+1}``), a
  member also read by its literal name on every row (``self.expert_0(x)``). ``NumberedListMoE``: the same experts
  listed first, ``[getattr(self, f"expert_{i}") for i in range(self.num_experts)]``; ``NumberedAppendMoE``: listed by
  ``experts = []``, ``for i in range(self.num_experts): experts.append(getattr(self, f"expert_{i}"))`` (twin:
  ``f"expert_{i + 1}"``, refused naming the append); ``AppendListMoE``: ``experts.append(self.experts[i])`` (its
  ``continue`` twin, ``AppendSkippingTwin``, keeps the lone container's decision and runs exact, not refused).
- ``NumberedLoraMoE``: a LoRA mixture in that style (``add_module(f"lora_A{i}", ...)``), one expert over two
  numbered families chained, ``getattr(self, f"lora_B{i}")(getattr(self, f"lora_A{i}")(x[tok]))``: ``lora_A{i}`` and
  ``lora_B{i}`` lie together on expert i's owner. Twin: ``f"lora_B{i + 1}"``.
- ``InitExtendMoE`` / ``InitConcatMoE``: a ModuleList built in ``__init__`` with ``.extend`` or from ``nn.ModuleList(
  shared + task)`` (ordinary containers). ``DoublyRegisteredMoE`` (twin): the shared experts also registered in a
  ModuleList of their own, so one module lies at two paths.
- ``ForwardExtendMoE``: the forward builds its experts ``experts = list(self.shared_experts); experts.extend(
  self.routed_experts)``. Twin: ``experts.insert(0, self.base)`` (a mutation the detector does not follow).
  ``ForwardSliceMoE``: ``self.experts[: self.num_active]`` (the rest of the container is called by nobody).
  ``ForwardConcatMoE``: ``list(self.a) + list(self.b)``.
- ``MultiTaskMoE``: a multi-gate multi-task block (PLE/MMoE written with top-k routing per token): shared experts,
  a ModuleList of per-task ModuleLists, one gate per task; for each task the forward builds that task's experts
  (``task_experts[t]`` + shared, by ``.extend``) and runs a top-k routed loop over them, returning one output per
  task. A shared expert is reached by every task's loop under another id: one expert, one owner.
  ``MultiTaskInlineMoE``: the list built where the loop iterates it (``enumerate(list(self.task_experts[t]) +
  list(self.shared_experts))``). Twin: the task's
  list built by ``experts += self.task_experts[t]`` inside a loop over ``t`` (one list across tasks, mutated in
  another loop than its assignment: not read).

Every block takes ``(batch, seq, hidden)`` and returns the same shape (``MultiTaskMoE``: a tuple of one such tensor
per task). ``BLOCKS`` and ``TWINS`` map a name to a builder, as ``tests/role_blocks.py``'s.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from replay_blocks import FF, D, E, FeedForward, K, _top_k

RANK = 4  # LoRA rank
TASKS = 2  # MultiTaskMoE: tasks; one expert per task and E - TASKS shared experts


class NumberedExpertsMoE(nn.Module):
    """fairseq-style numbered experts: ``self.expert_{i}`` for each i, the loop over ``range(self.num_experts)``."""

    def __init__(self):
        super().__init__()
        self.num_experts = E
        self.gate = nn.Linear(D, E, bias=False)
        for i in range(self.num_experts):
            setattr(self, f"expert_{i}", FeedForward())

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for i in range(self.num_experts):
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, getattr(self, f"expert_{i}")(x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class NumberedShiftedTwin(NumberedExpertsMoE):
    """Edit: ``f"expert_{(i + 1) % self.num_experts}"``: the next expert on expert i's rows."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for i in range(self.num_experts):
            tok, slot = torch.where(selected == i)
            shifted = getattr(self, f"expert_{(i + 1) % self.num_experts}")(x[tok])
            y.index_add_(0, tok, shifted * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class NumberedGapTwin(NumberedExpertsMoE):
    """Edit: a stray ``expert_{E+1}`` registered after the family (no ``expert_{E}``): which ids reach it would be
    a guess."""

    def __init__(self):
        super().__init__()
        setattr(self, f"expert_{E + 1}", FeedForward())


class NumberedLiteralTwin(NumberedExpertsMoE):
    """Edit: ``expert_0`` also called by its literal name on every row (a shared expert that is also routed)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        y = self.expert_0(x)
        for i in range(self.num_experts):
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, getattr(self, f"expert_{i}")(x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class NumberedListMoE(NumberedExpertsMoE):
    """The numbered experts listed first, ``[getattr(self, f"expert_{i}") for i in range(self.num_experts)]``."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        experts = [getattr(self, f"expert_{i}") for i in range(self.num_experts)]
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for i, expert in enumerate(experts):
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class NumberedAppendMoE(NumberedExpertsMoE):
    """The numbered experts listed by ``.append`` in a loop over the ids: ``experts = []``, ``for i in
    range(self.num_experts): experts.append(getattr(self, f"expert_{i}"))``."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        experts = []
        for i in range(self.num_experts):
            experts.append(getattr(self, f"expert_{i}"))
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for i, expert in enumerate(experts):
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class NumberedAppendShiftedTwin(NumberedExpertsMoE):
    """Edit: ``experts.append(getattr(self, f"expert_{i + 1}"))``: no ``expert_{E}`` (which module the last id
    selects is not known)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        experts = []
        for i in range(self.num_experts):
            experts.append(getattr(self, f"expert_{i + 1}"))
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for i, expert in enumerate(experts):
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class AppendListMoE(nn.Module):
    """A ModuleList's entries listed by ``.append`` in a loop over the ids (``experts.append(self.experts[i])``)."""

    def __init__(self):
        super().__init__()
        self.num_experts = E
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList([FeedForward() for _ in range(E)])

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        experts = []
        for i in range(self.num_experts):
            experts.append(self.experts[i])
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for i, expert in enumerate(experts):
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class AppendSkippingTwin(AppendListMoE):
    """Edit: a ``continue`` in the appending loop (``if i == 0: continue``): expert 1 lands at id 0; the loop is not
    unrolled, the lone container ``self.experts`` keeps its decision and the one pass runs each entry's calls on its
    owner whatever id picked the rows: exact (``tests/one_pass_blocks.py``, ``append_skipping``), not refused."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        experts = []
        for i in range(self.num_experts):
            if i == 0:
                continue
            experts.append(self.experts[i])
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for i, expert in enumerate(experts):
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class NumberedLoraMoE(nn.Module):
    """A LoRA mixture on a base layer with numbered adapters: ``lora_A{i}``, ``lora_B{i}`` chained, the expert held in
    a local before its call."""

    def __init__(self):
        super().__init__()
        self.base_layer = nn.Linear(D, D)
        self.router = nn.Linear(D, E, bias=False)
        self.num_loras = E
        for i in range(E):
            self.add_module(f"lora_A{i}", nn.Linear(D, RANK, bias=False))
            self.add_module(f"lora_B{i}", nn.Linear(RANK, D, bias=False))
        self.scaling = 2.0

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        result = self.base_layer(x)
        weights, selected = _top_k(self.router, x, K)
        for i in range(self.num_loras):
            tok, slot = torch.where(selected == i)
            lora_a = getattr(self, f"lora_A{i}")
            delta = getattr(self, f"lora_B{i}")(lora_a(x[tok])) * self.scaling
            result = result.index_add(0, tok, delta * weights[tok, slot, None])
        return result.reshape(hidden_states.shape)


class NumberedLoraShiftedTwin(NumberedLoraMoE):
    """Edit: ``f"lora_B{(i + 1) % self.num_loras}"``: another expert's up projection."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        result = self.base_layer(x)
        weights, selected = _top_k(self.router, x, K)
        for i in range(self.num_loras):
            tok, slot = torch.where(selected == i)
            lora_a = getattr(self, f"lora_A{i}")
            delta = getattr(self, f"lora_B{(i + 1) % self.num_loras}")(lora_a(x[tok])) * self.scaling
            result = result.index_add(0, tok, delta * weights[tok, slot, None])
        return result.reshape(hidden_states.shape)


class _ListLoopMoE(nn.Module):
    """A gate and a Mixtral-style loop, in a method, over the container the forward hands it."""

    def route(self, x, experts):
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for i, expert in enumerate(experts):
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return y


class InitExtendMoE(_ListLoopMoE):
    """``self.experts = nn.ModuleList(); self.experts.extend(...)`` in ``__init__``."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList()
        self.experts.extend([FeedForward() for _ in range(E // 2)])
        self.experts.extend(FeedForward(D, FF // 2) for _ in range(E - E // 2))

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        return self.route(x, self.experts).reshape(hidden_states.shape)


class InitConcatMoE(_ListLoopMoE):
    """``nn.ModuleList(shared + task)`` of two plain lists built in ``__init__``."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        shared = [FeedForward(D, FF // 2) for _ in range(E - 2)]
        task = [FeedForward() for _ in range(2)]
        self.experts = nn.ModuleList(shared + task)

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        return self.route(x, self.experts).reshape(hidden_states.shape)


class DoublyRegisteredMoE(InitConcatMoE):
    """Edit: the shared experts also kept in a ModuleList of their own, so each lies at two paths (``shared.0`` and
    ``experts.0``) and the forward calls them through both: a tensor reached by two names."""

    def __init__(self):
        super().__init__()
        self.shared = nn.ModuleList(list(self.experts)[: E - 2])

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        for shared in self.shared:
            y = y + shared(x)
        return y.reshape(hidden_states.shape)


class ForwardExtendMoE(nn.Module):
    """Shared and routed experts in two containers; the forward lists them with ``list(...)`` and ``.extend``."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.shared_experts = nn.ModuleList([FeedForward(D, FF // 2) for _ in range(1)])
        self.routed_experts = nn.ModuleList([FeedForward() for _ in range(E - 1)])

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        experts = list(self.shared_experts)
        experts.extend(self.routed_experts)
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for i, expert in enumerate(experts):
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class ForwardInsertTwin(ForwardExtendMoE):
    """Edit: ``experts.insert(0, ...)``: a mutation the detector does not follow (which module is at which id?)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        experts = list(self.routed_experts)
        experts.insert(0, self.shared_experts[0])
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for i, expert in enumerate(experts):
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class ForwardSliceMoE(nn.Module):
    """The first ``num_active`` entries of a longer container are the experts (the rest: spares nobody calls)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.num_active = E
        self.experts = nn.ModuleList([FeedForward() for _ in range(E + 2)])

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        experts = self.experts[: self.num_active]
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for i, expert in enumerate(experts):
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class ForwardConcatMoE(ForwardExtendMoE):
    """``list(self.shared_experts) + list(self.routed_experts)``."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        experts = list(self.shared_experts) + list(self.routed_experts)
        weights, selected = _top_k(self.gate, x, K)
        y = torch.zeros_like(x)
        for i, expert in enumerate(experts):
            tok, slot = torch.where(selected == i)
            y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return y.reshape(hidden_states.shape)


class MultiTaskMoE(nn.Module):
    """PLE/MMoE with top-k routing per token: each task's gate routes over that task's experts and the shared ones."""

    def __init__(self, tasks: int = TASKS):
        super().__init__()
        self.num_tasks = tasks
        self.shared_experts = nn.ModuleList([FeedForward(D, FF // 2) for _ in range(E - tasks)])
        self.task_experts = nn.ModuleList([nn.ModuleList([FeedForward()]) for _ in range(tasks)])
        self.gates = nn.ModuleList([nn.Linear(D, 1 + E - tasks, bias=False) for _ in range(tasks)])
        self.task_load: list[list[int]] = []  # per call and task: tokens per expert id (Python-visible state)

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        outputs = []
        for t in range(self.num_tasks):
            experts = list(self.task_experts[t])
            experts.extend(self.shared_experts)
            weights, selected = _top_k(self.gates[t], x, K)
            self.task_load.append(torch.bincount(selected.flatten(), minlength=len(experts)).tolist())
            y = torch.zeros_like(x)
            for i, expert in enumerate(experts):
                tok, slot = torch.where(selected == i)
                y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
            outputs.append(y.reshape(hidden_states.shape))
        return tuple(outputs)

    def visible_state(self) -> dict:
        return {"task_load": [list(load) for load in self.task_load]}  # a copy: the next call appends


class MultiTaskInlineMoE(MultiTaskMoE):
    """The same, each task's experts listed where its loop iterates them, one gate per task from ``enumerate``."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        outputs = []
        for t, gate in enumerate(self.gates):
            weights, selected = _top_k(gate, x, K)
            y = torch.zeros_like(x)
            for i, expert in enumerate(list(self.task_experts[t]) + list(self.shared_experts)):
                tok, slot = torch.where(selected == i)
                y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
            outputs.append(y.reshape(hidden_states.shape))
        return tuple(outputs)


class MultiTaskAccumulatedTwin(MultiTaskMoE):
    """Edit: one list for every task, grown with ``+=`` in the task loop (task t routes over every earlier task's
    experts too: a list mutated in another loop than its assignment is not read)."""

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, D)
        outputs = []
        experts = list(self.shared_experts)
        for t in range(self.num_tasks):
            experts += self.task_experts[t]
            weights, selected = _top_k(self.gates[t], x, K)
            y = torch.zeros_like(x)
            for i, expert in enumerate(experts):
                tok, slot = torch.where(selected == i)
                y.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
            outputs.append(y.reshape(hidden_states.shape))
        return tuple(outputs)


BLOCKS = {
    "numbered_experts": NumberedExpertsMoE,
    "numbered_list": NumberedListMoE,
    "numbered_append": NumberedAppendMoE,
    "append_list": AppendListMoE,
    "numbered_lora": NumberedLoraMoE,
    "init_extend": InitExtendMoE,
    "init_concat": InitConcatMoE,
    "forward_extend": ForwardExtendMoE,
    "forward_slice": ForwardSliceMoE,
    "forward_concat": ForwardConcatMoE,
    "multi_task": MultiTaskMoE,
    "multi_task_inline": MultiTaskInlineMoE,
}

# name -> (builder, what the refusal names)
TWINS = {
    "numbered_shifted": (NumberedShiftedTwin, "not selected by that id"),
    "numbered_gap": (NumberedGapTwin, "gap"),
    "numbered_literal": (NumberedLiteralTwin, "by its name"),
    "numbered_lora_shifted": (NumberedLoraShiftedTwin, "not selected by that id"),
    "numbered_append_shifted": (NumberedAppendShiftedTwin,
                                (r"`experts.append\(getattr\(self, f'expert_\{i \+ 1\}'\)\)` \(line 5\) adds a module "
                                 "of the block to experts in a way autoep does not follow")),
    "doubly_registered": (DoublyRegisteredMoE, r"experts\.0\.fc1\.weight is also shared\.0\.fc1\.weight"),
    "forward_insert": (ForwardInsertTwin,
                       (r"`experts.insert\(0, self.shared_experts\[0\]\)` \(line 4\) reads experts in a way autoep "
                        "does not follow")),
    "multi_task_accumulated": (MultiTaskAccumulatedTwin,
                               (r"`experts \+= self.task_experts\[t\]` \(line 6\) changes experts away from the "
                                "statements of its assignment")),
}
