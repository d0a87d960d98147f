"""Symmetric memory per rank and bytes per phase for the DeepSeek-R1 configurations (no GPU needed).

    python tools/memory_report.py

Uses the formulas of moecomm/transport/gpu_alltoall.py (132 SMs, an H100/H200). Bytes on the wire are
expectations for uniform top-k routing: a token reaches r = W * (1 - C(E - E/W, k) / C(E, k)) ranks.
Dispatch sends a record to each of the r * (W - 1) / W other ranks (rows for the rank's own experts are
stored in place); combine sends one partial row to each of the r ranks (the own one is a local copy);
without router weights at dispatch, one row per (token, k).
"""
from math import comb

from moecomm._config import AllToAllConfig
from moecomm.transport.gpu_alltoall import record_bytes, symmetric_bytes


def r1(world, tokens):
    return AllToAllConfig.create(world, 0, tokens, 256, 8, 7168, 56, "float8_e4m3fn", "bfloat16", None, 1)


def main():
    print(f"{'config':<22} {'symmetric/rank':>15} {'ranks/token':>12} {'dispatch B/rank':>16} "
          f"{'combine B/rank':>15} {'combine B (no w)':>17}")
    for world in (2, 8):
        for tokens in (128, 4096):
            c = r1(world, tokens)
            E, L, k = c.num_experts, c.num_local_experts, c.experts_per_token
            ranks = world * (1 - comb(E - L, k) / comb(E, k))
            out_row = c.hidden_dim * c.out_dtype.itemsize
            print(f"R1 EP{world} {tokens:>5} tok     {symmetric_bytes(c) / 2**20:>11.1f} MiB {ranks:>12.2f} "
                  f"{tokens * ranks * (world - 1) / world * record_bytes(c) / 2**20:>12.2f} MiB {tokens * ranks * out_row / 2**20:>11.2f} MiB"
                  f" {tokens * k * out_row / 2**20:>13.2f} MiB")


if __name__ == "__main__":
    main()
