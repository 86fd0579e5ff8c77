"""The soundness fuzzer's engine: mutate accepted MoE blocks, detect, and hold every accepted mutant to
exact parity with its own forward and backward (issue 8, "How it is proven").

A **target** builds a fresh tiny fp32 block in train mode, seeded (transformers 5.x classes, the
hand-written v4-style blocks of ``tests/blocks.py`` and a v5-style block of ``tests/detect/test_structure.py``).
The first ten are the original set; ``NEW_TARGETS`` are the idioms accepted since (float32, non-gated,
soft-capped-gate and shared-expert experts, a sampling router; ``acc[idx] += ...`` loops, a padding id the
loop skips, a class a function builds; grouped experts called as ``experts(x_sorted, counts)``). A
**mutant** is one operator applied at one place:

- source mutants (``mutation_operators``): one function's source (the block forward and the helpers it
  calls on ``self``, the router forward, the batched experts forward and its helpers, the ModuleList
  expert forward, the forward of a model-defined activation module the experts call and of the
  model-defined modules inside it, the forward of model-defined modules inside batched or grouped experts
  (role ``experts:<Class>``) and the module-level functions the experts' code calls), parsed, edited at one
  location, unparsed and exec'd as a method of a subclass of the original class
  (``mutation_source.exec_subclass``: same name, the original module's globals and, for a class a function
  builds, the same closure; source readable by ``inspect``; an edited module-level function is defined
  under its own name in the globals of its unchanged caller); the block's objects are re-classed in place
  (``obj.__class__ = Mutant``).
- run-time-state mutants (``mutation_runtime``): no source change; instance ``forward``, hooks,
  ``__call__`` overrides, tied / frozen / heterogeneous experts, instance ``_apply_gate``, ``act_fn``,
  the gate's float constants doubled or made learnable; a ``forward`` whose ``__code__`` was edited after
  import, a block number made a property (issue 17; its source operators, ``mutation_live_operators``:
  private names, default arguments and closure variables rebound, routing weights edited in place after
  the loop, an empty experts output dropped). Issue 20: values a proof folds changed after apply (a global
  or a settings class's flag around each forward, ``Mutant.around``; a dropout raised, an instance flag set
  by a user pre-hook registered after apply, ``Mutant.after_apply``, done to the reference and the EP copy);
  a dim given as ``axis=``; a default whose global was rebound.

Verdicts (``evaluate``): the detector raising anything but ``UnsupportedModuleStructure`` is a **crash**;
a mutant whose own forward/backward raises, or whose outputs differ from EP's only because its own forward
reads memory it never wrote (``reads_uninitialised``: NaN-filled vs zero-filled empties, whatever ran before in
the process), is **invalid** (listed, not counted, whatever the detector said); a refusal (at detection, at apply, or at forward: ``LiveStateError``, ``FactChanged``, raised before
any expert work) is **refused**; otherwise the recipe from ``compute_fn_config`` runs on a deep copy at
``ep_mesh=None`` and outputs, input grad and every parameter grad must equal the mutant's own (fp32,
default ``assert_close``): **accepted_exact**, else **accepted_wrong** (with the largest difference or
the exception). ``mutation_ranks`` repeats the comparison on gloo ranks.

The enumeration is fixed and ordered: target x site x operator x location, then the run-time operators
per target x role. ``sample(mutants, every)`` takes every ``every``-th mutant of each target.

    python bench/soundness.py --ranks 2      # every mutant, listed and counted
"""

from __future__ import annotations

import ast
import contextlib
import copy
import functools
import importlib
import inspect
import itertools
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
from mutation_block_weight_operators import BLOCK_WEIGHT_OPERATORS
from mutation_operators import SOURCE_OPERATORS, Edit
from mutation_replay import REPLAY_OPERATORS
from mutation_runtime import (
    RUNTIME_OPERATORS,
    act_roles,
    experts_of,
    experts_sub_roles,
    is_module_list,
    role_objects,
    roles_of,
    router_of,
)
from mutation_source import function_tree, self_attr, with_method
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from autoep.detect.structure import detect_moe_structure
from autoep.errors import FactChanged, LiveStateError, UnsupportedModuleStructure
from autoep.runtime.recipes.replay import ReplayError
from autoep.plan.archetypes import RUNNABLE_EXPERT_KINDS, compute_fn_config

BATCH, SEQ = 2, 3
OPERATORS = [*SOURCE_OPERATORS, *RUNTIME_OPERATORS]  # the targets of ``targets()``
# The record/exchange/replay targets of ``replay_targets()`` get these and ``REPLAY_OPERATORS`` too.
REPLAY_TARGET_OPERATORS = [*OPERATORS, *REPLAY_OPERATORS, *BLOCK_WEIGHT_OPERATORS]


# ---------------------------------------------------------------------------------------------
# Targets: fresh tiny fp32 blocks in train mode, seeded
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    build: Callable[[], nn.Module]
    flat: bool = False  # the block takes (tokens, hidden), not (batch, seq, hidden)
    # on several ranks, one rank may get no sequences; False where the block's own forward cannot run an
    # empty batch (DBRX: its experts' ``acc.view(0, -1, D)`` is ambiguous), so no rank of it ever has none
    empty_rank: bool = True
    # detected with the record/exchange/replay fallback (``detect_moe_structure(replay=True)``, the plan entry's
    # ``record_replay: True``), and mutated by ``mutation_replay.REPLAY_OPERATORS`` too
    replay: bool = False
    # experts as 3-D weights on the block (issue 31 item 3): mutated by ``BLOCK_WEIGHT_OPERATORS`` too
    block_weights: bool = False


def _transformers_4() -> bool:
    import transformers

    return int(transformers.__version__.split(".")[0]) < 5


@functools.lru_cache(maxsize=None)
def _family_configs(family: str) -> tuple:
    from autoep.tools.tiny import family_configs

    return tuple(family_configs(importlib.import_module(f"transformers.models.{family}")))


def _transformers_block(family: str, cls_name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from test_parity_hf import eager_experts_, randomize_

        from autoep.tools.tiny import build_block

        cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), cls_name)
        block, _ = build_block(cls, list(_family_configs(family)), tiny=True)
        randomize_(block, 0)
        eager_experts_(block)
        return block.float().train()

    return build


def _with_limit(build: Callable[[], nn.Module], limit: float) -> Callable[[], nn.Module]:
    """``build``'s block with its experts' SwiGLU clamp ``limit`` set (what a per-layer ``swiglu_limits`` gives)."""
    def limited() -> nn.Module:
        block = build()
        block.experts.limit = limit
        return block

    return limited


def _hand_written_block(name: str, make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(sum(map(ord, name)))
        block = make()
        if hasattr(block, "e_score_correction_bias"):
            block.e_score_correction_bias.normal_(0, 0.1)  # nonzero, so choice and weight scores differ
        return block.train()

    return build


def _in_eval(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    return lambda: build().eval()


@functools.lru_cache(maxsize=None)
def _closure_moe_class() -> type:
    """One class per process: every build of the target (and its mutants' bases) shares it."""
    from blocks import make_closure_moe_class

    return make_closure_moe_class(0.05)


def _v5_float32_experts() -> nn.Module:
    """``V5Block(Float32Experts())`` with a random router (its weight starts at zero: every score ties)
    and expert weights scaled to keep activations O(1)."""
    from test_structure import Float32Experts, V5Block

    block = V5Block(Float32Experts())
    with torch.no_grad():
        block.gate.weight.normal_(0, 0.5)
        for p in block.experts.parameters():
            p.mul_(0.3)
    return block


def _dbrx_block() -> nn.Module:
    """transformers 5.x ``DbrxFFN`` with F=16 != D=32, so a transposed weight or a swapped view cannot pass
    on shapes alone (the tiny config shrinks both to 32)."""
    from test_parity_hf import randomize_
    from transformers.models.dbrx import modeling_dbrx

    config = modeling_dbrx.DbrxConfig(d_model=32, n_heads=4, ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4,
                                                                         "moe_top_k": 2})
    torch.manual_seed(0)
    block = modeling_dbrx.DbrxFFN(config)
    randomize_(block, 0)
    return block.float().train()


def targets() -> list[Target]:
    """Every target, in the fixed order of the enumeration: the original ten, then ``NEW_TARGETS``."""
    from blocks import (
        CappedRouterMoE,
        DeepseekRemoteMoE,
        DeepseekV3StyleMoE,
        DropoutExpertsMoE,
        MiniMindStyleMoE,
        MistralInferenceMoeLayer,
        MixtralStyleSparseMoeBlock,
        MoE,
        Qwen2MoeStyleSparseMoeBlock,
        SortedSplitHostCountsMoE,
        SortedSplitMoE,
        ZeroExpertMoE,
    )

    hf = [
        ("qwen3_moe", "Qwen3MoeSparseMoeBlock"),
        ("qwen2_moe", "Qwen2MoeSparseMoeBlock"),
        ("deepseek_v3", "DeepseekV3MoE"),
        ("gpt_oss", "GptOssMLP"),
        ("mixtral", "MixtralSparseMoeBlock"),
    ]
    v4 = {
        "mixtral": lambda: MixtralStyleSparseMoeBlock(hidden=16, num_experts=4, top_k=2),
        "mixtral_jitter": lambda: MixtralStyleSparseMoeBlock(hidden=16, num_experts=4, top_k=2, jitter_noise=0.2),
        "qwen2_moe": lambda: Qwen2MoeStyleSparseMoeBlock(hidden=16, num_experts=4, top_k=2, norm_topk_prob=True),
        "deepseek_v3": lambda: DeepseekV3StyleMoE(hidden=16, num_experts=8, top_k=2, n_group=4, topk_group=2),
        "research": lambda: MoE(hidden=16, num_experts=4, top_k=2),
    }
    new_hf = [
        ("nemotron_h", "NemotronHMoE"),  # non-gated up -> act -> down experts (``up_proj``)
        ("inkling2", "Inkling2SparseMoeBlock"),  # a soft-capped SwiGLU module called from ``_apply_gate``
        ("openai_privacy_filter", "OpenAIPrivacyFilterMLP"),  # float32 experts
        ("flint", "FlintSparseMoeBlock"),  # a lone shared expert, added ungated
        ("phimoe", "PhimoeSparseMoeBlock"),  # a router that samples while training (seeded on both sides)
        ("muse_spark", "MuseSparkMoE"),  # a post-expert norm inside the experts, with a (D,) weight of its own
    ]
    new_v4 = {
        "mistral_inference": lambda: MistralInferenceMoeLayer(hidden=16, num_experts=4, top_k=2),  # acc[i] += ...
        "capped_router": lambda: CappedRouterMoE(hidden=16, num_experts=4, top_k=2),  # padding id num_experts
        "closure": lambda: _closure_moe_class()(hidden=16, num_experts=4, top_k=2),  # closure + zero-arg super()
        "sorted_split": lambda: SortedSplitMoE(hidden=16, num_experts=4, top_k=2),  # argsort/split in a helper
        "sorted_split_host_counts": lambda: SortedSplitHostCountsMoE(hidden=16, num_experts=4, top_k=2),
        "zero_experts": lambda: ZeroExpertMoE(hidden=16, num_experts=4, zero_experts=2, top_k=2),  # nn.Identity
        "deepseek_remote": lambda: DeepseekRemoteMoE(hidden=16, num_experts=4, top_k=2),  # masked assignment
        "expert_dropout_p0": lambda: DropoutExpertsMoE(hidden=16, num_experts=4, top_k=2),  # nn.Dropout(0)
    }
    from blocks import AriaStyleMoELayer, TitanMoE, TitanPaddedMoE, TuneMoE

    grouped_v4 = {  # experts(x_sorted, num_tokens_per_expert)
        "titan_grouped": lambda: TitanMoE(hidden=16, num_experts=4, top_k=2),  # split loop, w[e].transpose
        "tune_grouped": lambda: TuneMoE(hidden=16, num_experts=4, top_k=2),  # split loop, x @ w[e], router module
        "aria_grouped": lambda: AriaStyleMoELayer(hidden=16, num_experts=4, top_k=2),  # nested GEMMs, offset loop
        "titan_padded_grouped": lambda: TitanPaddedMoE(hidden=16, num_experts=4, top_k=2),  # zero rows past groups
    }
    return [
        # transformers 4.57's GPT-OSS experts cannot run an empty batch (``acc.view(0, -1, D)``): no rank gets none.
        *(Target(f"hf/{f}", _transformers_block(f, c), empty_rank=not (f == "gpt_oss" and _transformers_4()))
          for f, c in hf),
        *(Target(f"v4/{n}", _hand_written_block(n, make)) for n, make in v4.items()),
        *(Target(f"hf/{f}", _transformers_block(f, c)) for f, c in new_hf),
        *(Target(f"v4/{n}", _hand_written_block(n, make)) for n, make in new_v4.items()),
        Target("v5/float32_experts", _hand_written_block("float32_experts", _v5_float32_experts), flat=True),
        *(Target(f"v4/{n}", _hand_written_block(n, make)) for n, make in grouped_v4.items()),
        Target("hf/dbrx", _dbrx_block, empty_rank=False),  # flattened (E*F, D) experts on a submodule
        # transformers 5.25 Step3p7: ``if self.limit is not None:`` in ``_apply_gate`` folded, the clamp taken
        Target("hf/step3p7_limit", _with_limit(_transformers_block("step3p7", "Step3p7SparseMoeBlock"), 0.2)),
        # The remote-code block in eval: its @torch.no_grad() argsort/split helper runs instead.
        Target("v4/deepseek_remote_eval", _in_eval(_hand_written_block(
            "deepseek_remote", lambda: DeepseekRemoteMoE(hidden=16, num_experts=4, top_k=2)))),
        # minimind's mask.any() loop; its own forward cannot run zero tokens (y[0, 0] of an idle expert)
        Target("v4/minimind", _hand_written_block("minimind", lambda: MiniMindStyleMoE(hidden=16, num_experts=8)),
               empty_rank=False),
        # experts(rows) on E equal groups of pre-scaled rows (Llama-4); its view(E, -1, D) cannot take 0 rows
        Target("v4/llama4_equal_groups", _hand_written_block("llama4_equal_groups", _equal_groups_block),
               empty_rank=False),
        Target("hf/llama4", _llama4_block, empty_rank=False),
        # Row-local experts in third-party idioms (issue 16), found by data flow under other names.
        *(Target(f"v4/{n}", _hand_written_block(n, make)) for n, make in _row_local_blocks().items()),
        # A decoder layer in Gemma-4's idioms: transformers' checkpointing and deprecate_kwarg wrappers around
        # its forward, the experts call under ``if self.enable_moe_block:``, experts skipping a padding class.
        Target("v5/gemma_style_layer", _hand_written_block("gemma_style_layer", _gemma_style_layer)),
        # transformers 4.57 batched experts behind a training test (Qwen3-VL-MoE, GPT-OSS idioms): the loop over
        # dense (T, E) weights runs as the exchange, a gate written inline runs as the source writes it.
        # Their own forward cannot run an empty batch (``acc.view(0, -1, D)`` is ambiguous): no rank gets none.
        *(Target(f"v4/{n}", _hand_written_block(n, make), empty_rank=False)
          for n, make in _training_branch_blocks().items()),
        # transformers 4.57 VitPose: every expert on every row, masked by the sequence's id, summed; no loop proof
        # reads it, record/exchange/replay runs it (each expert called on the whole (batch, seq, ffn) tensor).
        Target("v4/masked_sum", _hand_written_block("masked_sum", _masked_sum_block), replay=True),
        # Experts containers whose own forward is the loop (transformers 5.x Switch/NLLB idiom), at dropout p=0, and
        # transformers 4.57 Switch (rows assigned from a one-hot mask with capacity, ModuleDict experts by getattr):
        # no fast path reads their loops since issue 21, record/exchange/replay runs them (``replay=True``: mutated
        # by the replay operators too).
        Target("hf/switch_transformers", _switch_block, replay=True),  # a capacity-masked dispatch mask
        Target("hf/nllb_moe", _nllb_block, replay=True),  # one_hot ids, a token-dropout branch, a non-expert entry
        *(Target(f"v4/{n}", _hand_written_block(n, make), replay=True) for n, make in _container_blocks().items()),
        Target("v4/selected_rows", _hand_written_block("selected_rows", _selected_rows_block), replay=True),
    ]


class _ModeExpert(nn.Module):
    """``fc2(inner(fc1(x)))`` for a module whose row-locality depends on the mode (BatchNorm, dropout)."""

    def __init__(self, inner: nn.Module, hidden: int = 16, ffn: int = 24):
        super().__init__()
        self.fc1, self.inner, self.fc2 = nn.Linear(hidden, ffn), inner, nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(self.inner(self.fc1(x)))


def _with_stats(block: nn.Module) -> nn.Module:
    for m in block.modules():  # running statistics that are not the identity's, so a wrong norm could not pass
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
    return block


def mode_targets() -> list[Target]:
    """Blocks whose experts' row-locality depends on the mode (issue 31 item 4), built in the mode they are proven
    for (eval): BatchNorm1d with running statistics and dropout at p=0.3, through the spliced loop
    (``ExpertListMoE``) and the one pass (``replay_blocks.ComprehensionMoE``'s loop); and two whose experts are
    row-local in either mode, built in train (GroupNorm, dropout at p=0). Not in ``targets()``:
    ``tests/detect/test_mode_changes.py`` runs them with ``mutation_runtime.rt_mode_changed``."""
    import blocks
    import replay_blocks

    def comprehension(inner):
        def build():
            block = replay_blocks.ComprehensionMoE()
            block.experts = nn.ModuleList([_ModeExpert(inner(), replay_blocks.D, 12) for _ in range(replay_blocks.E)])
            return _with_stats(block)
        return build

    made = {
        "batch_norm_eval": lambda: _with_stats(blocks.ExpertListMoE([_ModeExpert(nn.BatchNorm1d(24)) for _ in range(4)])),
        "dropout_eval": lambda: blocks.ExpertListMoE([_ModeExpert(nn.Dropout(0.3)) for _ in range(4)]),
        "batch_norm_eval_one_pass": comprehension(lambda: nn.BatchNorm1d(12)),
        "dropout_eval_one_pass": comprehension(lambda: nn.Dropout(0.3)),
    }
    trained = {  # row-local in either mode: a flip is exact (GroupNorm; dropout at p=0, its mode released)
        "group_norm_train": lambda: blocks.ExpertListMoE([_ModeExpert(nn.GroupNorm(4, 24)) for _ in range(4)]),
        "dropout_p0_train_one_pass": comprehension(lambda: nn.Dropout(0.0)),
    }
    return [*(Target(f"mode/{n}", _in_eval(_hand_written_block(n, make)), replay=n.endswith("one_pass"))
              for n, make in made.items()),
            *(Target(f"mode/{n}", _hand_written_block(n, make), replay=n.endswith("one_pass"))
              for n, make in trained.items())]


def replay_targets() -> list[Target]:
    """The blocks of ``tests/replay_blocks.py`` (dispatch loops no fast-path spec reads: comprehension, ``zip``
    chunks, ``vstack``, a cast-masked assignment, batch rows, a config flag, a container with an optional
    argument, nested experts, expert choice, capacity dropping, dropout between calls, a counter, a cached
    order), run by record/exchange/replay; and the blocks of ``tests/block_weight_blocks.py`` (experts as 3-D
    weights on the block, issue 31 item 3: sites rewritten as expert calls; ``BLOCK_WEIGHT_OPERATORS`` too). Not in ``targets()`` (which holds the Switch/NLLB/container/selected
    targets replay runs too, from before issue 21): ``tests/detect/test_replay_soundness.py`` samples them,
    ``bench/soundness.py --replay`` runs them all."""
    import block_weight_blocks
    import replay_blocks
    import role_blocks
    import role_blocks_attrs
    import wrapper_blocks

    # experts by role (issue 31) too: several containers, numbered attributes, lists built in the forward; and by where
    # they sit, one block per mechanism (three_wrappers, flat_grouped_routing and chunked_weights repeat one: fuzzed
    # once, 0 accepted-wrong, not kept in the sample's time); 3-D expert weights on the block (their own operators)
    blocks = {**replay_blocks.BLOCKS, **role_blocks.BLOCKS, **role_blocks_attrs.BLOCKS,
              **{n: wrapper_blocks.BLOCKS[n] for n in wrapper_blocks.FUZZED}}
    weights = block_weight_blocks.BLOCKS
    assert not blocks.keys() & weights.keys(), blocks.keys() & weights.keys()
    return [*(Target(f"replay/{n}", _hand_written_block(n, make), replay=True) for n, make in blocks.items()),
            *(Target(f"replay/{n}", _hand_written_block(n, make), replay=True, block_weights=True)
              for n, make in weights.items())]


def _training_branch_blocks() -> dict[str, Callable[[], nn.Module]]:
    import blocks

    return {
        "dense_weights_branch": lambda: blocks.DenseWeightsMoE(hidden=16, ffn=24, num_experts=4, top_k=2),
        "inline_gate_branch": lambda: blocks.InlineGateMoE(hidden=16, ffn=24, num_experts=4, top_k=2),
    }


def _gemma_style_layer() -> nn.Module:
    from gc_blocks import GemmaStyleMoeLayer

    return GemmaStyleMoeLayer(hidden=16, ffn=24, num_experts=4, top_k=2)


def _selected_rows_block() -> nn.Module:
    from blocks import SelectedRowsMoE

    return SelectedRowsMoE(hidden=16, ffn=24, num_experts=4, capacity=2)


def _masked_sum_block() -> nn.Module:
    from blocks import MaskedSumMoE

    return MaskedSumMoE(hidden=16, ffn=24, part=4, num_experts=4)


def _row_local_blocks() -> dict[str, Callable[[], nn.Module]]:
    import blocks

    return {
        "fairseq_local_experts": lambda: blocks.FairseqStyleMoE(hidden=16, ffn=24, activation_fn="gelu"),
        "sequential_experts": lambda: blocks.SequentialExpertsMoE(hidden=16, ffn=24),
        "optional_args_experts": lambda: blocks.ExpertListMoE([blocks.OptionalArgsExpert(16, 24) for _ in range(4)]),
        "config_branch_experts": lambda: blocks.ExpertListMoE(
            [blocks.ConfigBranchExpert(blocks.BranchExpertConfig(16, 24, glu_multiplier=m)) for m in (1, 2, 1, 2)]),
        "module_dict_experts": lambda: blocks.ModuleDictExpertsMoE(hidden=16, ffn=24),
        "lora_experts": lambda: blocks.LoRAExpertsMoE(hidden=16, ffn=24),
    }


def _container_blocks() -> dict[str, Callable[[], nn.Module]]:
    import blocks

    return {
        "dispatch_mask_container": lambda: blocks.DispatchMaskMoE(hidden=16, ffn=24, num_experts=4, capacity=3),
        "expert_stack_container": lambda: blocks.ExpertStackMoE(hidden=16, ffn=24, num_experts=4, top_k=2),
    }


def _switch_block() -> nn.Module:
    """transformers 5.x ``SwitchTransformersSparseMLP`` with its experts' dropout at 0 (refused at its default
    0.1) and no router jitter (it multiplies the block's input in place, which the leaf input the fuzzer feeds
    refuses in the model's own forward; on a non-leaf input replay is exact: ``test_container_loop_recipe``)."""
    from test_parity_hf import randomize_
    from transformers.models.switch_transformers import modeling_switch_transformers as m

    config = m.SwitchTransformersConfig(d_model=16, d_ff=24, num_experts=4, expert_capacity=2, dropout_rate=0.0,
                                        router_jitter_noise=0.0)
    torch.manual_seed(0)
    block = m.SwitchTransformersSparseMLP(config)
    randomize_(block, 0)
    return block.float().train()


def _nllb_block() -> nn.Module:
    """transformers 5.x ``NllbMoeSparseMLP`` with ``moe_token_dropout=0`` (its default 0.2 replays too, drawn where
    the token is; p=0 keeps the mutants' comparison free of random draws)."""
    from test_parity_hf import randomize_
    from transformers.models.nllb_moe import modeling_nllb_moe as m

    config = m.NllbMoeConfig(d_model=16, num_experts=4, expert_capacity=3, moe_token_dropout=0.0)
    torch.manual_seed(0)
    block = m.NllbMoeSparseMLP(config, 24)
    randomize_(block, 0)
    return block.float().train()


def _llama4_block() -> nn.Module:
    """transformers 5.x ``Llama4TextMoe`` with F=16 != D=32 and top-2 (so a swapped view or a wrong width
    cannot pass on shapes alone)."""
    from test_parity_hf import randomize_
    from transformers.models.llama4 import modeling_llama4

    config = modeling_llama4.Llama4TextConfig(hidden_size=32, intermediate_size=16, intermediate_size_mlp=24,
                                              num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    block = modeling_llama4.Llama4TextMoe(config)
    randomize_(block, 0)
    return block.float().train()


def _equal_groups_block() -> nn.Module:
    from blocks import EqualGroupsMoE

    return EqualGroupsMoE(hidden=16, ffn=24, num_experts=4, top_k=2)


NEW_TARGETS = frozenset({
    "hf/nemotron_h", "hf/inkling2", "hf/openai_privacy_filter", "hf/flint", "hf/phimoe",
    "v4/mistral_inference", "v4/capped_router", "v4/closure", "v5/float32_experts",
    "v4/titan_grouped", "v4/tune_grouped", "v4/aria_grouped", "v4/titan_padded_grouped", "hf/dbrx",
    "hf/muse_spark", "hf/step3p7_limit",
    "v4/llama4_equal_groups", "hf/llama4",
    "v4/sorted_split", "v4/sorted_split_host_counts", "v4/zero_experts", "v4/deepseek_remote",
    "v4/deepseek_remote_eval", "v4/minimind", "v4/expert_dropout_p0",
    "v4/fairseq_local_experts", "v4/sequential_experts", "v4/optional_args_experts", "v4/config_branch_experts",
    "v4/module_dict_experts", "v4/lora_experts", "v5/gemma_style_layer",
    "v4/dense_weights_branch", "v4/inline_gate_branch", "v4/masked_sum",
    "hf/switch_transformers", "hf/nllb_moe", "v4/dispatch_mask_container", "v4/expert_stack_container",
    "v4/selected_rows",
})


# ---------------------------------------------------------------------------------------------
# Sites: the functions a source mutant edits
# ---------------------------------------------------------------------------------------------


def _own_methods_called(cls: type, fn_tree: ast.FunctionDef) -> list[str]:
    """Methods of ``cls`` (defined below ``nn.Module``) that ``fn_tree`` calls on ``self``, in source order."""
    names = []
    for node in ast.walk(fn_tree):
        if isinstance(node, ast.Call) and self_attr(node.func) and self_attr(node.func) not in names:
            attr = self_attr(node.func)
            owner = next((k for k in cls.__mro__ if attr in vars(k)), None)
            if owner is not None and owner is not nn.Module and inspect.isfunction(vars(owner)[attr]):
                names.append(attr)
    return names


@dataclass(frozen=True)
class SourceSite:
    """One function whose source a mutant edits: ``role`` names the object(s), ``method`` the function."""

    role: str
    method: str
    cls: type
    experts_params: tuple[str, ...] = ()  # block sites of batched experts: their forward's parameters
    helper: object = None  # a module-level function ``method`` calls (Aria's GEMM loop): the one edited

    @property
    def function(self):
        return self.helper if self.helper is not None else inspect.unwrap(getattr(self.cls, self.method))

    @property
    def label(self) -> str:
        return f"{self.role}.{self.method}" + (f">{self.helper.__name__}" if self.helper is not None else "")


def _helpers_called(cls: type, method: str) -> list:
    """Module-level Python functions (not torch's) that ``cls.method`` calls by a global name, in source order."""
    fn = inspect.unwrap(getattr(cls, method))
    out = []
    for node in ast.walk(function_tree(fn)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            target = fn.__globals__.get(node.func.id)
            if inspect.isfunction(target) and not (target.__module__ or "").startswith("torch") and target not in out:
                out.append(target)
    return out


def source_sites(block: nn.Module) -> list[SourceSite]:
    """The block forward and its own helpers; the router forward (a router module, not a bare Linear);
    the batched experts forward and its helpers, or the ModuleList expert forward; the forward (and
    helpers) of a model-defined ``act_fn`` the experts call, then of each model-defined class inside it."""
    sites = []
    # experts as 3-D weights of the block (issue 31 item 3) have no container, or one the block never calls
    experts = experts_of(block)
    experts_forward = None if experts is None or is_module_list(block) or type(experts).forward is nn.Module.forward \
        else inspect.unwrap(type(experts).forward)
    params = tuple(a.arg for a in function_tree(experts_forward).args.args[1:]) if experts_forward else ()
    for role in ("block", "router", "experts" if not is_module_list(block) else "expert", *act_roles(block),
                 *experts_sub_roles(block)):
        obj = role_objects(block, role)[0]
        if obj is None or type(obj).__module__.startswith("torch.") or type(obj).forward is nn.Module.forward:
            continue  # a bare nn.Linear gate: torch's own code is not the model's; a weights holder never called
        cls = type(obj)
        extra = params if role == "block" else ()
        tree = function_tree(inspect.unwrap(cls.forward))
        methods = ["forward"] + [m for m in _own_methods_called(cls, tree) if m != "forward"]
        sites += [SourceSite(role, m, cls, extra) for m in methods]
        if role in ("experts", "expert") or role.startswith("experts:"):  # the experts' own module-level helpers
            sites += [SourceSite(role, m, cls, helper=h) for m in methods for h in _helpers_called(cls, m)]
    return sites


def source_mutator(site: SourceSite, edit: Edit) -> Callable[[nn.Module], None]:
    """Re-class the site's objects with a subclass whose ``site.method`` is the edited source (defined
    once, on first use), then apply the edit's run-time tweak to each."""
    cache: dict[str, type] = {}

    def apply(block: nn.Module) -> None:
        if "cls" not in cache and site.helper is not None:
            # The caller unchanged, in a module whose globals hold the edited helper under its own name.
            edited = ast.unparse(ast.fix_missing_locations(edit.tree))
            caller = function_tree(inspect.unwrap(getattr(site.cls, site.method)))
            cache["cls"] = with_method(site.cls, site.method, caller, f"{edit.prelude}\n{edited}")
        if "cls" not in cache:
            cache["cls"] = with_method(site.cls, site.method, edit.tree, edit.prelude, edit.closure)
        for obj in role_objects(block, site.role):
            obj.__class__ = cache["cls"]
            if edit.tweak is not None:
                edit.tweak(obj)

    if edit.around is not None:  # the edited module's globals: those of the method the mutant class defines
        apply.around = lambda: edit.around(inspect.unwrap(getattr(cache["cls"], site.method)).__globals__)
    apply.after_apply = edit.after_apply
    return apply


# ---------------------------------------------------------------------------------------------
# Enumeration
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutant:
    name: str  # "<target>/<role>.<method>/<operator>#<location>" or "<target>/<role>/<operator>"
    target: Target
    operator: str
    mutate: Callable[[nn.Module], None] = field(compare=False, repr=False)

    def around(self):
        """The process-wide state a run-time operator keeps active around each forward/backward (a patch, a
        mode, a global hook: ``mutation_runtime._AROUND``); a no-op context otherwise."""
        make = getattr(self.mutate, "around", None)
        return make() if make is not None else contextlib.nullcontext()

    def after_apply(self, block: nn.Module) -> nn.Module:
        """``block`` after what the user does once the plan is applied (a dropout raised, a hook registered:
        ``mutate.after_apply``), done to the reference and to the EP copy alike; unchanged otherwise."""
        change = getattr(self.mutate, "after_apply", None)
        if change is not None:
            change(block)
        return block

    def build(self) -> nn.Module:
        block = self.target.build()
        self.mutate(block)
        return block


def target_mutants(target: Target, names: set[str] | None = None) -> list[Mutant]:
    """The target's mutants in their fixed order: site x source operator x location, then run-time. ``names``: only
    those, enumerated alone (a name fixes its site, operator and location: the same mutants, the same numbering)."""
    block = target.build()
    out = []
    operators = SOURCE_OPERATORS | (REPLAY_OPERATORS if target.replay else {}) \
        | (BLOCK_WEIGHT_OPERATORS if target.block_weights else {})
    # NOTE: "<site or role>/<operator>" of each wanted name: every other operator is skipped, its edits unbuilt
    # (enumerating a replay target's every mutant took 40% of a 2-rank soundness run's time in each rank).
    kept = None if names is None else {n[len(target.name) + 1:].split("#")[0] for n in names
                                       if n.startswith(target.name + "/")}
    for site in source_sites(block):
        tree = function_tree(site.function)
        for op_name, op in operators.items():
            if kept is not None and f"{site.label}/{op_name}" not in kept:
                continue
            for k, edit in enumerate(op(tree, site)):
                name = f"{target.name}/{site.label}/{op_name}#{k}"
                out.append(Mutant(name, target, op_name, source_mutator(site, edit)))
    for role in roles_of(block):
        for op_name, op in RUNTIME_OPERATORS.items():
            if kept is not None and f"{role}/{op_name}" not in kept:
                continue
            mutate = op(block, role)
            if mutate is not None:
                out.append(Mutant(f"{target.name}/{role}/{op_name}", target, op_name, mutate))
    return out


@functools.lru_cache(maxsize=1)
def all_mutants() -> tuple[Mutant, ...]:
    return tuple(m for t in targets() for m in target_mutants(t))


def unmodified(target: Target) -> Mutant:
    """The target as written (a control: it must be accepted and exact)."""
    return Mutant(f"{target.name}/unmodified", target, "none", lambda block: None)


def mutants_by_name(names) -> list[Mutant]:
    """The named mutants (or ``<target>/unmodified``), enumerating only their targets."""
    wanted = {n.rsplit("/", 2)[0] if not n.endswith("/unmodified") else n.rsplit("/", 1)[0] for n in names}
    every = targets() + (replay_targets() if any(w.startswith("replay/") for w in wanted) else []) + (
        mode_targets() if any(w.startswith("mode/") for w in wanted) else [])
    index = {m.name: m for t in every if t.name in wanted for m in [unmodified(t), *target_mutants(t, set(names))]}
    return [index[n] for n in names]


def sample(mutants, every: int, offset: int = 0) -> list[Mutant]:
    """Every ``every``-th mutant of each target, from its ``offset``-th: fixed, and every target is covered."""
    out = []
    for _, group in itertools.groupby(mutants, key=lambda m: m.target.name):
        out += list(group)[offset::every]
    return out


# ---------------------------------------------------------------------------------------------
# One forward/backward and the comparison
# ---------------------------------------------------------------------------------------------


@dataclass
class Run:
    """What one forward/backward produced: outputs, grad wrt the input, every parameter's grad."""

    outputs: tuple
    x_grad: torch.Tensor
    grads: dict


def inputs(block: nn.Module, batch: int = BATCH) -> torch.Tensor:
    """(batch, SEQ, hidden), fixed; a flat target sees it as (batch * SEQ, hidden) (``forward_backward``)."""
    router = router_of(block)  # torchtune, DBRX: the gate is a Linear inside the router
    router = block if router is None else router  # no router (VitPose-style ids): its first Linear reads hidden
    weight = getattr(router, "weight", None)
    weight = weight if weight is not None else next(m.weight for m in router.modules() if isinstance(m, nn.Linear))
    hidden = weight.shape[-1]
    return torch.randn(batch, SEQ, hidden, generator=torch.Generator().manual_seed(7))


def cotangent(i: int, t: torch.Tensor) -> torch.Tensor:
    """The output cotangent of output ``i``: fixed per output position and shape."""
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(t.numel(), generator=g).reshape(t.shape).to(t.dtype)


def forward_backward(block: nn.Module, x: torch.Tensor, seed: int, flat: bool = False) -> Run:
    """The block's forward on ``x`` (RNG seeded: jitter and sampling draws match) and the backward of a
    loss that uses every returned float tensor. ``flat``: the block gets ``x`` as (tokens, hidden)."""
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out = block(x.reshape(-1, x.shape[-1]) if flat else x)
    outputs = out if isinstance(out, tuple) else (out,)
    terms = [(o * cotangent(i, o)).sum() for i, o in enumerate(outputs)
             if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad]
    if terms:
        sum(terms).backward()
    x_grad = x.grad if x.grad is not None else torch.zeros_like(x)
    return Run(tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs), x_grad, param_grads(block))


def param_grads(block: nn.Module) -> dict:
    """Every parameter's grad by its name in the model's own layout (tied names listed each): stacked
    ModuleList experts written back per expert, DTensor grads gathered (a collective on several ranks)."""
    from autoep.runtime.recipes.local_experts import GROUP, gather_experts, spec_of

    grads = {}
    for name, p in block.named_parameters(remove_duplicate=False):
        g = p.grad
        if hasattr(p, "full_tensor"):  # a rank without a grad still joins the gather, with zeros
            g = (g if g is not None else torch.zeros_like(p)).full_tensor()  # NOTE: collective over ep
        grads[name] = g
    # ModuleList/ModuleDict experts: each expert's grad from the rank owning it. They are placed on the block, or
    # on their container where its own forward is the loop (Switch, NLLB).
    for prefix, holder in block.named_modules():
        if spec_of(holder) is not None:
            has_grad = any(p.grad is not None for p in holder.get_submodule(spec_of(holder).path).parameters())
            if spec_of(holder).ep_size > 1:  # a rank whose experts all stayed idle has none: any rank's counts
                flag = torch.tensor([float(has_grad)])
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX,
                                             group=getattr(holder, GROUP).value)  # NOTE: collective over ep
                has_grad = bool(flag.item())
            per_expert = gather_experts(holder, grad=True)  # NOTE: collective over ep
            per_expert = {".".join(p for p in (prefix, n) if p): g for n, g in per_expert.items()}
            grads |= {n: g if has_grad else None for n, g in per_expert.items() if n in grads}
    return grads


def differences(ref: Run, got: Run, **tol) -> list[str]:
    """Every way ``got`` differs from ``ref`` (outputs, input grad, parameter grads; None grad = zeros); ``tol``:
    ``assert_close`` tolerances other than fp32's defaults."""
    out = []
    if len(ref.outputs) != len(got.outputs):
        return [f"returns {len(got.outputs)} values, the block's own forward {len(ref.outputs)}"]
    pairs = [(f"output {i}", a, b) for i, (a, b) in enumerate(zip(ref.outputs, got.outputs))]
    pairs.append(("input grad", ref.x_grad, got.x_grad))
    if ref.grads.keys() != got.grads.keys():
        out.append(f"parameters differ: {sorted(ref.grads.keys() ^ got.grads.keys())[:4]}")
    for n in sorted(ref.grads.keys() & got.grads.keys()):
        a, b = ref.grads[n], got.grads[n]
        if a is None and b is None:
            continue
        a, b = (a if a is not None else torch.zeros_like(b)), (b if b is not None else torch.zeros_like(a))
        pairs.append((f"grad of {n}", a, b))
    for what, a, b in pairs:
        why = _mismatch(a, b, **tol)
        if why:
            out.append(f"{what}: {why}")
    return out


def _mismatch(a, b, **tol) -> str:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return "" if a == b else f"{a!r} != {b!r}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(b.shape)} {b.dtype} vs {tuple(a.shape)} {a.dtype}"
    try:
        # NaN where the block's own forward has NaN is the same value (a mutant whose norm takes rsqrt of a
        # negative mean): exact, not wrong; a NaN anywhere else still differs.
        torch.testing.assert_close(b, a, equal_nan=True, **tol)
    except AssertionError:
        return f"max abs diff {(b.double() - a.double()).abs().max().item():.3g}"
    return ""


# ---------------------------------------------------------------------------------------------
# Evaluation of one mutant in one process (ep_mesh=None)
# ---------------------------------------------------------------------------------------------

VERDICTS = ("refused", "accepted_exact", "accepted_wrong", "crash", "invalid")


@dataclass
class Outcome:
    name: str
    target: str
    operator: str
    verdict: str
    detail: str = ""


def short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"


def detect(block: nn.Module, replay: bool = False):
    """``(structure, None)``, ``(None, "refused: ...")`` or ``(None, "crash: ...")``; the table lookup is part
    of detection (a structure without a recipe is a refusal), except for row-local experts while no recipe runs
    them yet: those are held to the simulated own forward (``own_forward_sim``)."""
    try:
        structure = detect_moe_structure(block, replay=replay)
        if structure.expert_kind in RUNNABLE_EXPERT_KINDS:
            compute_fn_config(structure)
        return structure, None
    except UnsupportedModuleStructure as exc:
        return None, f"refused: {exc.reason if hasattr(exc, 'reason') else exc}"
    except Exception:  # noqa: BLE001 - the verdict: the detector raised something else
        return None, "crash: " + traceback.format_exc(limit=-3).strip().replace("\n", " | ")[-400:]


def own_forward_sim(block: nn.Module, structure) -> nn.Module:
    """What running row-local experts as themselves computes, in one process: a deep copy of ``block`` whose
    every expert runs its own forward on its rows one at a time, last row first (another grouping and order
    of the same rows, as an exchange gives them). Equal to the block's own forward exactly when each expert
    is row-local, deterministic and stateless: the oracle for ``expert_kind="row_local"`` until the own-forward
    runtime (issue 16 item 1) adds the kind to ``RUNNABLE_EXPERT_KINDS`` and ``make_ep`` runs it instead."""
    ep = copy.deepcopy(block)
    container = ep.get_submodule(structure.experts_path)
    for expert in (container.values() if isinstance(container, nn.ModuleDict) else container):
        expert.forward = _rows_one_at_a_time(expert)
    return ep


def _rows_one_at_a_time(expert: nn.Module):
    own = type(expert).forward

    def forward(x, *args, **kwargs):
        if x.shape[0] <= 1:
            return own(expert, x, *args, **kwargs)
        outs = [own(expert, x[i:i + 1], *args, **kwargs) for i in reversed(range(x.shape[0]))]
        return torch.cat(outs[::-1])

    return forward


class ApplyRefused(Exception):
    """``apply_plan``'s run-time-state checks (``autoep.runtime.live_state``) refused the block: a refusal."""


def make_ep(block: nn.Module, structure, ep_mesh) -> nn.Module:
    """A deep copy of ``block`` made expert-parallel in place by the recipe the table names, with the
    run-time-state checks ``apply_plan`` makes around it (their refusal raises ``ApplyRefused``); row-local
    experts no recipe runs yet: ``own_forward_sim``."""
    from autoep.runtime import live_state
    from autoep.runtime.apply import shard_experts

    ep = copy.deepcopy(block)
    path = structure.experts_path
    try:
        live_state.check_model(ep, {"": ep}, {"": path})
        held = live_state.before_block(ep, "block", path)
    except UnsupportedModuleStructure as exc:
        raise ApplyRefused(exc.reason) from None
    if structure.expert_kind not in RUNNABLE_EXPERT_KINDS:
        return own_forward_sim(block, structure)
    cfg = dict(compute_fn_config(structure))
    module, _, attr = cfg.pop("_factory_").rpartition(".")
    factory = getattr(importlib.import_module(module), attr)
    if ep_mesh is not None:
        shard_experts(ep, ep_mesh, dense=live_state.dense_params_of(cfg))  # as ``apply_plan``: the experts' own dense
    factory(ep, ep_mesh=ep_mesh, **cfg)
    try:
        live_state.after_block(ep, "block", held, path)
    except UnsupportedModuleStructure as exc:
        raise ApplyRefused(exc.reason) from None
    return ep


def evaluate(mutant: Mutant) -> Outcome:
    """The mutant's verdict in this process: detect, run its own forward/backward, run the recipe's, compare."""
    verdict = functools.partial(Outcome, mutant.name, mutant.target.name, mutant.operator)
    try:
        block = mutant.build()
    except Exception as exc:  # noqa: BLE001 - a mutant that cannot even be built is not a test
        return verdict("invalid", "build: " + short_error(exc))
    structure, why = detect(block, mutant.target.replay)
    if why and why.startswith("crash"):
        return verdict("crash", why)
    x, flat = inputs(block), mutant.target.flat
    try:
        with mutant.around():
            ref = forward_backward(mutant.after_apply(copy.deepcopy(block)), x, seed=100, flat=flat)
    except Exception as exc:  # noqa: BLE001 - the mutant's own code does not run
        return verdict("invalid", "own forward: " + short_error(exc))
    if why:
        return verdict("refused", why[len("refused: "):])
    try:
        ep = make_ep(block, structure, None)
    except ApplyRefused as exc:
        return verdict("refused", f"at apply: {exc}")
    except Exception as exc:  # noqa: BLE001 - accepted, and the EP path fails
        return verdict("accepted_wrong", "EP path raised " + short_error(exc))
    try:
        with mutant.around():
            got = forward_backward(mutant.after_apply(ep), x, seed=100, flat=flat)
    except (LiveStateError, FactChanged, ReplayError) as exc:  # process-wide state the fast path would not honour, or a value
        return verdict("refused", f"at forward: {exc}")  # proven at apply changed since: named, before any work
    except Exception as exc:  # noqa: BLE001 - accepted, and the EP path fails
        return verdict("accepted_wrong", "EP path raised " + short_error(exc))
    # bf16 mutants at one bf16 ulp in one process too (``mutation_ranks.LOW_PRECISION``): an expert called more than
    # once in a forward runs one GEMM over every call's rows on its owner, where the model runs one per call.
    from mutation_ranks import _tolerance

    diffs = differences(ref, got, **(_tolerance(mutant) or {}))
    if diffs and reads_uninitialised(block, x, flat):
        return verdict("invalid", "own forward returns uninitialised memory (rows of an empty tensor it never "
                                  "writes): no value to compare against")
    return verdict("accepted_wrong", "; ".join(diffs[:3])) if diffs else verdict("accepted_exact")


class FilledEmpties(TorchDispatchMode):
    """Every tensor an ``empty`` op returns filled with ``value`` (0: not NaN). With ``fill_uninitialized_memory``'s
    NaN run it makes ``reads_uninitialised`` a function of the block and input alone: a plain run instead reads
    whatever the allocator hands back, and in a process that already ran the NaN check (any earlier mutant's) that
    can be NaN in exactly the rows the block never writes, so the two runs agreed and an uninitialised read was
    judged a real difference (``v4/deepseek_remote/router/call_override`` was accepted_wrong in one test run)."""

    EMPTIES = frozenset({torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
                         torch.ops.aten.new_empty.default, torch.ops.aten.empty_strided.default,
                         torch.ops.aten.new_empty_strided.default})

    def __init__(self, value: float = 0.0):
        super().__init__()
        self.value = value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.EMPTIES and isinstance(out, torch.Tensor):
            out.fill_(self.value)
        return out


def reads_uninitialised(block: nn.Module, x: torch.Tensor, flat: bool) -> bool:
    """The block's own outputs or grads are NaN when torch fills uninitialised memory with NaN and finite when
    every empty tensor starts at 0 (``FilledEmpties``): they are garbage (DeepSeek's ``torch.empty_like`` rows
    that no expert writes when a mutant's ids match none), so there is no value to compare an EP run against.
    Neither run reads memory left by earlier work, so the answer does not depend on what ran before in this
    process (nor differs between ranks); a NaN the block computes (rsqrt of a negative mean) is in both."""
    fill = torch.utils.deterministic.fill_uninitialized_memory
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False
        with FilledEmpties(0.0):
            zeroed = forward_backward(copy.deepcopy(block), x, seed=100, flat=flat)
        torch.utils.deterministic.fill_uninitialized_memory = True
        filled = forward_backward(copy.deepcopy(block), x, seed=100, flat=flat)
    except Exception:  # noqa: BLE001 - an op without a deterministic kernel: no evidence either way
        return False
    finally:
        torch.use_deterministic_algorithms(was)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    return any(isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_floating_point()
               and bool((b.isnan() & ~a.isnan()).any()) for a, b in zip(_tensors(zeroed), _tensors(filled)))


def _tensors(run: Run) -> list:
    """A run's outputs, input grad and parameter grads (by name), in one fixed order."""
    return [*run.outputs, run.x_grad, *(run.grads[n] for n in sorted(run.grads))]


def evaluate_all(mutants) -> list[Outcome]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the fuzzer shares small machines; its tensors are tiny
    try:
        return [evaluate(m) for m in mutants]
    finally:  # not the process's setting for what runs after (a pytest session's later tests)
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# Counting
# ---------------------------------------------------------------------------------------------


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    c = {"mutants": len(outcomes)} | {v: 0 for v in VERDICTS}
    for o in outcomes:
        c[o.verdict] += 1
    return c


def summary_line(label: str, outcomes: list[Outcome]) -> str:
    """``label: mutants=… refused=… accepted_exact=… accepted_wrong=… crashes=… invalid=…``."""
    c = counts(outcomes)
    return (f"{label}: mutants={c['mutants']} refused={c['refused']} accepted_exact={c['accepted_exact']} "
            f"accepted_wrong={c['accepted_wrong']} crashes={c['crash']} invalid={c['invalid']}")
