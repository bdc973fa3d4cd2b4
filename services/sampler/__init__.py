"""Tinkerd's CPU sampler: an HF/PEFT engine behind the subset of SGLang's HTTP API Tinkerd uses.

On GPU deployments real SGLang takes its place with configuration only; see ``wire.py``.
"""
