"""MXFP4 (OCP microscaling): 32 E2M1 values sharing one power-of-two E8M0 scale."""

from __future__ import annotations

import numpy as np

from deimos.gguf.constants import GGMLType
from deimos.quant.base import QuantFormat, as_f32, random_bytes

# E2M1 values doubled (ggml's kvalues_mxfp4), so the scale is halved: 2^(e - 128).
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


def e8m0_to_f32_half(e: np.ndarray) -> np.ndarray:
    """2^(e - 128) as float32 bits, like ggml_e8m0_to_fp32_half (e < 2 gives subnormals)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23)
    return bits.astype(np.uint32).view(np.float32)


class MXFP4(QuantFormat, ggml_type=GGMLType.MXFP4):
    # 0 e (E8M0 exponent) | 1 qs[16] nibbles (byte j: element j low, element j+16 high)
    # w = kvalues[q] * 2^(e - 128)

    def codes_and_scale(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(int8 codes ``[n, 32]`` = kvalues[q], float32 scale ``[n, 1]`` = 2^(e - 128)):
        w = code * scale."""
        qs = blocks[:, 1:17]
        return KVALUES_MXFP4.take(np.concatenate([qs & 0x0F, qs >> 4], axis=1)), e8m0_to_f32_half(blocks[:, 0:1])

    def decode_blocks(self, blocks: np.ndarray) -> np.ndarray:
        codes, d = self.codes_and_scale(blocks)
        return as_f32(codes) * d

    def random_blocks(self, n: int, rng: np.random.Generator) -> np.ndarray:
        b = random_bytes(n, self.type_size, rng)
        # 12 * 2^(121 - 128) ~ 0.094
        b[:, 0] = rng.integers(118, 122, n, dtype=np.uint8)
        return b
