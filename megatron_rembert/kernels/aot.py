"""What the launchers can launch, declared for the ahead-of-time compile check.

Every module here that defines a `@triton.jit` kernel also defines `aot_configs()`, returning
one `KernelConfig` per (kernel, argument types, constexpr values, num_warps) its launchers can
choose, built from the same helpers the launchers call to pick block sizes and warps. The CI
test `tests/kernels/test_aot_compile.py` finds the kernels by scanning this package, requires
each to be declared, and compiles every declared configuration for sm_80 and sm_90 with the
real compiler (no GPU needed), failing on any error or register spill. The interpreter the
other tests use accepts code the compiler refuses, so this is the only CPU check that the
kernels build at all.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

# Float dtypes the public ops accept, as Triton signature type names.
FLOAT_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class KernelConfig(NamedTuple):
    kernel: Any  # a triton JITFunction
    signature: dict[str, str]  # every argument -> "*bf16", "i32", "fp32", ... or "constexpr"
    constexprs: dict[str, Any]  # constexpr argument -> value
    num_warps: int

    @property
    def label(self) -> str:
        """e.g. `_softmax_fwd_kernel[x_ptr=*bf16 BLOCK=4096 HAS_MASK=True w8]`, for reports."""
        first = next(iter(self.signature.items()))
        consts = " ".join(f"{k}={v}" for k, v in self.constexprs.items())
        return f"{self.kernel.__name__}[{first[0]}={first[1]} {consts} w{self.num_warps}]"


def kernel_config(kernel: Any, num_warps: int, types: dict[str, str], **constexprs: Any
                  ) -> KernelConfig:
    """Config from the runtime argument types (in kernel order) and the constexpr values."""
    signature = dict(types) | {name: "constexpr" for name in constexprs}
    return KernelConfig(kernel, signature, constexprs, num_warps)
