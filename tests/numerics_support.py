"""Tolerances shared by tests that compare two float32 training runs meant to be the same up to summation order."""

ADAM_WEIGHTS_ATOL = 5e-5
"""How far two runs' weights may drift apart after a few AdamW steps at a learning rate of 1e-3, when their losses and
gradient norms agree to 1e-5 (compared separately, and tightly: those catch a wrong normalisation). Adam divides each
element's step by that element's own gradient scale, so where a gradient is near zero, rounding of 1e-7 in it moves
the step by a visible fraction of the learning rate. How large depends on the CPU's kernels (an AVX-512 machine's
matmuls sum in another order than an AVX2 one's): three steps drifted up to 1.1e-5 there, of the 3e-3 a weight
can move."""
