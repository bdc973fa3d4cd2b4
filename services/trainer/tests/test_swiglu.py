"""The MLP's activation (``swiglu``): the module megatron's MLP builds, on the CPU the eager
expression itself, on CUDA the Triton kernels within one rounding step of the eager path and
within the bf16 bound of the exact values, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.trainer import swiglu
from services.trainer.engine import TrainerEngine
from services.trainer.tests.helpers import output_and_input_grad, steps_apart

cuda = pytest.mark.skipif(swiglu.triton is None or not torch.cuda.is_available(), reason="needs CUDA and Triton")


def _eager(x: torch.Tensor) -> torch.Tensor:
    """The reference, written out: ``silu(first half) * second half`` of the last dim."""
    n = x.shape[-1] // 2
    return F.silu(x[..., :n]) * x[..., n:]


def _input(device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``[300, 1, 2*1100]`` (1,100 columns: not a multiple of the kernel's block) with NaN and
    infinities in both halves, and an output gradient."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = (4 * torch.randn(300, 1, 2 * 1100, generator=gen, device=device)).to(dtype)
    x[0, 0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 90.0, -90.0])
    x[1, 0, 1100:1103] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    grad = torch.randn(300, 1, 1100, generator=gen, device=device).to(dtype)
    return x, grad


def test_the_module_on_the_cpu_is_the_eager_expression_forward_and_backward() -> None:
    """On the CPU ``SwiGLU`` computes exactly ``F.silu(gate) * up``, output and input gradient."""
    x, grad = _input("cpu", torch.float32)
    got, got_grad = output_and_input_grad(swiglu.SwiGLU(), x, grad)
    ref, ref_grad = output_and_input_grad(_eager, x, grad)
    torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got_grad, ref_grad, rtol=0, atol=0, equal_nan=True)


def test_every_layer_of_a_built_model_runs_the_swiglu_module(engines: dict[str, TrainerEngine]) -> None:
    """megatron's MLP in every layer of both presets uses ``SwiGLU`` as its activation."""
    for engine in engines.values():
        for layer in engine.model.decoder.layers:
            assert isinstance(layer.mlp.activation_func, swiglu.SwiGLU)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernels_are_within_one_rounding_step_of_the_eager_path(dtype: torch.dtype) -> None:
    """The kernels serve CUDA (the probe passed), and every output and input-gradient value is
    within one rounding step of ``F.silu(gate) * up``'s, NaN and infinity where it has them: a
    NaN gate makes its output NaN, a NaN ``up`` its gate's gradient."""
    x, grad = _input("cuda", dtype)
    assert swiglu.fused_supported(x)
    got, got_grad = output_and_input_grad(swiglu._SwiGLUFunction.apply, x, grad)
    ref, ref_grad = output_and_input_grad(_eager, x, grad)
    tiny = torch.finfo(dtype).tiny
    assert int(steps_apart(got, ref, tiny).sum()) == 0
    assert int(steps_apart(got_grad, ref_grad, tiny).sum()) == 0
    assert got.isnan()[0, 0, 0] and got_grad.isnan()[1, 0, 0]


@cuda
def test_cuda_kernels_are_within_the_bf16_bound_of_the_exact_values() -> None:
    """Against float64 of the same bf16 inputs: output and both halves of the input gradient
    within two bf16 roundings (2**-7 relative), plus fp32's error on the gradient's sum."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = (3 * torch.randn(4096, 2 * 1536, generator=gen, device="cuda")).to(torch.bfloat16)
    grad = torch.randn(4096, 1536, generator=gen, device="cuda").to(torch.bfloat16)
    got, got_grad = output_and_input_grad(swiglu._SwiGLUFunction.apply, x, grad)
    leaf = x.double().requires_grad_()
    exact = _eager(leaf)
    exact.backward(grad.double())
    assert leaf.grad is not None
    bound = 2.0**-7
    assert bool(((got.double() - exact).abs() <= bound * exact.abs() + 1e-30).all())
    slack = 1e-6 * grad.double().abs().repeat(1, 2) * x.double().abs().max()
    assert bool(((got_grad.double() - leaf.grad).abs() <= bound * leaf.grad.abs() + slack).all())
