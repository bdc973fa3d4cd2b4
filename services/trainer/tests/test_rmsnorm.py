"""The norms (``rmsnorm``): the module megatron's layer spec builds for every norm of the model,
on the CPU ``torch.nn.RMSNorm`` itself, on CUDA the Triton kernels within one rounding step of
``torch.nn.RMSNorm`` and within the bf16 bound of the exact values, forward and backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.trainer import rmsnorm
from services.trainer.engine import TrainerEngine
from services.trainer.tests.helpers import output_and_input_grad, steps_apart

cuda = pytest.mark.skipif(rmsnorm.triton is None or not torch.cuda.is_available(), reason="needs CUDA and Triton")


def _reference(width: int, weight: torch.Tensor, eps: float) -> nn.RMSNorm:
    """``torch.nn.RMSNorm`` with ``weight``, frozen."""
    norm = nn.RMSNorm(width, eps=eps, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm.requires_grad_(False)


def _module(width: int, weight: torch.Tensor, eps: float) -> rmsnorm.RMSNorm:
    norm = rmsnorm.RMSNorm(None, width, eps=eps).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm.requires_grad_(False)


def _input(device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """``x`` of ``shape`` with a NaN in row 1 and an infinity in row 2, a weight around 1 and an
    output gradient."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = (3 * torch.randn(*shape, generator=gen, device=device)).to(dtype)
    x.view(-1, shape[-1])[1, 3] = float("nan")
    x.view(-1, shape[-1])[2, 4] = float("inf")
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=gen, device=device)).to(dtype)
    grad = torch.randn(*shape, generator=gen, device=device).to(dtype)
    return x, weight, grad


def test_the_module_on_the_cpu_is_torch_rmsnorm_forward_and_backward() -> None:
    """On the CPU ``RMSNorm`` computes exactly ``torch.nn.RMSNorm``'s output and input gradient."""
    x, weight, grad = _input("cpu", torch.float32, (7, 1, 96))
    got, got_grad = output_and_input_grad(_module(96, weight, 1e-6), x, grad)
    ref, ref_grad = output_and_input_grad(_reference(96, weight, 1e-6), x, grad)
    torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got_grad, ref_grad, rtol=0, atol=0, equal_nan=True)


def test_every_norm_of_a_built_model_is_the_rmsnorm_module(engines: dict[str, TrainerEngine]) -> None:
    """Each layer's two norms, Qwen3's per-head ``q``/``k`` norms and the final norm of both
    presets are ``RMSNorm``, with megatron's parameter names (the weights load by them)."""
    for engine in engines.values():
        decoder = engine.model.decoder
        norms = [decoder.final_layernorm]
        for layer in decoder.layers:
            norms += [layer.input_layernorm, layer.pre_mlp_layernorm]
            if engine.shape.qk_norm:
                norms += [layer.self_attention.q_layernorm, layer.self_attention.k_layernorm]
        assert all(isinstance(norm, rmsnorm.RMSNorm) for norm in norms)
        assert all([name for name, _ in norm.named_parameters()] == ["weight"] for norm in norms)


def _slack(ref: torch.Tensor) -> float:
    """1e-6 of ``ref``'s largest finite value."""
    return 1e-6 * float(ref.double()[ref.isfinite()].abs().max())


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(300, 1, 4096), (300, 32, 128), (33, 1, 1000)], ids=["hidden", "heads", "uneven"])
def test_cuda_kernels_are_within_one_rounding_step_of_torch_rmsnorm(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    """The kernels serve CUDA (the probe passed), and every output and input-gradient value is
    within one rounding step of ``torch.nn.RMSNorm``'s; NaN and infinity rows as it has them."""
    x, weight, grad = _input("cuda", dtype, shape)
    assert rmsnorm.fused_supported(x)
    module = _module(shape[-1], weight, 1e-6)
    got, got_grad = output_and_input_grad(module, x, grad)
    ref, ref_grad = output_and_input_grad(_reference(shape[-1], weight, 1e-6), x, grad)
    assert int(steps_apart(got, ref, _slack(ref)).sum()) == 0
    assert int(steps_apart(got_grad, ref_grad, _slack(ref_grad)).sum()) == 0
    assert bool(got.view(-1, shape[-1])[1].isnan().all()) and bool(got_grad.view(-1, shape[-1])[1].isnan().all())


@cuda
def test_cuda_kernels_take_rows_spaced_wider_than_they_are() -> None:
    """A view of 128-wide rows 256 apart (normalised where it lies, no copy) gives the values of
    its contiguous copy, and its gradient lands in those columns only."""
    x, weight, grad = _input("cuda", torch.bfloat16, (256, 256))
    module = _module(128, weight[:128], 1e-6)
    base = x.detach().clone().requires_grad_()
    view = base[:, :128]
    assert view.reshape(-1, 128).stride() == (256, 1)
    got = module(view)
    got.backward(grad[:, :128])
    ref, ref_grad = output_and_input_grad(module, x[:, :128].contiguous(), grad[:, :128].contiguous())
    assert base.grad is not None
    assert torch.equal(got.detach().nan_to_num(), ref.nan_to_num()) and torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(base.grad[:, :128].nan_to_num(), ref_grad.nan_to_num())
    assert not bool(base.grad[:, 128:].any())


@cuda
def test_cuda_kernels_are_within_the_bf16_bound_of_the_exact_values() -> None:
    """Against float64 of the same bf16 inputs: output and input gradient within two bf16
    roundings (2**-7 relative) plus fp32's error on the row sums."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = (3 * torch.randn(4096, 4096, generator=gen, device="cuda")).to(torch.bfloat16)
    weight = (1 + 0.5 * torch.randn(4096, generator=gen, device="cuda")).to(torch.bfloat16)
    grad = torch.randn(4096, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    got, got_grad = output_and_input_grad(_module(4096, weight, 1e-6), x, grad)
    leaf = x.double().requires_grad_()
    exact = leaf * torch.rsqrt(leaf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    exact.backward(grad.double())
    assert leaf.grad is not None
    bound = 2.0**-7
    assert bool(((got.double() - exact).abs() <= bound * exact.abs() + 1e-6).all())
    slack = 1e-5 * float(leaf.grad.abs().max())
    assert bool(((got_grad.double() - leaf.grad).abs() <= bound * leaf.grad.abs() + slack).all())
