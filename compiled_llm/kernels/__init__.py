"""Kernel providers of the cllm:: ops. ``registry`` keeps them and picks one per op for a target;
provider modules (Triton, CUDA C++) sit next to it and register themselves when
``registry.load_providers()`` imports them."""
