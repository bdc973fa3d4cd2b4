"""An independent float64 Hugging Face (+ PEFT) reference, with fp32 error bounds of its logprobs."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.numerics import U32, ChainShape, gamma, logit_magnitude, logprob_magnitude


class HFReference:
    """Plain transformers (+ PEFT adapters, if any) in float64: the independent reference for
    greedy tokens and logprobs, with the fp32 error bound of every logprob (``tests.numerics``)."""

    def __init__(self, model_dir: Path, adapters: dict[str, Path] | None = None) -> None:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
        base = base.double().eval()
        self.chain = ChainShape.of_hf_config(base.config)
        names = list(adapters or {})
        self.model: Any = base
        if adapters:
            self.model = PeftModel.from_pretrained(base, str(adapters[names[0]]), adapter_name=names[0])
            for name in names[1:]:
                self.model.load_adapter(str(adapters[name]), adapter_name=name)
            self.model.eval()
        self._head_in = torch.zeros(0)
        self.model.get_output_embeddings().register_forward_hook(
            lambda _m, args, _out: setattr(self, "_head_in", args[0])
        )

    def _use(self, adapter: str | None) -> AbstractContextManager[object]:
        if adapter is None:
            return self.model.disable_adapter() if isinstance(self.model, PeftModel) else nullcontext()
        self.model.set_adapter(adapter)
        return nullcontext()

    def greedy(self, prompt: list[int], adapter: str | None, max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.inference_mode(), self._use(adapter):
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
        return [int(t) for t in out[0, len(prompt) :]]

    def logprobs(self, tokens: list[int], adapter: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(len(tokens), V) log-softmax of one plain float64 forward, and the fp32 error bound of
        each entry: gamma of the forward chain times the magnitude of the logits' terms, including
        the adapter's ``s * B A`` on the unembedding, plus the float32 rounding of the result."""
        with torch.inference_mode(), self._use(adapter):
            logits = self.model(input_ids=torch.tensor([tokens])).logits[0].double()
            head = self.model.get_output_embeddings()
            h = self._head_in[0]
            base_w = getattr(head, "base_layer", head).weight
            mag = logit_magnitude(h, base_w)
            if adapter is not None and adapter in getattr(head, "lora_A", {}):
                a, b = head.lora_A[adapter].weight, head.lora_B[adapter].weight
                mag = mag + head.scaling[adapter] * logit_magnitude(logit_magnitude(h, a), b)
        logp = torch.log_softmax(logits, dim=-1)
        bound = gamma(self.chain.forward_depth(len(tokens))) * logprob_magnitude(mag) + U32 * logp.abs()
        return logp, bound
