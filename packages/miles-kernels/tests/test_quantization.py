"""CPU numerics: low-precision weights (miles_kernels/ops/quant.py, quantization.py). Each format's parts equal a
reference quantizer written here from the format's spec (FP8 e4m3 rounding and INT4 packing in plain Python integers
and floats, not torch's casts); a checkpoint in DeepSeek-V3's FP8 layout, written here from that layout's spec with its
`quantization_config`, loads as its dequantized weights into a full-precision model and as stored into an FP8 engine;
the quantized model is batch-invariant and a QAT model's forward equals it bit for bit, with straight-through
gradients; weight sync's parts load into the engine as they are."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from miles_kernels import (
    WeightQuantizer,
    checkpoint_tensors,
    dequantize,
    fake_quantize,
    fake_quantize_model,
    load_model,
    load_state,
    quantize,
    quantize_model,
    read_quantization,
    save_model,
    unpack_int4,
)
from miles_kernels.config import KernelConfig, WeightQuantConfig
from miles_kernels.testing import packed_logits, random_model, tiny_config

KERNEL = KernelConfig(page_size=8, attention_query_tile=4, linear_tile=4, moe_tile=4)
FP8_BLOCK = WeightQuantConfig(format="fp8_block", block_size=(16, 32))
FP8_CHANNEL = WeightQuantConfig(format="fp8_channel")
INT4 = WeightQuantConfig(format="int4_group", group_size=8)
FORMATS = [FP8_BLOCK, FP8_CHANNEL, INT4]
SEQS = [torch.tensor([5, 17, 3, 99, 250, 7, 31]), torch.tensor([1, 2, 3, 4, 5])]


def e4m3(x: float) -> float:
    """x rounded to float8 e4m3fn (bias 7, 3 mantissa bits, subnormal step 2^-9, no infinities), nearest even."""
    magnitude = abs(x)
    exponent = max(math.floor(math.log2(magnitude)), -6) if magnitude else -6
    step = 2.0 ** (exponent - 3)
    return math.copysign(round(magnitude / step) * step, x)  # Python's round: half to even


def reference_fp8(w: torch.Tensor, rows: int, cols: int) -> tuple[list[list[float]], list[list[float]]]:
    """(q, scale) by the spec: per (rows, cols) block, scale = amax / 448, q = e4m3(w / scale)."""
    values = w.tolist()
    num_rows, num_cols = len(values), len(values[0])
    scales = []
    for bi in range(0, num_rows, rows):
        scales.append([])
        for bj in range(0, num_cols, cols):
            block = [abs(values[i][j]) for i in range(bi, min(bi + rows, num_rows))
                     for j in range(bj, min(bj + cols, num_cols))]  # fmt: skip
            amax = torch.tensor(max(block), dtype=torch.float32)
            scales[-1].append(float(amax / 448.0) if max(block) > 0 else 1.0)
    q = [[e4m3(float(torch.tensor(values[i][j]) / torch.tensor(scales[i // rows][j // cols]))) for j in
          range(num_cols)] for i in range(num_rows)]  # fmt: skip
    return q, scales


@pytest.mark.parametrize("config", [FP8_BLOCK, FP8_CHANNEL], ids=["block", "channel"])
def test_fp8_parts_equal_a_reference_quantizer_from_the_spec(config: WeightQuantConfig) -> None:
    w = torch.randn(40, 70, generator=torch.Generator().manual_seed(0)) * 0.3
    w[:16, :32] = 0.0  # a zero block gets scale 1
    w[20, 5] = 1e-6  # a subnormal q
    parts = quantize(config, w)
    rows, cols = config.block_size if config.format == "fp8_block" else (1, w.shape[1])
    q, scales = reference_fp8(w, rows, cols)
    scale_name = "weight_scale_inv" if config.format == "fp8_block" else "weight_scale"
    assert parts["weight"].dtype == torch.float8_e4m3fn
    assert parts[scale_name].dtype == torch.float32
    assert parts[scale_name].tolist() == scales
    assert parts["weight"].float().tolist() == q
    restored = dequantize(config, parts, torch.float32)
    expected = [[q[i][j] * scales[i // rows][j // cols] for j in range(70)] for i in range(40)]
    assert torch.equal(restored, torch.tensor(expected, dtype=torch.float32))
    # e4m3 keeps 3 mantissa bits: at most half a step (1/16 of the value's power of two) off, relative to the block
    error = (restored - w).abs()
    assert float(error.max()) <= float(w.abs().max()) / 28 and float(error.max()) > 0


def test_int4_parts_equal_compressed_tensors_pack_quantized_from_the_spec() -> None:
    w = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    w[0, :8] = 0.0
    parts = quantize(INT4, w)
    assert set(parts) == {"weight_packed", "weight_scale", "weight_shape"}
    assert parts["weight_packed"].dtype == torch.int32 and parts["weight_packed"].shape == (6, 4)
    assert parts["weight_scale"].dtype == torch.bfloat16 and parts["weight_scale"].shape == (6, 4)
    assert parts["weight_shape"].tolist() == [6, 32]
    for row in range(6):
        for group in range(4):
            chunk = w[row, group * 8 : (group + 1) * 8]
            amax = float(chunk.abs().max())
            scale = torch.tensor(amax / 7 if amax else 1.0).to(torch.bfloat16)
            assert parts["weight_scale"][row, group] == scale
            q = [max(-8, min(7, round(float(v) / float(scale)))) for v in chunk.tolist()]
            # compressed-tensors' pack_to_int32: value j of each eight, offset by 8, at bits 4j..4j+3
            word = sum((value + 8) << (4 * j) for j, value in enumerate(q))
            signed = word - 2**32 if word >= 2**31 else word
            assert int(parts["weight_packed"][row, group]) == signed
            assert unpack_int4(parts["weight_packed"], 32)[row, group * 8 : (group + 1) * 8].tolist() == q
    error = (dequantize(INT4, parts, torch.float32) - w).abs().view(6, 4, 8)
    assert bool((error <= parts["weight_scale"].float()[..., None] / 2 + 1e-6).all())


@pytest.mark.parametrize("config", FORMATS, ids=lambda c: c.format)
def test_fake_quantize_is_the_dequantized_weight_with_straight_through_gradients(config: WeightQuantConfig) -> None:
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)
    out = fake_quantize(config, w)
    assert torch.equal(out, dequantize(config, quantize(config, w), torch.float32))
    upstream = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    (out * upstream).sum().backward()
    assert w.grad is not None and torch.equal(w.grad, upstream)


@pytest.mark.parametrize("kind", ["dense", "moe", "glm", "deepseek"])
@pytest.mark.parametrize("config", FORMATS, ids=lambda c: c.format)
def test_quantized_engine_is_batch_invariant_and_equals_the_qat_forward(kind: str, config: WeightQuantConfig) -> None:
    engine = random_model(tiny_config(kind), KERNEL, seed=3)
    names = quantize_model(engine, config)
    assert "model.layers.0.mlp.gate" not in names and all(name.startswith("model.layers.") for name in names)
    qat = random_model(tiny_config(kind), KERNEL, seed=3)
    fake_quantize_model(qat, config)
    full = random_model(tiny_config(kind), KERNEL, seed=3)
    batched, trained, reference = (packed_logits(m, SEQS) for m in (engine, qat, full))
    for alone, in_batch in zip((packed_logits(engine, [s])[0] for s in SEQS), batched, strict=True):
        assert torch.equal(alone, in_batch)
    for ours, theirs in zip(batched, trained, strict=True):
        assert torch.equal(ours, theirs)
    assert not torch.equal(batched[0], reference[0])  # the format is in effect
    torch.testing.assert_close(batched[0], reference[0], rtol=0, atol=1.0)  # and stays close to the weights


@pytest.mark.parametrize("config", FORMATS, ids=lambda c: c.format)
def test_weight_sync_parts_load_as_they_are_and_full_weights_quantize_on_load(config: WeightQuantConfig) -> None:
    trainer = random_model(tiny_config("moe"), KERNEL, seed=3)
    quantizer = WeightQuantizer(config, trainer.trunk_linears())
    sent = {}
    for name, tensor in checkpoint_tensors(trainer, mtp_copies=False).items():
        layout = quantizer.layout(name, tuple(tensor.shape), tensor.dtype)
        parts = quantizer.parts(name, tensor)
        assert [(n, s, d) for n, s, d in layout] == [(n, tuple(t.shape), t.dtype) for n, t in parts]
        sent.update(parts)
    expected = random_model(tiny_config("moe"), KERNEL, seed=3)
    quantize_model(expected, config)
    for source in (sent, checkpoint_tensors(trainer)):  # the trainer's parts; a full-precision checkpoint
        engine = random_model(tiny_config("moe"), KERNEL, seed=5)
        quantize_model(engine, config)
        load_state(engine, source)
        held, wanted = checkpoint_tensors(engine), checkpoint_tensors(expected)
        assert held.keys() == wanted.keys()
        assert all(torch.equal(held[n].view(torch.uint8), wanted[n].view(torch.uint8)) for n in held)
    scale = "weight_scale_inv" if config.format == "fp8_block" else "weight_scale"
    without = {n: t for n, t in sent.items() if n != f"model.layers.0.mlp.experts.1.up_proj.{scale}"}
    with pytest.raises(ValueError, match="missing 1 tensor"):
        load_state(engine, without)
    if config.format == "fp8_block":  # a quantized checkpoint with a layer's scales missing: named
        with pytest.raises(ValueError, match=r"up_proj' has parts \['weight'\] but not \['weight_scale_inv'\]"):
            load_state(random_model(tiny_config("moe"), KERNEL), without, config)


def test_an_fp8_tensor_is_not_cast_into_a_full_precision_weight() -> None:
    model = random_model(tiny_config("dense"), KERNEL)
    name = "model.layers.0.self_attn.o_proj.weight"
    fp8 = checkpoint_tensors(model)[name].to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"dtype torch\.float8_e4m3fn"):
        load_state(model, iter([(name, fp8)]))


def test_stored_parts_keep_their_dtypes_through_a_model_cast() -> None:
    model = random_model(tiny_config("dense"), KERNEL, seed=3)
    quantize_model(model, FP8_BLOCK)
    before = {n: t.clone() for n, t in checkpoint_tensors(model).items() if "layers" in n and "proj" in n}
    model.to(torch.bfloat16)
    after = checkpoint_tensors(model)
    assert all(after[n].dtype == t.dtype and torch.equal(after[n].float(), t.float()) for n, t in before.items())


def test_a_layer_the_format_cannot_take_is_named_with_a_size_that_fits() -> None:
    model = random_model(tiny_config("deepseek"), KERNEL)
    with pytest.raises(ValueError, match=r"q_b_proj: .*\(group_size=8 fits every layer\)"):
        quantize_model(model, WeightQuantConfig(format="int4_group", group_size=16))


def write_deepseek_fp8_checkpoint(directory, model, block: tuple[int, int]) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """DeepSeek-V3's FP8 layout from its spec: every trunk linear `weight` as float8_e4m3fn plus `weight_scale_inv`,
    float32 (ceil(O/128), ceil(K/128)) here with `block`, and `quantization_config` {quant_method: fp8, fmt: e4m3,
    activation_scheme: dynamic, weight_block_size}; everything else in bfloat16. Returns the dequantized weights the
    spec defines (q * scale per block), by name."""
    directory.mkdir()
    hf = model.config.to_hf(dtype="bfloat16")
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": list(block)}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(hf))
    tensors, dequantized = {}, {}
    linears = {f"{name}.weight" for name in model.trunk_linears()}
    for name, tensor in checkpoint_tensors(model).items():
        if name not in linears:
            tensors[name] = tensor.to(torch.bfloat16).contiguous()
            continue
        q, scales = reference_fp8(tensor, *block)
        tensors[name] = torch.tensor(q).to(torch.float8_e4m3fn)
        tensors[name.replace(".weight", ".weight_scale_inv")] = torch.tensor(scales, dtype=torch.float32)
        rows, cols = block
        dequantized[name] = torch.tensor(
            [[q[i][j] * scales[i // rows][j // cols] for j in range(len(q[0]))] for i in range(len(q))]
        )
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return dequantized


def test_a_deepseek_v3_fp8_checkpoint_loads_dequantized_or_as_stored(tmp_path) -> None:  # type: ignore[no-untyped-def]
    source = random_model(tiny_config("deepseek"), KERNEL, seed=4)
    block = (16, 16)
    dequantized = write_deepseek_fp8_checkpoint(tmp_path / "fp8", source, block)
    assert read_quantization(tmp_path / "fp8") == WeightQuantConfig(format="fp8_block", block_size=block)
    full = load_model(tmp_path / "fp8", KERNEL)
    held = checkpoint_tensors(full)
    assert dequantized and all(torch.equal(held[name], value) for name, value in dequantized.items())
    stored = load_model(tmp_path / "fp8", KERNEL, weights=WeightQuantConfig(format="fp8_block", block_size=block))
    files = dict(checkpoint_tensors(stored))
    name = "model.layers.1.mlp.experts.0.down_proj"
    raw = torch.tensor(reference_fp8(checkpoint_tensors(source)[f"{name}.weight"], *block)[0])
    assert torch.equal(files[f"{name}.weight"].float(), raw)
    assert torch.equal(packed_logits(stored, SEQS)[0], packed_logits(full, SEQS)[0])  # same weights, same bits
    int4 = load_model(tmp_path / "fp8", KERNEL, weights=INT4)  # another format: dequantized, then quantized
    expected = quantize(INT4, dequantized[f"{name}.weight"])
    assert torch.equal(checkpoint_tensors(int4)[f"{name}.weight_packed"], expected["weight_packed"])
    save_model(stored, tmp_path / "again")
    assert read_quantization(tmp_path / "again") == WeightQuantConfig(format="fp8_block", block_size=block)
    reloaded = load_model(tmp_path / "again", KERNEL, weights=WeightQuantConfig(format="fp8_block", block_size=block))
    pairs = zip(checkpoint_tensors(reloaded).values(), checkpoint_tensors(stored).values(), strict=True)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs)


@pytest.mark.parametrize("config", FORMATS, ids=lambda c: c.format)
def test_quantization_config_round_trips_through_config_json(config: WeightQuantConfig) -> None:
    assert WeightQuantConfig.from_hf(config.to_hf()) == config
    assert WeightQuantConfig.from_hf(None) == WeightQuantConfig()


def test_unknown_quantization_configs_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="not a format Miles reads"):
        WeightQuantConfig.from_hf({"quant_method": "awq", "bits": 4})
    with pytest.raises(ValueError, match="multiple of 8"):
        WeightQuantConfig(format="int4_group", group_size=12)
