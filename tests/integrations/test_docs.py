"""docs/integrations.md: every snippet runs. The plain-loop snippet trains on 2 gloo ranks with EP and on one
process without it; both end where one process training on the same batches ends (SGD, clipped)."""
from __future__ import annotations

import copy
import re
from pathlib import Path

import torch
from distributed import guarded, run_cases
from test_handle import PLAN, STEPS, batch, full, reference_run, tiny_moe

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def snippets(heading: str) -> list[str]:
    """The ```python blocks of the ``## heading`` section."""
    text = DOC.read_text()
    section = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert section, f"docs/integrations.md has no section '## {heading}'"
    return re.findall(r"^```python\n(.*?)^```", section.group(1), flags=re.M | re.S)


def plain_loop(rank: int, world: int, run_dir: str):
    (code,) = snippets("A plain torchrun loop")
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)  # noqa: S102 - the documented snippet, as a user runs it
    model = tiny_moe()
    ref = copy.deepcopy(model)
    chunks = [batch(step, world)[rank] for step in range(STEPS)] if world > 1 else [
        torch.cat(batch(step, 2)) for step in range(STEPS)]
    ep, opt = scope["train"](model, {"ep_size": world, "plan": PLAN}, chunks, run_dir)
    reference_run(ref, 2, clip=1.0)  # the same global batches: two halves, mean loss
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full(dict(model.named_parameters())[name]).detach(), p.detach(),
                                   msg=lambda m: f"{name}: {m}")
    assert (Path(run_dir) / "resolved.yaml").is_file() and (Path(run_dir) / "checkpoint" / ".metadata").is_file()


def doc_cases(rank, world, tmp):
    results = {}
    guarded(results, "plain_loop", plain_loop, rank, world, tmp)
    return results


def test_plain_loop_snippet_on_two_ranks(tmp_path):
    errors = run_cases(2, "test_docs:doc_cases", str(tmp_path))["plain_loop"]
    assert not errors, "\n".join(errors)


def test_plain_loop_snippet_on_one_process(tmp_path):
    plain_loop(0, 1, str(tmp_path))
