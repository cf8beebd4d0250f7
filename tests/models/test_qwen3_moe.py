"""Qwen3-MoE: config, the grouped expert computation, both weight layouts, parity with
transformers, the engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import PROMPTS, hf_greedy, hf_model, our_greedy, prompt_logits
from safetensors.torch import load_file, save_file

from nanoqwen import LLM, ConfigError, SamplingParams, WeightsError
from nanoqwen.config.model import Qwen3Config
from nanoqwen.layers.experts import Experts
from nanoqwen.model_loader.init_random import ASSETS, checkpoint_shapes, preset_config, write_random_model
from nanoqwen.models.qwen3 import MLP, SparseMoeBlock, experts_reference

PROMPT = [9707, 11, 847, 829, 374, 1207, 16948, 13, 358, 1075, 311, 3270, 2038, 304, 13027, 323,
          8257, 13]
OFFICIAL_MOE = ASSETS / "configs" / "Qwen3-30B-A3B.json"

# Small MoE configs (names are test ids), on top of the qwen3-moe-tiny preset: 8 experts, top-2,
# 3 layers, layer 1 a dense MLP (mlp_only_layers=[1]), norm_topk_prob true.
MOE_SHAPES = {
    "mlp-only-norm": {},
    # decoder_sparse_step 2: layers 1 and 3 sparse, 0 and 2 dense; top-3 of 6; no renormalisation;
    # tied head
    "sparse-step-no-norm": dict(num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2,
                                num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                                tie_word_embeddings=True),
}


def moe_config(**overrides) -> dict:
    return {**preset_config("qwen3-moe-tiny"), **overrides}


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory):
    """moe_checkpoint(name, fused=False, dtype="float32") -> folder, written once per session
    (weights N(0, 0.08))."""
    cache: dict[tuple, Path] = {}

    def make(name: str, fused: bool = False, dtype: str = "float32") -> Path:
        key = (name, fused, dtype)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{name}-{'fused' if fused else 'per-expert'}")
            cache[key] = write_random_model(out, moe_config(**MOE_SHAPES[name]), dtype=dtype,
                                            std=0.08, fused_experts=fused)
        return cache[key]

    return make


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of model folder src whose tensors are edit(tensors)."""
    shutil.copytree(src, dst)
    tensors = edit(file_tensors(src))
    for f in dst.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def fuse(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official per-expert tensors -> transformers 5's stacked names (built here
    by hand, independently)."""
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    layers = {k.split(".mlp.experts.")[0] for k in tensors if ".mlp.experts." in k}
    for p in layers:
        n = 1 + max(int(k[len(p):].split(".")[3]) for k in tensors
                    if k.startswith(p + ".mlp.experts."))
        e = [f"{p}.mlp.experts.{j}." for j in range(n)]
        out[f"{p}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[x + "gate_proj.weight"], tensors[x + "up_proj.weight"]])
             for x in e])
        out[f"{p}.mlp.experts.down_proj"] = torch.stack([tensors[x + "down_proj.weight"]
                                                         for x in e])
    return out


# ---------------------------------------------------------------- config


def test_official_qwen3_30b_a3b_config():
    cfg = Qwen3Config.from_file(OFFICIAL_MOE)
    assert cfg.is_moe and cfg.architectures == ("Qwen3MoeForCausalLM",)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 8, 768)
    assert cfg.norm_topk_prob is True and cfg.decoder_sparse_step == 1 and cfg.mlp_only_layers == ()
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads) == (48, 2048, 32, 4)
    assert all(cfg.is_moe_layer(i) for i in range(48))
    d = cfg.to_dict()
    assert Qwen3Config.from_dict(d) == cfg and d["model_type"] == "qwen3_moe"
    raw = json.loads(OFFICIAL_MOE.read_text())
    keys = ["architectures", "model_type", "num_experts", "num_experts_per_tok",
            "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
            "intermediate_size", "router_aux_loss_coef", "output_router_logits",
            "max_window_layers", "tie_word_embeddings", "rope_theta", "head_dim"]
    assert {k: d[k] for k in keys} == {k: raw[k] for k in keys}


def test_config_as_transformers5_writes_it(tmp_path):
    """transformers 5 renames num_experts to num_local_experts and writes rope_parameters: same
    config."""
    transformers = pytest.importorskip("transformers")
    transformers.AutoConfig.from_pretrained(OFFICIAL_MOE).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["num_local_experts"] == 128 and "num_experts" not in raw and "rope_parameters" in raw
    assert Qwen3Config.from_dict(raw) == Qwen3Config.from_file(OFFICIAL_MOE)


def test_dense_configs_are_unchanged():
    dense = Qwen3Config.from_dict(dict(preset_config("tiny"), num_experts=8, num_experts_per_tok=2))
    assert (not dense.is_moe and dense.num_experts == 0
            and not any(dense.is_moe_layer(i) for i in range(2)))
    assert not any(k in dense.to_dict()
                   for k in ("num_experts", "mlp_only_layers", "norm_topk_prob"))


@pytest.mark.parametrize("layers,step,only", [(3, 1, [1]), (4, 2, []), (6, 3, [2, 5]),
                                              (4, 1, [0, 1, 2, 3]), (5, 2, [0])])
def test_is_moe_layer_follows_transformers(layers, step, only):
    transformers = pytest.importorskip("transformers")
    raw = moe_config(num_hidden_layers=layers, decoder_sparse_step=step, mlp_only_layers=only)
    cfg = Qwen3Config.from_dict(raw)
    with torch.device("meta"):
        ref = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{
            k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype")}))
    expected = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in ref.model.layers]
    assert [cfg.is_moe_layer(i) for i in range(layers)] == expected
    from nanoqwen.models.qwen3 import DecoderLayer
    with torch.device("meta"):
        ours = [DecoderLayer(cfg, i).mlp for i in range(layers)]
    assert [isinstance(m, SparseMoeBlock) for m in ours] == expected
    assert all(isinstance(m, MLP) for m, e in zip(ours, expected, strict=True) if not e)


@pytest.mark.parametrize("overrides,match", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 must not exceed num_experts=8"),
    (dict(num_experts=None), "required field 'num_experts' is missing"),
    (dict(num_experts_per_tok=None), "required field 'num_experts_per_tok' is missing"),
    (dict(moe_intermediate_size=None), "required field 'moe_intermediate_size' is missing"),
    (dict(num_experts=0), "'num_experts' must be a positive integer"),
    (dict(num_experts_per_tok=0), "'num_experts_per_tok' must be a positive integer"),
    (dict(moe_intermediate_size=1.5), "'moe_intermediate_size' must be int"),
    (dict(decoder_sparse_step=0), "'decoder_sparse_step' must be a positive integer"),
    (dict(norm_topk_prob="yes"), "'norm_topk_prob' must be true or false"),
    (dict(mlp_only_layers=[3]), r"'mlp_only_layers' must be a list of layer indices in \[0, 3\)"),
    (dict(mlp_only_layers=1), "'mlp_only_layers' must be a list"),
    (dict(num_local_experts=16), "num_experts=8 contradicts num_local_experts=16"),
])
def test_bad_moe_config_names_the_field(overrides, match):
    raw = {k: v for k, v in moe_config(**overrides).items() if v is not None}
    with pytest.raises(ConfigError, match=match) as err:
        Qwen3Config.from_dict(raw, where="m/config.json")
    assert str(err.value).startswith("m/config.json: ")


def test_num_local_experts_alone_is_read():
    raw = {k: v for k, v in moe_config(num_local_experts=8).items() if k != "num_experts"}
    assert Qwen3Config.from_dict(raw).num_experts == 8


# ---------------------------------------------------------------- the expert computation


def naive_experts(x, gate_up, down, ids, weights):
    """A Python loop over tokens and their K experts: the definition with nothing clever."""
    out = torch.zeros_like(x)
    inter = down.shape[-1]
    for n in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[n, k])
            h = torch.nn.functional.silu(gate_up[e, :inter] @ x[n]) * (gate_up[e, inter:] @ x[n])
            out[n] += weights[n, k] * (down[e] @ h)
    return out


def random_experts(num_experts=8, hidden=16, inter=12, seed=0) -> Experts:
    g = torch.Generator().manual_seed(seed)
    cfg = Qwen3Config.from_dict(moe_config(num_experts=num_experts, hidden_size=hidden,
                                           moe_intermediate_size=inter))
    experts = Experts(cfg)
    experts.gate_up_proj.copy_(0.3 * torch.randn(experts.gate_up_proj.shape, generator=g))
    experts.down_proj.copy_(0.3 * torch.randn(experts.down_proj.shape, generator=g))
    return experts


@pytest.mark.parametrize("case", ["one-token", "two-experts-used", "many-tokens", "top-1",
                                  "all-experts"])
def test_grouped_experts_equal_the_per_token_reference(case):
    num_tokens, k = {"one-token": (1, 2), "two-experts-used": (7, 2), "many-tokens": (40, 3),
                     "top-1": (9, 1), "all-experts": (5, 8)}[case]
    experts = random_experts()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, 16, generator=g)
    # k distinct experts per token
    ids = torch.rand(num_tokens, 8, generator=g).argsort(dim=-1)[:, :k]
    if case == "two-experts-used":
        ids = torch.tensor([[6, 1], [1, 6]] * 3 + [[6, 1]])  # experts 0, 2-5 and 7 get no token
    weights = torch.rand(num_tokens, k, generator=g)
    got = experts(x, ids, weights)
    naive = naive_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights)
    torch.testing.assert_close(got, naive, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(experts_reference(x, experts.gate_up_proj, experts.down_proj, ids,
                                                 weights), naive, atol=1e-5, rtol=1e-5)
    assert got.abs().max() > 0.5


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_block_matches_transformers_block(norm, dtype):
    """Routing (ids and weights, bit for bit) and output of one block against transformers' own."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    raw = moe_config(norm_topk_prob=norm, hidden_size=32, moe_intermediate_size=16)
    hf_cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in raw.items()
                                            if k not in ("architectures", "torch_dtype")})
    hf_cfg._experts_implementation = "eager"
    ref = Qwen3MoeSparseMoeBlock(hf_cfg).to(dtype)
    ours = SparseMoeBlock(Qwen3Config.from_dict(raw)).to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in (ref.gate.weight, ref.experts.gate_up_proj, ref.experts.down_proj):
            t.copy_(0.3 * torch.randn(t.shape, generator=g))
        ours.gate.weight.copy_(ref.gate.weight)
        ours.experts.gate_up_proj.copy_(ref.experts.gate_up_proj)
        ours.experts.down_proj.copy_(ref.experts.down_proj)
        x = torch.randn(1, 23, 32, generator=g).to(dtype)
        _, ref_weights, ref_ids = ref.gate(x[0])
        ids, weights = ours.route(x[0])
        assert (torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
                and weights.dtype == dtype)
        assert torch.allclose(weights.float().sum(-1), torch.ones(23), atol=1e-2) == norm
        expected, got = ref(x)[0], ours(x[0])
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:  # the same operations in the same order (experts ascending, weighted in bf16, index_add)
        torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------- parity with transformers


def hf_moe_model(path, dtype):
    model = hf_model(path, dtype)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    return model


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
@pytest.mark.parametrize("shape", list(MOE_SHAPES))
def test_float32_logits_and_greedy_match_transformers(moe_checkpoint, shape, fused):
    path = moe_checkpoint(shape, fused=fused)
    names = file_tensors(path).keys()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in names) == fused
    assert any(k.endswith("mlp.experts.0.gate_proj.weight") for k in names) != fused
    ref = hf_moe_model(path, torch.float32)
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=256)
    model = llm.llm_engine.model
    kinds = {type(layer.mlp) for layer in model.layers}
    assert kinds == {SparseMoeBlock, MLP}  # sparse and dense layers mixed
    with torch.inference_mode():
        expected = ref(torch.tensor([PROMPT])).logits[0].float()
        # the prompt's tokens really spread over the experts
        moe = next(layer for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)).mlp
        ids, _ = moe.route(model.embed_tokens(torch.tensor(PROMPT)))
        assert len(ids.unique()) >= moe.experts.gate_up_proj.shape[0] // 2
    got = prompt_logits(model, PROMPT)
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert our_greedy(llm, PROMPT, 32) == hf_greedy(ref, PROMPT, 32)


def test_bfloat16_greedy_and_logits_close(moe_checkpoint):
    path = moe_checkpoint("mlp-only-norm", dtype="bfloat16")
    ref = hf_moe_model(path, torch.bfloat16)
    llm = LLM(path, dtype="bfloat16", device="cpu", max_model_len=64)
    with torch.inference_mode():
        expected = ref(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(prompt_logits(llm.llm_engine.model, PROMPT), expected, atol=0.1,
                               rtol=0.02)
    assert our_greedy(llm, PROMPT, 8) == hf_greedy(ref, PROMPT, 8)


# ---------------------------------------------------------------- weight layouts


def test_per_expert_layout_is_what_transformers_save_pretrained_writes(moe_checkpoint, tmp_path):
    """transformers 5 holds experts fused, but save_pretrained writes them per expert, as our
    files are."""
    path = moe_checkpoint("mlp-only-norm")
    ref = hf_moe_model(path, torch.float32)
    assert tuple(ref.model.layers[0].mlp.experts.gate_up_proj.shape) == (8, 64, 64)  # [E, 2Ie, H]
    ref.save_pretrained(tmp_path / "saved")
    ours, theirs = file_tensors(path), file_tensors(tmp_path / "saved")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_fused_and_per_expert_files_load_the_same_parameters(moe_checkpoint, tmp_path):
    per_expert = moe_checkpoint("mlp-only-norm")
    fused = rewrite(per_expert, tmp_path / "fused", fuse)
    # one layer fused, the other per expert
    mixed = rewrite(per_expert, tmp_path / "mixed", lambda t: {
        **{k: v for k, v in t.items() if not k.startswith("model.layers.0.mlp.experts.")},
        **{k: v for k, v in fuse(t).items() if k.startswith("model.layers.0.mlp.experts.")}})
    params = [dict(LLM(p, dtype="float32", device="cpu",
                       max_model_len=32).llm_engine.model.named_parameters())
              for p in (per_expert, fused, mixed)]
    assert params[0].keys() == params[1].keys() == params[2].keys()
    assert all(torch.equal(params[0][k], p[k]) for p in params[1:] for k in params[0])
    files = file_tensors(per_expert)
    experts = params[0]["layers.2.mlp.experts.gate_up_proj"]
    assert torch.equal(experts[5, :32], files["model.layers.2.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(experts[5, 32:], files["model.layers.2.mlp.experts.5.up_proj.weight"])
    assert torch.equal(params[0]["layers.2.mlp.experts.down_proj"][3],
                       files["model.layers.2.mlp.experts.3.down_proj.weight"])
    assert torch.equal(params[0]["layers.0.mlp.gate.weight"],
                       files["model.layers.0.mlp.gate.weight"])


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "qwen3-30b-a3b"])
def test_preset_tensor_names_and_shapes_match_transformers(tmp_path, preset):
    """Fused names are transformers' parameters; per-expert names are what its save_pretrained
    writes."""
    transformers = pytest.importorskip("transformers")
    raw = preset_config(preset)
    cfg = Qwen3Config.from_dict(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with torch.device("meta"):
        ref = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(tmp_path))
    assert type(ref).__name__ == "Qwen3MoeForCausalLM"
    fused = dict(checkpoint_shapes(cfg, fused_experts=True))
    assert fused == {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    per_expert = dict(checkpoint_shapes(cfg))
    assert per_expert.keys() - fused.keys() == {
        f"model.layers.{i}.mlp.experts.{j}.{n}_proj.weight" for i in range(cfg.num_hidden_layers)
        if cfg.is_moe_layer(i) for j in range(cfg.num_experts) for n in ("gate", "up", "down")}
    assert per_expert["model.layers.0.mlp.experts.0.down_proj.weight"] == (
        cfg.hidden_size, cfg.moe_intermediate_size)
    if preset == "qwen3-30b-a3b":
        assert (cfg.num_experts, cfg.num_experts_per_tok,
                cfg.moe_intermediate_size) == (128, 8, 768)
        total = sum(torch.Size(s).numel() for s in per_expert.values())
        assert 30.4e9 < total < 30.6e9  # "30.5B in total"


def test_init_random_moe_preset_from_the_command_line(tmp_path, capsys):
    from nanoqwen.entrypoints.cli import main

    assert main(["init-random", str(tmp_path / "m"), "--preset", "qwen3-moe-tiny",
                 "--dtype", "float32"]) == 0
    assert "qwen3-moe-tiny" in capsys.readouterr().out
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["mlp_only_layers"] == [1]
    names = file_tensors(tmp_path / "m").keys()
    assert ("model.layers.2.mlp.experts.7.down_proj.weight" in names
            and "model.layers.1.mlp.up_proj.weight" in names)
    out = LLM(tmp_path / "m", dtype="float32", device="cpu", max_model_len=32).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4


# ---------------------------------------------------------------- bad checkpoints


def drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


def put(name, value):
    return lambda t: {**t, name: value(t).clone()}


def expert0(layer):
    return lambda t: t[f"model.layers.{layer}.mlp.experts.0.gate_proj.weight"]


@pytest.mark.parametrize("fused,edit,match", [
    (False, drop("model.layers.2.mlp.experts.5.up_proj.weight"),
     r"tensor 'model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight' \(or the stacked "
     r"'model\.layers\.2\.mlp\.experts\.gate_up_proj'\) is missing"),
    (False, drop("model.layers.0.mlp.gate.weight"),
     r"'model\.layers\.0\.mlp\.gate\.weight' is missing"),
    (True, drop("model.layers.0.mlp.experts.down_proj"),
     r"tensor 'model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight' \(or the stacked "
     r"'model\.layers\.0\.mlp\.experts\.down_proj'\) is missing"
     r".*experts\.1\.down_proj.* and 3 more"),
    (False, put("model.layers.0.mlp.experts.8.gate_proj.weight", expert0(0)),
     r"unexpected tensor 'model\.layers\.0\.mlp\.experts\.8\.gate_proj\.weight'"),
    # layer 1 is dense
    (False, put("model.layers.1.mlp.experts.0.gate_proj.weight", expert0(0)),
     r"unexpected tensor 'model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight'"),
    (False, put("model.layers.2.mlp.experts.3.down_proj.weight",
                lambda t: t["model.layers.2.mlp.experts.3.down_proj.weight"].T.contiguous()),
     r"'model\.layers\.2\.mlp\.experts\.3\.down_proj\.weight' has shape \[32, 64\]"
     r".*implies \[64, 32\]"),
    (True, put("model.layers.0.mlp.experts.gate_up_proj",
               lambda t: t["model.layers.0.mlp.experts.gate_up_proj"]
                         .transpose(1, 2).contiguous()[:, :32]),
     r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' has shape \[8, 32, 64\]"
     r".*implies \[8, 64, 64\]"),
], ids=["expert-missing", "router-missing", "fused-missing", "expert-out-of-range",
        "experts-in-dense-layer", "expert-transposed", "fused-wrong-shape"])
def test_bad_moe_checkpoint_names_the_tensor(moe_checkpoint, tmp_path, fused, edit, match):
    bad = rewrite(moe_checkpoint("mlp-only-norm", fused=fused), tmp_path / "bad", edit)
    with pytest.raises(WeightsError, match=match):
        LLM(bad, dtype="float32", device="cpu", max_model_len=32)


# ---------------------------------------------------------------- the engine

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_engine_batching_chunking_and_prefix_cache_with_moe(moe_checkpoint):
    path = moe_checkpoint("mlp-only-norm")
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=256, block_size=4)
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]
    assert len({tuple(t) for t in alone}) == len(PROMPTS)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == alone
    # prompts sharing a cached prefix (the earlier runs filled the cache) give the same tokens as
    # a fresh engine
    shared = [PROMPTS[3] + [13], PROMPTS[3] + [30, 40]]
    hits = llm.llm_engine.block_manager.prefix_hits
    cached = [o.token_ids for o in llm.generate(shared, GREEDY, use_tqdm=False)]
    assert llm.llm_engine.block_manager.prefix_hits > hits
    small = LLM(path, dtype="float32", device="cpu", max_model_len=256, max_num_seqs=2,
                max_num_batched_tokens=3, enable_prefix_caching=False)
    assert [o.token_ids
            for o in small.generate(PROMPTS + shared, GREEDY, use_tqdm=False)] == alone + cached


def test_moe_on_the_paged_decode_path_gives_the_same_tokens_without_graphs(moe_checkpoint,
                                                                           monkeypatch):
    """The GPU decode path (paged attention; its PyTorch reference runs on CPU) with a MoE model:
    the same tokens, and no CUDA-graph runner (a dense model gets one here,
    tests/attention/test_paged_attention.py): the expert dispatch reads each expert's token count on the host,
    which a graph capture forbids."""
    path = moe_checkpoint("mlp-only-norm")
    kwargs = dict(dtype="float32", device="cpu", max_model_len=256, block_size=4)
    expected = [o.token_ids for o in LLM(path, **kwargs).generate(PROMPTS, GREEDY, use_tqdm=False)]
    monkeypatch.setenv("NANOQWEN_PAGED_ATTENTION", "torch")
    llm = LLM(path, **kwargs)
    runner = llm.llm_engine.runner
    assert runner.attention_backend == "torch" and runner.graph_runner is None
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
