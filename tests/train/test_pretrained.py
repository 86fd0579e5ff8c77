"""Loading a local HF checkpoint (``model=hf_pretrained model.pretrained_path=...``): at ep_size=2 on 2 gloo
ranks the model computes what ``AutoModelForCausalLM.from_pretrained(path)`` computes in one process, every
rank reads only its own experts' rows, tied weights stay tied, and a bad directory is refused by name.

Checkpoints are written by transformers' own ``save_pretrained`` (safetensors, per-expert legacy keys).
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from distributed import spawn
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from autoep.train import pretrained
from autoep.train.config import CONF_DIR
from autoep.train.data import Loader, SyntheticBigram
from autoep.train.loop import causal_lm_loss
from autoep.train.pretrained import PretrainedError

TINY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_experts_per_tok=2)
CHECKPOINTS = {
    # Qwen3-MoE with tied embeddings: save_pretrained writes mlp.experts.{e}.{gate,up,down}_proj.weight.
    "qwen3_moe_tied": lambda: Qwen3MoeConfig(**TINY, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
                                             tie_word_embeddings=True),
    # Mixtral: block_sparse_moe.experts.{e}.w1/w2/w3.weight, renamed and merged by the conversion mapping.
    "mixtral": lambda: MixtralConfig(**TINY, intermediate_size=16, head_dim=8, num_local_experts=4),
}
TRAIN = ["model=hf_pretrained", "trainer.steps=2", "optim.warmup_steps=1", "data.seq_len=16", "trainer.device=cpu",
         "trainer.log_every=100"]


def compose_cfg(*overrides: str):
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        return compose("train", overrides=list(overrides))


def tokens() -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))


def load_worker(rank: int, world_size: int, paths: dict, tmp: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from autoep.train.trainer import build_model, train

    reads = []
    real_read = pretrained.SafetensorsDir.read

    def recording_read(self, key, rows=None):
        reads.append((key, None if rows is None else (rows.start, rows.stop)))
        return real_read(self, key, rows)

    pretrained.SafetensorsDir.read = recording_read
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("autoep.train.pretrained").addHandler(handler)
    logging.getLogger("autoep.train.pretrained").setLevel(logging.INFO)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("edp", "ep"))
    out = {}
    for name, path in paths.items():
        reads.clear()
        logged.clear()
        model, _ = build_model(compose_cfg("model=hf_pretrained", f"model.pretrained_path={path}", "parallel.ep_size=2"),
                               mesh, torch.device("cpu"))
        model.eval()
        with torch.no_grad():
            out[name] = {"logits": model(input_ids=tokens()).logits, "reads": list(reads), "logged": list(logged),
                         "tied": model.lm_head.weight is model.get_input_embeddings().weight}
    pretrained.SafetensorsDir.read = real_read
    result = train(compose_cfg(*TRAIN, f"model.pretrained_path={paths['qwen3_moe_tied']}", "parallel.ep_size=2",
                               "data.batch_size=2", f"run_dir={tmp}/ep2"))
    out["losses"] = result["losses"]
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    paths = {}
    for name, make_config in CHECKPOINTS.items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(make_config()).save_pretrained(root / name)
        paths[name] = str(root / name)
    return root, paths


@pytest.fixture(scope="module")
def ep2(checkpoints):
    root, paths = checkpoints
    return spawn(2, "test_pretrained:load_worker", paths, str(root))


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_ep2_load_computes_what_from_pretrained_computes(checkpoints, ep2, name):
    _, paths = checkpoints
    ref = AutoModelForCausalLM.from_pretrained(paths[name]).eval()
    with torch.no_grad():
        expected = ref(input_ids=tokens()).logits
    for rank in (0, 1):
        torch.testing.assert_close(ep2[rank][name]["logits"], expected)
    assert all(r[name]["tied"] for r in ep2) == ref.config.tie_word_embeddings


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_each_rank_reads_only_its_own_experts_and_logs_what_it_read(checkpoints, ep2, name):
    num_experts = CHECKPOINTS[name]().num_local_experts if name == "mixtral" else CHECKPOINTS[name]().num_experts
    half = num_experts // 2
    for rank in (0, 1):
        reads = ep2[rank][name]["reads"]
        [line] = ep2[rank][name]["logged"]
        assert f"read {len(reads)} checkpoint tensors" in line and "MiB" in line
        assert f"experts {rank * half}-{(rank + 1) * half - 1} of {num_experts} (this rank's own)" in line
        read_experts = {int(key.split(".experts.")[1].split(".")[0]) for key, _ in ep2[rank][name]["reads"]
                        if ".experts." in key}
        assert read_experts == set(range(rank * half, (rank + 1) * half))
        dense = [key for key, rows in ep2[rank][name]["reads"] if ".experts." not in key]
        assert "model.embed_tokens.weight" in dense and all(rows is None for _, rows in ep2[rank][name]["reads"])


def test_trained_from_checkpoint_ep2_equals_single_process_and_from_pretrained(checkpoints, ep2, tmp_path):
    from autoep.train.trainer import train

    _, paths = checkpoints
    path = paths["qwen3_moe_tied"]
    single = train(compose_cfg(*TRAIN, f"model.pretrained_path={path}", "data.batch_size=4", f"run_dir={tmp_path}"))
    torch.testing.assert_close(torch.tensor(ep2[0]["losses"]), torch.tensor(single["losses"]))
    ref = AutoModelForCausalLM.from_pretrained(path)
    batch = Loader(SyntheticBigram(TINY["vocab_size"], 16, seed=0), batch_size=4, rank=0, world_size=1).next()
    with torch.no_grad():
        first = causal_lm_loss(ref.train(), batch).item()
    assert single["losses"][0] == pytest.approx(first, rel=1e-5)


def test_batched_keys_are_read_as_row_slices(tmp_path):
    """A checkpoint already in the v5 batched layout: the expert rows come from get_slice, not a full read."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CHECKPOINTS["qwen3_moe_tied"]())
    model.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ckpt = pretrained.SafetensorsDir(tmp_path)
    key = "model.layers.1.mlp.experts.gate_up_proj"
    assert ckpt.read(key, slice(4, 8)).shape == (4, 32, 32)
    torch.testing.assert_close(ckpt.read(key, slice(4, 8)), state[key][4:8])
    from autoep.train.trainer import build_model

    loaded, _ = build_model(
        compose_cfg("model=hf_pretrained", f"model.pretrained_path={tmp_path}"), None, torch.device("cpu"))
    for name, p in model.named_parameters():
        torch.testing.assert_close(loaded.get_parameter(name), p)


def test_bad_directories_are_refused_by_name(checkpoints, tmp_path):
    from autoep.train.trainer import build_model

    _, paths = checkpoints
    with pytest.raises(PretrainedError, match="model.pretrained_path is required"):
        build_model(compose_cfg("model=hf_pretrained"), None, torch.device("cpu"))
    with pytest.raises(PretrainedError, match="no \\*.safetensors"):
        pretrained.SafetensorsDir(tmp_path)
    with pytest.raises(PretrainedError, match="not a directory"):
        pretrained.SafetensorsDir(tmp_path / "nope")
    with pytest.raises(PretrainedError, match=r"model.pretrained_path=/no/such/ckpt: /no/such/ckpt does not exist"):
        build_model(compose_cfg("model=hf_pretrained", "model.pretrained_path=/no/such/ckpt"), None, torch.device("cpu"))
    # An architecture override the checkpoint does not fit: refused naming the tensor and both shapes.
    cfg = compose_cfg("model=hf_pretrained", f"model.pretrained_path={paths['qwen3_moe_tied']}",
                      "+model.moe_intermediate_size=8")
    with pytest.raises(PretrainedError, match=r"gate_proj.weight has shape \(16, 32\), the model expects \(8, 32\)"):
        build_model(cfg, None, torch.device("cpu"))


def test_pretrained_path_is_local_only(checkpoints, tmp_path, monkeypatch):
    """A Hub-like id is refused before transformers is asked; an existing relative path is read from the working
    directory, and transformers only ever gets an absolute local directory with local_files_only=True."""
    import transformers

    from autoep.train.models import build_hf_pretrained

    root, paths = checkpoints
    asked = []
    real = transformers.AutoConfig.from_pretrained

    def recording(path, **kwargs):
        asked.append((path, kwargs.get("local_files_only")))
        return real(path, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", recording)
    with pytest.raises(PretrainedError, match=r"model.pretrained_path=Qwen/Qwen3-30B-A3B: .* does not exist; it looks "
                                              r"like a Hub repo id, and autoep reads local directories only"):
        build_hf_pretrained("Qwen/Qwen3-30B-A3B")
    monkeypatch.chdir(root)
    model = build_hf_pretrained("mixtral")  # relative to the working directory
    assert type(model).__name__ == "MixtralForCausalLM" and asked == [(str(root / "mixtral"), True)]
    with pytest.raises(PretrainedError, match="holds no config.json"):
        build_hf_pretrained(str(tmp_path))


@pytest.mark.parametrize("keep", [lambda n: 10, lambda n: n // 2, lambda n: n - 4], ids=["header", "half", "last-bytes"])
def test_truncated_safetensors_is_one_line_error(checkpoints, tmp_path, keep):
    import shutil

    _, paths = checkpoints
    damaged = Path(shutil.copytree(paths["mixtral"], tmp_path / "ckpt"))
    file = damaged / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: keep(len(data))])
    with pytest.raises(PretrainedError, match=r"model.safetensors is not a readable safetensors file .*truncated or "
                                              r"damaged; re-download or re-save the checkpoint") as info:
        pretrained.SafetensorsDir(damaged)
    assert "\n" not in str(info.value)
