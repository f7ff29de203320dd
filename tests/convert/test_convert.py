"""Checkpoint conversion: Hugging Face / mamba_ssm / Codestral readers, orbax I/O, source resolution.

Tiny random models are built in the test (transformers for the torch-marked tests, numpy otherwise),
saved to tmp_path and read back; every converted parameter must equal the stored tensor, transposed
into latim-jax orientation, bit for bit. Tests marked ``torch`` skip where torch is not installed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from latim_jax.convert import hub, orbax_io
from latim_jax.convert.codestral import config_from_codestral
from latim_jax.convert.errors import CheckpointError, SourceUnavailableError
from latim_jax.convert.hf import config_from_hf
from latim_jax.convert.mamba_ssm import config_from_mamba_ssm
from latim_jax.convert.orbax_io import load_checkpoint, save_checkpoint
from latim_jax.convert.reader import detect_format, read_checkpoint
from latim_jax.model.config import MambaConfig, param_shapes

BF16 = np.dtype(ml_dtypes.bfloat16)


# ---------------------------------------------------------------------------------------------------
# Helpers: an independent statement of the torch -> latim-jax mapping, and bit-exact tree comparison.


def expected_params(t: dict[str, np.ndarray], version: int, tied: bool, embedding: str) -> dict:
    """The latim-jax tree from torch-named numpy arrays, written out by hand."""
    n_layers = len({k.split(".")[2] for k in t if k.startswith("backbone.layers.")})
    layers = []
    for i in range(n_layers):
        m = f"backbone.layers.{i}.mixer."
        mixer = {
            "in_proj": t[m + "in_proj.weight"].T,
            "conv_w": t[m + "conv1d.weight"][:, 0, :].T,
            "A_log": t[m + "A_log"],
            "D": t[m + "D"],
            "out_proj": t[m + "out_proj.weight"].T,
        }
        if version == 1:
            mixer.update(x_proj=t[m + "x_proj.weight"].T, dt_proj=t[m + "dt_proj.weight"].T)
            mixer["dt_bias"] = t[m + "dt_proj.bias"]
        else:
            mixer.update(dt_bias=t[m + "dt_bias"], norm_w=t[m + "norm.weight"])
        if m + "conv1d.bias" in t:
            mixer["conv_b"] = t[m + "conv1d.bias"]
        if m + "in_proj.bias" in t:
            mixer.update(in_proj_b=t[m + "in_proj.bias"], out_proj_b=t[m + "out_proj.bias"])
        layers.append({"norm": t[f"backbone.layers.{i}.norm.weight"], "mixer": mixer})
    tree = {"embedding": t[embedding], "layers": layers, "norm_f": t["backbone.norm_f.weight"]}
    if not tied:
        tree["lm_head"] = t["lm_head.weight"]
    return tree


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def assert_trees_identical(got, want, path="params"):
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), (path, sorted(got), sorted(want))
        for k in want:
            assert_trees_identical(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_trees_identical(g, w, f"{path}[{i}]")
    else:
        assert isinstance(got, np.ndarray), (path, type(got))
        assert got.dtype == want.dtype and got.shape == want.shape, (path, got.dtype, want.dtype, got.shape)
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=path)


def assert_matches_shapes(config: MambaConfig, params) -> None:
    def walk(shapes, tree):
        if isinstance(shapes, dict):
            assert set(shapes) == set(tree)
            for k in shapes:
                walk(shapes[k], tree[k])
        elif isinstance(shapes, list):
            assert len(shapes) == len(tree)
            for s, t in zip(shapes, tree, strict=True):
                walk(s, t)
        else:
            assert tree.shape == shapes

    walk(param_shapes(config), params)


# ---------------------------------------------------------------------------------------------------
# Numpy-written Hugging Face checkpoints (no torch): used for the error and orbax tests.

NP_CONFIGS = {
    1: {
        "model_type": "mamba",
        "architectures": ["MambaForCausalLM"],
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "vocab_size": 48,
        "state_size": 4,
        "expand": 2,
        "conv_kernel": 4,
        "time_step_rank": "auto",
        "tie_word_embeddings": True,
        "layer_norm_epsilon": 1e-5,
    },
    2: {
        "model_type": "mamba2",
        "architectures": ["Mamba2ForCausalLM"],
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "vocab_size": 48,
        "state_size": 8,
        "head_dim": 16,
        "num_heads": 4,
        "n_groups": 2,
        "expand": 2,
        "conv_kernel": 4,
        "tie_word_embeddings": False,
        "time_step_limit": [0.0, {"__float__": "Infinity"}],
    },
}


def np_torch_tensors(version: int, dtype=np.float32, seed: int = 0) -> dict[str, np.ndarray]:
    """Random arrays under Hugging Face names and torch shapes for NP_CONFIGS[version]."""
    rng = np.random.default_rng(seed)
    if version == 1:
        d, e, n, r, k = 16, 32, 4, 1, 4
        mixer = {
            "in_proj.weight": (2 * e, d),
            "conv1d.weight": (e, 1, k),
            "conv1d.bias": (e,),
            "x_proj.weight": (r + 2 * n, e),
            "dt_proj.weight": (e, r),
            "dt_proj.bias": (e,),
            "A_log": (e, n),
            "D": (e,),
            "out_proj.weight": (d, e),
        }
    else:
        d, e, n, g, h, k = 32, 64, 8, 2, 4, 4
        mixer = {
            "in_proj.weight": (2 * e + 2 * g * n + h, d),
            "conv1d.weight": (e + 2 * g * n, 1, k),
            "conv1d.bias": (e + 2 * g * n,),
            "dt_bias": (h,),
            "A_log": (h,),
            "D": (h,),
            "norm.weight": (e,),
            "out_proj.weight": (d, e),
        }
    shapes = {"backbone.embeddings.weight": (48, d), "backbone.norm_f.weight": (d,)}
    for i in range(2):
        shapes[f"backbone.layers.{i}.norm.weight"] = (d,)
        shapes.update({f"backbone.layers.{i}.mixer.{name}": s for name, s in mixer.items()})
    if version == 2:
        shapes["lm_head.weight"] = (48, d)
    return {key: rng.standard_normal(s).astype(np.float32).astype(dtype) for key, s in shapes.items()}


def write_np_hf(directory, version: int = 1, tensors=None, config=None, dtype=np.float32):
    directory.mkdir(parents=True, exist_ok=True)
    tensors = np_torch_tensors(version, dtype) if tensors is None else tensors
    (directory / "config.json").write_text(json.dumps(NP_CONFIGS[version] if config is None else config))
    save_file(tensors, str(directory / "model.safetensors"))
    return tensors


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
def test_numpy_hf_checkpoint_converts_exactly(tmp_path, version, dtype):
    tensors = write_np_hf(tmp_path / "ck", version, dtype=dtype)
    config, params = read_checkpoint(tmp_path / "ck")
    assert config.version == version and config.vocab_size == 48
    want = expected_params(tensors, version, tied=version == 1, embedding="backbone.embeddings.weight")
    assert_trees_identical(params, want)
    assert_matches_shapes(config, params)


def test_dtype_argument_casts_every_leaf(tmp_path):
    tensors = write_np_hf(tmp_path / "ck", 2)
    _, params = read_checkpoint(tmp_path / "ck", dtype="bfloat16")
    want = expected_params(tensors, 2, tied=False, embedding="backbone.embeddings.weight")
    cast = {"embedding": want["embedding"].astype(BF16), "norm_f": want["norm_f"].astype(BF16)}
    assert params["layers"][1]["mixer"]["in_proj"].dtype == BF16
    np.testing.assert_array_equal(bits(params["embedding"]), bits(cast["embedding"]))
    np.testing.assert_array_equal(bits(params["norm_f"]), bits(cast["norm_f"]))


def write_np_sharded(directory, version: int, tensors: dict[str, np.ndarray]) -> dict[str, str]:
    """The tensors over two safetensors shards plus a model.safetensors.index.json; returns the map."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(NP_CONFIGS[version]))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(directory / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return weight_map


def test_numpy_sharded_checkpoint_and_index_mismatch(tmp_path):
    tensors = np_torch_tensors(2)
    weight_map = write_np_sharded(tmp_path / "ck", 2, tensors)
    _, params = read_checkpoint(tmp_path / "ck")
    assert_trees_identical(params, expected_params(tensors, 2, False, "backbone.embeddings.weight"))

    key = "backbone.norm_f.weight"
    wrong = {**weight_map, key: next(s for s in set(weight_map.values()) if s != weight_map[key])}
    index = {"weight_map": wrong}
    (tmp_path / "ck" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(tmp_path / "ck")
    assert_names(err.value, weight_map[key], key, "model.safetensors.index.json")


# ---------------------------------------------------------------------------------------------------
# Bad input: every error names the file, the key, and expected vs found.


def assert_names(err: CheckpointError, *parts: str) -> None:
    text = str(err)
    for part in (*parts, "expected", "found"):
        assert part in text, f"{part!r} not in: {text}"


def test_missing_key(tmp_path):
    tensors = np_torch_tensors(1)
    del tensors["backbone.layers.1.mixer.D"]
    write_np_hf(tmp_path / "ck", 1, tensors)
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(tmp_path / "ck")
    assert_names(err.value, "model.safetensors", "backbone.layers.1.mixer.D", "(32,)")


def test_extra_key(tmp_path):
    tensors = np_torch_tensors(2)
    tensors["backbone.layers.0.mixer.mystery.weight"] = np.zeros((3,), np.float32)
    write_np_hf(tmp_path / "ck", 2, tensors)
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(tmp_path / "ck")
    assert_names(err.value, "model.safetensors", "backbone.layers.0.mixer.mystery.weight")


def test_wrong_shape(tmp_path):
    tensors = np_torch_tensors(2)
    tensors["backbone.layers.1.mixer.A_log"] = np.zeros((5,), np.float32)
    write_np_hf(tmp_path / "ck", 2, tensors)
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(tmp_path / "ck")
    assert_names(err.value, "model.safetensors", "backbone.layers.1.mixer.A_log", "(4,)", "(5,)")


def test_vocab_in_config_must_match_embedding_rows(tmp_path):
    write_np_hf(tmp_path / "ck", 1, config={**NP_CONFIGS[1], "vocab_size": 56})
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(tmp_path / "ck")
    assert_names(err.value, "model.safetensors", "backbone.embeddings.weight", "(56, 16)", "(48, 16)")


def test_unknown_config_field(tmp_path):
    write_np_hf(tmp_path / "ck", 1, config={**NP_CONFIGS[1], "mystery_knob": 3})
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(tmp_path / "ck")
    assert_names(err.value, "config.json", "mystery_knob")


def test_truncated_safetensors(tmp_path):
    write_np_hf(tmp_path / "ck", 2)
    file = tmp_path / "ck" / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(tmp_path / "ck")
    size = len(data) * 2 // 3
    assert str(err.value).startswith(
        f"model.safetensors: truncated or corrupt safetensors file: its header describes {len(data)} "
        f"bytes, the file has {size}, so tensor '{err.value.key}' and those stored after it are cut off"
    ), str(err.value)
    assert err.value.expected == f"{len(data)} bytes" and err.value.found == f"{size} bytes"
    file.write_bytes(data[:100])  # the header itself cut: the file's size, not "bytes of header"
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(tmp_path / "ck")
    n = int.from_bytes(data[:8], "little")
    assert str(err.value) == (
        f"model.safetensors: truncated or corrupt safetensors file: its first 8 bytes announce a {n}-byte "
        "header, which does not fit in the file's 100 bytes (copy or download it again)"
    )


def test_corrupt_safetensors_header(tmp_path):
    write_np_hf(tmp_path / "ck", 1)
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(CheckpointError, match="model.safetensors.*corrupt"):
        read_checkpoint(tmp_path / "ck")


def test_directory_without_weights(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text(json.dumps(NP_CONFIGS[2]))
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(tmp_path / "ck")
    assert_names(err.value, "ck", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def test_directory_without_any_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(tmp_path / "empty")
    assert_names(err.value, "empty", "config.json", "params.json", "latim_config.json")
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        read_checkpoint(tmp_path / "absent")


def test_a_known_family_not_read_yet_says_why():
    from latim_jax.convert.hf import config_from_hf

    with pytest.raises(CheckpointError, match=r"zamba checkpoints are not read yet: .*Zamba2 is") as err:
        config_from_hf({"model_type": "zamba", "hidden_size": 32})
    assert_names(err.value, "config.json", "model_type", "zamba")


def test_unsupported_model_type(tmp_path):
    write_np_hf(tmp_path / "ck", 1, config={**NP_CONFIGS[1], "model_type": "llama"})
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(tmp_path / "ck")
    assert_names(err.value, "config.json", "model_type", "llama")


def test_pytorch_bin_without_torch_says_so(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({"d_model": 16, "n_layer": 2, "vocab_size": 48}))
    (ck / "pytorch_model.bin").write_bytes(b"not read")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*needs torch"):
        read_checkpoint(ck)


# ---------------------------------------------------------------------------------------------------
# Config mapping, without weights.

MAMBA_130M_HF = {  # state-spaces/mamba-130m-hf: an early port carrying mamba_ssm-style duplicates
    "architectures": ["MambaForCausalLM"],
    "bos_token_id": 0,
    "conv_kernel": 4,
    "d_inner": 1536,
    "d_model": 768,
    "eos_token_id": 0,
    "expand": 2,
    "fused_add_norm": True,
    "hidden_act": "silu",
    "hidden_size": 768,
    "initializer_range": 0.1,
    "intermediate_size": 1536,
    "layer_norm_epsilon": 1e-05,
    "model_type": "mamba",
    "n_layer": 24,
    "num_hidden_layers": 24,
    "pad_token_id": 0,
    "pad_vocab_size_multiple": 8,
    "rescale_prenorm_residual": False,
    "residual_in_fp32": True,
    "rms_norm": True,
    "ssm_cfg": {},
    "state_size": 16,
    "time_step_floor": 0.0001,
    "time_step_init_scheme": "random",
    "time_step_max": 0.1,
    "time_step_min": 0.001,
    "time_step_rank": 48,
    "time_step_scale": 1.0,
    "torch_dtype": "float32",
    "transformers_version": "4.39.0.dev0",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "vocab_size": 50280,
}

CODESTRAL_PARAMS = {  # mistralai/Mamba-Codestral-7B-v0.1 params.json (mistral-inference MambaArgs)
    "dim": 4096,
    "n_layers": 64,
    "vocab_size": 32768,
    "n_groups": 8,
    "rms_norm": True,
    "residual_in_fp32": True,
    "fused_add_norm": True,
    "pad_vocab_size_multiple": 1,
    "tie_embeddings": False,
    "model_type": "mamba",
}


def test_published_configs_map_to_published_sizes():
    c = config_from_hf(MAMBA_130M_HF)
    assert (c.version, c.d_model, c.n_layers, c.vocab_size, c.d_state, c.dt_rank) == (
        1,
        768,
        24,
        50280,
        16,
        48,
    )
    assert c.tie_embeddings and c.activation == "silu"
    c = config_from_codestral(CODESTRAL_PARAMS)
    assert (c.version, c.d_model, c.n_layers, c.vocab_size, c.n_groups, c.d_state, c.head_dim) == (
        2,
        4096,
        64,
        32768,
        8,
        128,
        64,
    )
    assert not c.tie_embeddings and param_shapes(c)["layers"][0]["mixer"]["in_proj"] == (4096, 18560)
    c = config_from_mamba_ssm(
        {
            "d_model": 768,
            "d_intermediate": 0,
            "n_layer": 24,
            "vocab_size": 50277,
            "ssm_cfg": {"layer": "Mamba2"},
            "attn_layer_idx": [],
            "attn_cfg": {},
            "rms_norm": True,
            "residual_in_fp32": True,
            "fused_add_norm": True,
            "pad_vocab_size_multiple": 16,
            "tie_embeddings": True,
        }
    )
    assert (c.version, c.vocab_size, c.vocab_size_unpadded, c.d_state, c.head_dim, c.n_groups) == (
        2,
        50288,
        50277,
        128,
        64,
        1,
    )


@pytest.mark.parametrize("limit", [[0.0, math.inf], [0.0, {"__float__": "Infinity"}], [0.0, "Infinity"]])
def test_time_step_limit_infinity_spellings(limit):
    text = json.dumps({**NP_CONFIGS[2], "time_step_limit": limit})  # math.inf -> bare Infinity
    assert config_from_hf(json.loads(text)).time_step_limit == (0.0, math.inf)


@pytest.mark.parametrize(
    "act, want",
    [("silu", "silu"), ("swish", "silu"), ("relu", "relu"), ("identity", "identity"), ("linear", "identity")],
)
def test_hidden_act_mapping(act, want):
    assert config_from_hf({**NP_CONFIGS[1], "hidden_act": act}).activation == want


V1_SSM = {"d_model": 16, "n_layer": 2, "vocab_size": 45}
V2_SSM = {"d_model": 32, "n_layer": 2, "vocab_size": 45, "ssm_cfg": {"layer": "Mamba2", "headdim": 16}}


@pytest.mark.parametrize(
    "reader, data, key",
    [
        (config_from_hf, {**NP_CONFIGS[1], "hidden_act": "gelu"}, "hidden_act"),
        (config_from_hf, {**NP_CONFIGS[1], "rms_norm": False}, "rms_norm"),
        (config_from_hf, {**NP_CONFIGS[1], "d_model": 17}, "d_model"),
        (config_from_hf, {**NP_CONFIGS[2], "num_heads": 3}, "num_heads"),
        (config_from_hf, {**NP_CONFIGS[2], "hidden_size": "32"}, "hidden_size"),
        (config_from_mamba_ssm, {**V1_SSM, "rms_norm": False}, "rms_norm"),
        (config_from_mamba_ssm, {**V1_SSM, "d_intermediate": 64}, "d_intermediate"),
        (config_from_mamba_ssm, {**V1_SSM, "attn_layer_idx": [1]}, "attn_layer_idx"),
        (config_from_mamba_ssm, {**V1_SSM, "ssm_cfg": {"layer": "Mamba3"}}, "ssm_cfg.layer"),
        (config_from_mamba_ssm, {**V1_SSM, "ssm_cfg": {"headdim": 16}}, "ssm_cfg.headdim"),
        (
            config_from_mamba_ssm,
            {**V2_SSM, "ssm_cfg": {**V2_SSM["ssm_cfg"], "norm_before_gate": True}},
            "norm_before_gate",
        ),
        (
            config_from_mamba_ssm,
            {**V2_SSM, "ssm_cfg": {**V2_SSM["ssm_cfg"], "D_has_hdim": True}},
            "D_has_hdim",
        ),
        (config_from_mamba_ssm, {**V2_SSM, "ssm_cfg": {**V2_SSM["ssm_cfg"], "rmsnorm": False}}, "rmsnorm"),
        (config_from_mamba_ssm, {**V2_SSM, "ssm_cfg": {**V2_SSM["ssm_cfg"], "d_ssm": 32}}, "d_ssm"),
        (config_from_mamba_ssm, {**V2_SSM, "norm_epsilon": 1e-6}, "norm_epsilon"),
        (config_from_codestral, {**CODESTRAL_PARAMS, "d_state": 64}, "d_state"),
        (config_from_codestral, {**CODESTRAL_PARAMS, "model_type": "transformer"}, "model_type"),
    ],
)
def test_unsupported_config_values_are_errors(reader, data, key):
    with pytest.raises(CheckpointError) as err:
        reader(data)
    assert key in str(err.value) and err.value.file is not None
    assert "expected" in str(err.value) and "found" in str(err.value)


CODESTRAL_HF = {  # mistralai/Mamba-Codestral-7B-v0.1 config.json (the transformers port)
    "_name_or_path": "/raid/pablo/codestral-hf-good/",
    "architectures": ["Mamba2ForCausalLM"],
    "bos_token_id": 0,
    "chunk_size": 256,
    "conv_kernel": 4,
    "eos_token_id": 0,
    "expand": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.1,
    "intermediate_size": 8192,
    "layer_norm_epsilon": 1e-05,
    "model_type": "mamba2",
    "n_groups": 8,
    "norm_before_gate": True,
    "num_heads": 128,
    "num_hidden_layers": 64,
    "pad_token_id": 0,
    "rescale_prenorm_residual": False,
    "residual_in_fp32": True,
    "rms_norm": True,
    "state_size": 128,
    "tie_word_embeddings": False,
    "time_step_floor": 0.0001,
    "time_step_init_scheme": "random",
    "time_step_limit": [0.0, {"__float__": "Infinity"}],
    "time_step_max": 0.1,
    "time_step_min": 0.001,
    "time_step_rank": 256,
    "time_step_scale": 1.0,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.44.0.dev0",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "vocab_size": 32768,
}


def test_hf_codestral_config_matches_params_json():
    # Its norm_before_gate: true is never read by transformers, whose gated norm always gates first.
    from_hf, from_params = config_from_hf(CODESTRAL_HF), config_from_codestral(CODESTRAL_PARAMS)
    assert from_hf == dataclasses.replace(from_params, vocab_size_unpadded=None)


# ---------------------------------------------------------------------------------------------------
# orbax checkpoints.


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["fp32", "bf16"])
def test_orbax_round_trip_is_bit_exact(tmp_path, dtype):
    write_np_hf(tmp_path / "src", 2, dtype=dtype)
    config, params = read_checkpoint(tmp_path / "src")
    (tmp_path / "src" / "tokenizer.json").write_text('{"fake": true}')
    dest = save_checkpoint(tmp_path / "out" / "ck", config, params, tokenizer_dir=tmp_path / "src")
    assert sorted(os.listdir(dest)) == ["latim_config.json", "params", "tokenizer.json"]
    assert os.listdir(tmp_path / "out") == ["ck"]  # no temporary left beside it
    config2, params2 = load_checkpoint(dest)
    assert config2 == config
    assert_trees_identical(params2, params)
    assert detect_format(dest) == "latim"
    assert_trees_identical(read_checkpoint(dest)[1], params)


def test_orbax_saves_jax_arrays(tmp_path):
    import jax
    import jax.numpy as jnp

    write_np_hf(tmp_path / "src", 1)
    config, params = read_checkpoint(tmp_path / "src")
    dest = save_checkpoint(tmp_path / "ck", config, jax.tree.map(jnp.asarray, params))
    assert_trees_identical(load_checkpoint(dest)[1], params)


def test_orbax_refuses_to_overwrite_unless_asked(tmp_path):
    write_np_hf(tmp_path / "src", 1)
    config, params = read_checkpoint(tmp_path / "src")
    dest = save_checkpoint(tmp_path / "ck", config, params)
    (dest / "keep.txt").write_text("old")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_checkpoint(dest, config, params)
    assert "keep.txt" in os.listdir(dest)
    save_checkpoint(dest, config, params, overwrite=True)  # replaces a latim-jax checkpoint
    assert "keep.txt" not in os.listdir(dest)
    assert_trees_identical(load_checkpoint(dest)[1], params)
    assert sorted(os.listdir(tmp_path)) == ["ck", "src"]


def test_overwrite_never_deletes_a_directory_it_did_not_write(tmp_path):
    write_np_hf(tmp_path / "src", 1)
    config, params = read_checkpoint(tmp_path / "src")
    other = tmp_path / "notes"
    other.mkdir()
    (other / "thesis.tex").write_text("precious")
    with pytest.raises(FileExistsError, match="not a latim-jax checkpoint"):
        save_checkpoint(other, config, params, overwrite=True)
    assert os.listdir(other) == ["thesis.tex"]
    assert sorted(os.listdir(tmp_path)) == ["notes", "src"]


@pytest.mark.parametrize("where", ["same", "inside", "contains"])
def test_destination_overlapping_the_source_is_refused(tmp_path, monkeypatch, where):
    from latim_jax.cli import main

    write_np_hf(tmp_path / "a" / "src", 1)
    before = {p: p.read_bytes() for p in (tmp_path / "a").rglob("*") if p.is_file()}
    monkeypatch.chdir(tmp_path / "a")
    dest = {"same": "src", "inside": "src/sub", "contains": "."}[where]
    assert main(["convert", "src", dest, "--overwrite"]) == 2
    monkeypatch.chdir(tmp_path)
    config, params = read_checkpoint(tmp_path / "a" / "src")
    with pytest.raises(ValueError, match="source"):
        save_checkpoint(tmp_path / "a" / dest, config, params, overwrite=True, source=tmp_path / "a" / "src")
    after = {p: p.read_bytes() for p in (tmp_path / "a").rglob("*") if p.is_file()}
    assert after == before  # config.json and model.safetensors intact, nothing added


@pytest.mark.parametrize("existing", [False, True])
def test_orbax_failure_midway_leaves_nothing(tmp_path, monkeypatch, existing):
    write_np_hf(tmp_path / "src", 1)
    config, params = read_checkpoint(tmp_path / "src")
    (tmp_path / "src" / "tokenizer.json").write_text("{}")
    dest = tmp_path / "out" / "ck"
    if existing:
        save_checkpoint(dest, config, params)
        (dest / "keep.txt").write_text("old")

    def fail_after_params(files, directory):
        assert (directory / "params").is_dir()  # the params were written: this is midway
        raise RuntimeError("disk full")

    monkeypatch.setattr(orbax_io, "_copy_tokenizer", fail_after_params)
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(dest, config, params, tokenizer_dir=tmp_path / "src", overwrite=True)
    if existing:  # the old checkpoint is untouched
        assert os.listdir(tmp_path / "out") == ["ck"]
        assert sorted(os.listdir(dest)) == ["keep.txt", "latim_config.json", "params"]
        assert_trees_identical(load_checkpoint(dest)[1], params)
    else:
        assert not dest.exists() and os.listdir(tmp_path / "out") == []


def test_relative_paths_work_everywhere(tmp_path, monkeypatch):
    import latim_jax
    from latim_jax.cli import main

    write_np_hf(tmp_path / "ck", 2)
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "ck", "conv"]) == 0
    model = latim_jax.load("conv")
    for name in ("./conv", "conv/", "../" + tmp_path.name + "/conv"):
        assert latim_jax.load(name).config == model.config
    config, params = read_checkpoint("conv")
    assert_trees_identical(params, read_checkpoint(tmp_path / "ck")[1])
    assert load_checkpoint("./conv")[0] == config
    assert main(["attribute", "--model", "conv", "--tokens", "1 2 3", "--out", "s.npz"]) == 0
    assert main(["attribute", "--model", "./conv", "--tokens", "1 2", "--out", "t.npz"]) == 0
    assert latim_jax.Attribution.load("s.npz").scores.shape == (1, 2, 3, 3)


def test_converting_a_task_model_keeps_its_task(tmp_path, monkeypatch):
    """convert copies task.json beside the tokenizer: the converted shipped model still knows its task
    (evaluate, the default prompt and text in the task's words need it)."""
    import latim_jax
    from latim_jax.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["convert", "copy-mamba1", "converted"]) == 0
    original, converted = latim_jax.load("copy-mamba1"), latim_jax.load("converted")
    assert converted.task == original.task and converted.task["name"] == "copy"
    assert main(["attribute", "--model", "converted", "--text", "t3 t4 <sep>", "--out", "s.npz"]) == 0


def test_written_files_respect_the_umask(tmp_path):
    from latim_jax.io.atomic import write_bytes_atomic

    old = os.umask(0o027)
    try:
        write_bytes_atomic(tmp_path / "a.bin", b"x")
        write_np_hf(tmp_path / "src", 1)
        dest = save_checkpoint(tmp_path / "ck", *read_checkpoint(tmp_path / "src"))
    finally:
        os.umask(old)
    assert (tmp_path / "a.bin").stat().st_mode & 0o777 == 0o640
    modes = {p.stat().st_mode & 0o777 for p in dest.rglob("*") if p.is_file()}
    assert modes == {0o640}, sorted(oct(m) for m in modes)
    assert dest.stat().st_mode & 0o777 == 0o750


def test_save_checks_params_against_config(tmp_path):
    write_np_hf(tmp_path / "src", 1)
    config, params = read_checkpoint(tmp_path / "src")
    params["layers"][1]["mixer"]["D"] = np.zeros(3, np.float32)
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(tmp_path / "ck", config, params)
    assert_names(err.value, "layers[1].mixer.D", "(32,)", "(3,)")
    assert not (tmp_path / "ck").exists()


# ---------------------------------------------------------------------------------------------------
# Source resolution (never touches the network).


def test_local_directory_is_returned_as_is(tmp_path):
    assert hub.resolve_source(tmp_path) == tmp_path
    assert hub.resolve_source(str(tmp_path)) == tmp_path
    with pytest.raises(SourceUnavailableError, match="no such local checkpoint directory"):
        hub.resolve_source(str(tmp_path / "missing" / "dir"))


def test_offline_hub_id_fails_fast_with_a_clear_message(tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SourceUnavailableError) as err:
        hub.resolve_source("latim-jax-tests/no-such-model", cache_dir=tmp_path / "cache")
    text = str(err.value)
    assert "latim-jax-tests/no-such-model" in text and "could not fetch" in text and "local" in text


def test_unreachable_hub_fails_at_once_without_retries(tmp_path, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "_offline", lambda: False)
    calls = []

    class ConnectError(Exception):  # what httpx raises without a network (matched by name)
        pass

    def model_info(repo_id, **kw):
        calls.append("model_info")
        raise ConnectError("[Errno -2] Name or service not known")

    def retrying(*a, **kw):  # list_repo_files retries a failed connection for ~25 s
        calls.append("list_repo_files")
        raise ConnectError("retried")

    monkeypatch.setattr(huggingface_hub, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", retrying)
    with pytest.raises(SourceUnavailableError) as err:
        hub.resolve_source("latim-jax-tests/no-such-model", cache_dir=tmp_path / "cache")
    assert calls == ["model_info"]  # one attempt: the retrying call is never made
    text = str(err.value)
    assert "cannot be reached" in text and "not in the local Hugging Face cache" in text and "local" in text


def test_hub_patterns_fetch_one_weight_layout():
    both = [
        "config.json",
        "params.json",
        "consolidated.safetensors",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "tokenizer.json",
    ]
    patterns = hub.allow_patterns(both)
    assert "model-*.safetensors" in patterns and "consolidated.safetensors" not in patterns
    patterns = hub.allow_patterns(["params.json", "consolidated.safetensors", "tokenizer.model.v3"])
    assert "consolidated.safetensors" in patterns and "config.json" not in patterns
    patterns = hub.allow_patterns(["config.json", "pytorch_model.bin", "model.safetensors"])
    assert "model.safetensors" in patterns and "pytorch_model.bin" not in patterns


# ---------------------------------------------------------------------------------------------------
# transformers-built models: HF format (fp32, bf16, sharded), then the same weights as mamba_ssm and
# Codestral checkpoints.

HF_CASES = {
    "mamba1_tied": dict(version=1, vocab_size=64, hidden_size=16, num_hidden_layers=2, state_size=4),
    "mamba1_bias_untied": dict(
        version=1,
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        state_size=4,
        use_bias=True,
        use_conv_bias=False,
        time_step_rank=3,
        tie_word_embeddings=False,
    ),
    "mamba2_g1_tied": dict(
        version=2,
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        state_size=8,
        head_dim=16,
        num_heads=4,
        n_groups=1,
        tie_word_embeddings=True,
    ),
    "mamba2_g2_untied": dict(
        version=2,
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        state_size=8,
        head_dim=16,
        num_heads=4,
        n_groups=2,
        tie_word_embeddings=False,
    ),
    # Codestral shapes need mamba_ssm's Mamba-2 defaults: d_state 128, head_dim 64.
    "mamba2_codestral": dict(
        version=2,
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=2,
        state_size=128,
        head_dim=64,
        num_heads=2,
        n_groups=2,
        tie_word_embeddings=False,
    ),
}


@pytest.fixture(scope="module")
def torch():
    """The torch module; tests using it skip where torch is not installed."""
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def hf_model(torch):
    """Build (once per module) a tiny random transformers model: name -> (model, version)."""
    transformers = pytest.importorskip("transformers")
    cache = {}

    def build(name: str):
        if name not in cache:
            kwargs = dict(HF_CASES[name])
            version = kwargs.pop("version")
            torch.manual_seed(len(cache))
            if version == 1:
                model = transformers.MambaForCausalLM(transformers.MambaConfig(**kwargs))
            else:
                model = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(expand=2, **kwargs))
            with torch.no_grad():  # make norms and biases non-trivial so a mix-up cannot pass
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.1)
            cache[name] = (model.eval(), version)
        return cache[name]

    return build


def torch_state_numpy(model) -> dict[str, np.ndarray]:
    import torch

    out = {}
    for key, value in model.state_dict().items():
        if value.dtype == torch.bfloat16:
            out[key] = value.float().numpy().astype(BF16)  # exact: every bf16 is an fp32
        else:
            out[key] = value.numpy().copy()
    return out


@pytest.mark.torch
@pytest.mark.parametrize("variant", ["fp32", "bf16", "sharded"])
@pytest.mark.parametrize("name", ["mamba1_tied", "mamba1_bias_untied", "mamba2_g1_tied", "mamba2_g2_untied"])
def test_hf_checkpoint_equals_torch_state_dict(tmp_path, torch, hf_model, name, variant):
    import copy

    model, version = hf_model(name)
    if variant == "bf16":
        model = copy.deepcopy(model).to(torch.bfloat16)
    shard = "8KB" if variant == "sharded" else "5GB"
    model.save_pretrained(tmp_path / "ck", max_shard_size=shard)
    if variant == "sharded":
        assert (tmp_path / "ck" / "model.safetensors.index.json").is_file()
    config, params = read_checkpoint(tmp_path / "ck")
    tied = HF_CASES[name].get("tie_word_embeddings", True)
    assert config.version == version and config.tie_embeddings == tied
    want = expected_params(torch_state_numpy(model), version, tied, "backbone.embeddings.weight")
    assert_trees_identical(params, want)
    assert_matches_shapes(config, params)
    if variant == "bf16":
        assert params["layers"][0]["mixer"]["in_proj"].dtype == BF16


def write_mamba_ssm(model, version: int, directory, *, pad_multiple: int, unpadded_vocab: int):
    """The model's weights as an original mamba_ssm checkpoint (torch pickle, singular embedding)."""
    import torch

    c = model.config
    state = {
        k.replace("backbone.embeddings.", "backbone.embedding."): v.clone()
        for k, v in model.state_dict().items()
    }
    state["lm_head.weight"] = (
        state["backbone.embedding.weight"].clone() if c.tie_word_embeddings else state["lm_head.weight"]
    )
    if version == 1:
        ssm_cfg = {
            "d_state": c.state_size,
            "dt_rank": c.time_step_rank,
            "conv_bias": c.use_conv_bias,
            "bias": c.use_bias,
        }
    else:
        ssm_cfg = {
            "layer": "Mamba2",
            "d_state": c.state_size,
            "headdim": c.head_dim,
            "ngroups": c.n_groups,
            "dt_limit": [0.0, math.inf],
            "rmsnorm": True,
            "norm_before_gate": False,
            "dt_min": 0.001,
        }
    config = {
        "d_model": c.hidden_size,
        "d_intermediate": 0,
        "n_layer": c.num_hidden_layers,
        "vocab_size": unpadded_vocab,
        "ssm_cfg": ssm_cfg,
        "attn_layer_idx": [],
        "attn_cfg": {},
        "rms_norm": True,
        "residual_in_fp32": True,
        "fused_add_norm": True,
        "pad_vocab_size_multiple": pad_multiple,
        "tie_embeddings": c.tie_word_embeddings,
    }
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))  # math.inf -> bare Infinity
    torch.save(state, directory / "pytorch_model.bin")


@pytest.mark.torch
@pytest.mark.parametrize("name", ["mamba1_tied", "mamba1_bias_untied", "mamba2_g1_tied", "mamba2_g2_untied"])
def test_mamba_ssm_checkpoint_reads_like_hf(tmp_path, hf_model, name):
    model, version = hf_model(name)
    model.save_pretrained(tmp_path / "hf")
    write_mamba_ssm(model, version, tmp_path / "ssm", pad_multiple=16, unpadded_vocab=50)
    assert detect_format(tmp_path / "ssm") == "mamba_ssm"
    hf_config, hf_params = read_checkpoint(tmp_path / "hf")
    config, params = read_checkpoint(tmp_path / "ssm")
    assert config.vocab_size == 64 and config.vocab_size_unpadded == 50
    for field in (
        "version",
        "d_model",
        "n_layers",
        "d_state",
        "dt_rank",
        "head_dim",
        "n_groups",
        "conv_bias",
        "proj_bias",
        "tie_embeddings",
        "time_step_limit",
    ):
        assert getattr(config, field) == getattr(hf_config, field), field
    assert_trees_identical(params, hf_params)


@pytest.mark.torch
def test_mamba_ssm_bf16_and_untied_head_checks(tmp_path, torch, hf_model):
    import copy

    model, _ = hf_model("mamba1_tied")
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    write_mamba_ssm(bf16, 1, tmp_path / "ssm", pad_multiple=8, unpadded_vocab=61)
    _, params = read_checkpoint(tmp_path / "ssm")
    want = expected_params(torch_state_numpy(bf16), 1, True, "backbone.embeddings.weight")
    assert_trees_identical(params, want)

    # A "tied" checkpoint whose stored head differs from its embedding is refused.
    state = torch.load(tmp_path / "ssm" / "pytorch_model.bin", weights_only=True)
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    torch.save(state, tmp_path / "ssm" / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(tmp_path / "ssm")
    assert_names(err.value, "pytorch_model.bin", "lm_head.weight")

    # A truncated pickle names the file.
    data = (tmp_path / "ssm" / "pytorch_model.bin").read_bytes()
    (tmp_path / "ssm" / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*corrupt"):
        read_checkpoint(tmp_path / "ssm")


@pytest.mark.torch
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_codestral_checkpoint_reads_like_hf(tmp_path, torch, hf_model, bf16):
    import copy

    from safetensors.torch import save_file as save_torch

    model, _ = hf_model("mamba2_codestral")
    if bf16:
        model = copy.deepcopy(model).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    ck = tmp_path / "codestral"
    ck.mkdir()
    state = {
        "model." + k.replace("backbone.embeddings.", "backbone.embedding."): v.contiguous()
        for k, v in model.state_dict().items()
    }
    save_torch(state, str(ck / "consolidated.safetensors"))
    params_json = {**CODESTRAL_PARAMS, "dim": 64, "n_layers": 2, "vocab_size": 96, "n_groups": 2}
    (ck / "params.json").write_text(json.dumps(params_json))
    assert detect_format(ck) == "codestral"
    hf_config, hf_params = read_checkpoint(tmp_path / "hf")
    config, params = read_checkpoint(ck)
    assert (config.n_groups, config.d_state, config.head_dim, config.tie_embeddings) == (2, 128, 64, False)
    assert_trees_identical(params, hf_params)

    # The hub repository of Codestral holds both layouts: the Hugging Face one is read when present.
    for file in ("config.json", "model.safetensors"):
        shutil.copy(tmp_path / "hf" / file, ck / file)
    assert detect_format(ck) == "hf"
