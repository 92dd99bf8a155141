"""The servers behind rollout replicas, one per engine: each runs as a Ray actor with verl's rollout-server method
names and replies in :mod:`async_rl.rollout.wire`'s format. ``hf.py``: the transformers engine in a process of its
own; ``vllm.py``: vLLM's ``AsyncLLM`` in a process of its own; ``hybrid.py``: the engine fused into a train rank
(``rollout.mode=hybrid``, hf or vLLM); ``base.py``: what they all keep the same way."""
