"""The files ggk needs besides the product's own, tiny and deterministic: a LLaDA-Image DiT and a tiny autoencoder.

numpy + gguf-py only; the same seed writes the same bytes. ggk validates every tensor of every file at start-up,
so these are complete models of the smallest legal sizes (the engine names each tensor it misses). Facts, from
ggk 0.9.7's source and runs of the engine (model/diffusion/llada_image.hpp, model/vae/tae.hpp):
- the DiT: hidden a multiple of 128 (head dim 128), in_channels 128; cap_feat_dim (the adapter's out dim) and
  semantic_feat_dim (the SigVQ encoder's) are read from the tensors; at least one layer and one refiner.
- the VAE: `--vae` builds a full-width encoder (34M parameters), so the suite passes a TAEF2-shaped tiny
  autoencoder with `--taesd` (64 channels fixed, 5 MB in f16).
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np

# ----------------------------------------------------------------------------------------------------- helpers

def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _normal(rng: np.random.Generator, shape, scale: float) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


_QUANT = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


class _Quantized:
    """A pre-quantized tensor: raw bytes plus its ggml type (gguf-py writes the logical shape from them)."""

    def __init__(self, a: np.ndarray, qtype):
        self.data = gguf.quants.quantize(a.astype(np.float32), qtype)
        self.qtype = qtype


def _cast(a: np.ndarray, dtype: str):
    """2-D+ weights go in `dtype` ('f32', 'f16', or for Linear weights whose input width is a multiple of 32,
    'q8_0' / 'q4_0'); 1-D tensors (norms, biases) always stay f32."""
    if a.ndim < 2:
        return a.astype(np.float32)
    if dtype == "f16":
        return a.astype(np.float16)
    if dtype in _QUANT:
        if a.shape[-1] % 32 == 0:
            return _Quantized(a, _QUANT[dtype])
        return a.astype(np.float16)  # conv kernels etc.: ggml blocks run along ne[0]
    return a.astype(np.float32)


def _write_gguf(path, tensors: dict[str, np.ndarray], arch: str, kv: dict[str, str] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    for k, v in (kv or {}).items():
        w.add_string(k, v)
    for name in sorted(tensors):  # sorted: byte-identical output for equal inputs
        a = tensors[name]
        if isinstance(a, _Quantized):
            w.add_tensor(name, a.data, raw_dtype=a.qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def _linear(t: dict, rng, name: str, out_f: int, in_f: int, *, bias: bool = True, dtype: str = "f32",
            scale: float | None = None) -> None:
    s = (1.0 / np.sqrt(in_f)) if scale is None else scale
    t[f"{name}.weight"] = _cast(_normal(rng, (out_f, in_f), s), dtype)
    if bias:
        t[f"{name}.bias"] = _normal(rng, (out_f,), 0.02)


def _layernorm(t: dict, rng, name: str, dim: int) -> None:
    t[f"{name}.weight"] = (1.0 + _normal(rng, (dim,), 0.1)).astype(np.float32)
    t[f"{name}.bias"] = _normal(rng, (dim,), 0.1)


def _conv(t: dict, rng, name: str, out_c: int, in_c: int, k: int, *, bias: bool = True, dtype: str = "f16") -> None:
    t[f"{name}.weight"] = _cast(_normal(rng, (out_c, in_c, k, k), 1.0 / np.sqrt(in_c * k * k)), dtype)
    if bias:
        t[f"{name}.bias"] = _normal(rng, (out_c,), 0.02)


# ------------------------------------------------------------------------------------------------ LLaDA-Image DiT
# model/diffusion/llada_image.hpp. Read from shapes: hidden (x_embedder out), in_channels (x_embedder in),
# cap_feat_dim (cap_embedder.1 in), semantic_feat_dim (sigvq_embedder.1 in), #layers, #refiner layers.
# Fixed by the engine: head_dim 128 (heads = hidden/128, so hidden % 128 == 0), FFN = 256-multiple of 8/3*hidden,
# adaLN width min(hidden, 256), t_embedder freq 256, parameter-free RMSNorms, rope axes {32,48,48}.
# in_channels must stay 128: the sampler's latent is the Flux2 VAE's 32ch patchified (2x2) = 128ch at /16.
LLADA_HEAD_DIM = 128
LLADA_IN_CHANNELS = 128


def llada_dims(hidden: int) -> dict:
    ffn = int(8.0 / 3.0 * hidden)
    ffn = 256 * ((ffn + 255) // 256)
    return {"ffn": ffn, "adaln": min(hidden, 256), "t_hidden": min(hidden, 1024)}


def write_llada_dit(path, *, hidden: int = 128, cap_feat_dim: int = 64, semantic_feat_dim: int = 64,
                    num_layers: int = 1, num_refiner_layers: int = 1, seed: int = 0, dtype: str = "q4_0") -> Path:
    """Tiny random LLaDA-Image DiT. `cap_feat_dim` must equal the adapter's out dim; `semantic_feat_dim` the
    SigVQ encoder's semantic dim (only read when editing)."""
    assert hidden % LLADA_HEAD_DIM == 0, "ggk: num_heads = hidden / 128"
    assert num_layers >= 1 and num_refiner_layers >= 1, "ggk falls back to 30 layers / 2 refiners when none is found"
    rng = _rng(seed)
    d = llada_dims(hidden)
    H, F, A = hidden, d["ffn"], d["adaln"]
    t: dict[str, np.ndarray] = {}
    for p in ("x_pad_token", "cap_pad_token", "sigvq_pad_token"):
        t[p] = _normal(rng, (1, H), 0.02)
    _linear(t, rng, "x_embedder", H, LLADA_IN_CHANNELS, dtype=dtype)
    _linear(t, rng, "t_embedder.mlp.0", d["t_hidden"], 256, dtype=dtype)
    _linear(t, rng, "t_embedder.mlp.2", A, d["t_hidden"], dtype=dtype)
    _linear(t, rng, "cap_embedder.1", H, cap_feat_dim, dtype=dtype)
    _linear(t, rng, "semantic_embedder.1", H, semantic_feat_dim, dtype=dtype)
    _linear(t, rng, "sigvq_embedder.1", H, semantic_feat_dim, dtype=dtype)

    def block(name: str, modulation: bool) -> None:
        for p in ("to_q", "to_k", "to_v"):
            _linear(t, rng, f"{name}.attention.{p}", H, H, bias=False, dtype=dtype)
        _linear(t, rng, f"{name}.attention.to_out.0", H, H, bias=False, dtype=dtype)
        _linear(t, rng, f"{name}.feed_forward.w1", F, H, bias=False, dtype=dtype)
        _linear(t, rng, f"{name}.feed_forward.w2", H, F, bias=False, dtype=dtype)
        _linear(t, rng, f"{name}.feed_forward.w3", F, H, bias=False, dtype=dtype)
        if modulation:
            _linear(t, rng, f"{name}.adaLN_modulation.0", 4 * H, A, dtype=dtype, scale=0.01)

    for i in range(num_refiner_layers):
        block(f"noise_refiner.{i}", True)
        block(f"context_refiner.{i}", False)
        block(f"sigvq_refiner.{i}", False)
    for i in range(num_layers):
        block(f"layers.{i}", True)
    _linear(t, rng, "final_layer.linear", LLADA_IN_CHANNELS, H, dtype=dtype, scale=0.01)
    _linear(t, rng, "final_layer.adaLN_modulation.1", H, A, dtype=dtype, scale=0.01)
    return _write_gguf(path, t, "llada_image")


# ---------------------------------------------------------------------------------------------------- the "VAE"
# ggk validates every registered tensor at start-up, the VAE's included, so a run needs one. --vae (AutoEncoderKL,
# Flux2 layout) has its encoder width fixed at ch=128 (~34M params); only the decoder width is read from shapes.
# --taesd swaps in the tiny autoencoder (model/vae/tae.hpp, TAESD with taef2: z=32, mid-block GroupNorm pools,
# 64 channels fixed), ignores `first_stage_model.*`, and needs ~2.7M params (5.4 MB in f16): the cheapest legal one.
TAE_CH = 64
TAE_Z = 32  # taef2 (Flux2 latents); decode()/encode() (un)patchify 2x2 -> 128 latent channels


def _tae_block(t, rng, name, gn: bool, dtype):
    for k in ("conv.0", "conv.2", "conv.4"):
        _conv(t, rng, f"{name}.{k}", TAE_CH, TAE_CH, 3, dtype=dtype)
    if gn:
        _conv(t, rng, f"{name}.pool.0", 4 * TAE_CH, TAE_CH, 1, bias=False, dtype=dtype)
        t[f"{name}.pool.1.weight"] = np.ones(4 * TAE_CH, np.float32)
        t[f"{name}.pool.1.bias"] = np.zeros(4 * TAE_CH, np.float32)
        _conv(t, rng, f"{name}.pool.3", TAE_CH, 4 * TAE_CH, 1, bias=False, dtype=dtype)


def write_vae(path, *, seed: int = 1, dtype: str = "f16") -> Path:
    """A tiny-autoencoder (TAEF2-shaped) GGUF for `--taesd` (tensor names `encoder.layers.*`, `decoder.layers.*`,
    loaded under `tae.`). Pass it with --taesd, not --vae."""
    rng = _rng(seed)
    t: dict[str, np.ndarray] = {}
    # TinyEncoder: conv, block, [stride conv, 3 blocks] x3 (the last three with GN pools), conv -> z.
    e = "encoder.layers"
    _conv(t, rng, f"{e}.0", TAE_CH, 3, 3, dtype=dtype)
    _tae_block(t, rng, f"{e}.1", False, dtype)
    i = 2
    for stage in range(3):
        _conv(t, rng, f"{e}.{i}", TAE_CH, TAE_CH, 3, bias=False, dtype=dtype)
        for k in range(3):
            _tae_block(t, rng, f"{e}.{i + 1 + k}", stage == 2, dtype)
        i += 4
    _conv(t, rng, f"{e}.{i}", TAE_Z, TAE_CH, 3, dtype=dtype)
    # TinyDecoder: conv, relu, [3 blocks, upsample, conv] x3 (the first three blocks with GN pools), block, conv.
    d = "decoder.layers"
    _conv(t, rng, f"{d}.0", TAE_CH, TAE_Z, 3, dtype=dtype)
    i = 2
    for stage in range(3):
        for k in range(3):
            _tae_block(t, rng, f"{d}.{i + k}", stage == 0, dtype)
        _conv(t, rng, f"{d}.{i + 4}", TAE_CH, TAE_CH, 3, bias=False, dtype=dtype)  # after the upsample at i + 3
        i += 5
    _tae_block(t, rng, f"{d}.{i}", False, dtype)
    _conv(t, rng, f"{d}.{i + 1}", 3, TAE_CH, 3, dtype=dtype)
    return _write_gguf(path, t, "taesd")
