"""Kernel providers of the cllm:: ops. ``registry`` keeps them, makes each kernel's op from its
semantic op's definition (``register_kernel``) and picks one per op for a target; provider
modules (Triton, CUDA C++) sit next to it and register themselves when
``registry.load_providers()`` imports them."""
