"""Memory per rank and bytes per phase for the DeepSeek-R1 configurations (no GPU needed).

    python tools/memory_report.py [--capacity-factor 2.0]

First table: symmetric memory and bytes on the wire at EP2 and EP8. Second table, EP2-EP64: the expert
input buffer out_expert_x (with its scales) each rank holds, sized for the worst case (every token of
every rank to one expert: max_num_tokens * ranks slots per local expert) against a capacity of
``--capacity-factor`` times the mean demand per expert (tokens * ranks * top-k / experts), the setting
of ``AllToAll(capacity=..., overflow=...)``. Third table: the routing plan a training step keeps per MoE
layer and rank for its backward (``AllToAll.plan``: expert and local [max_num_tokens, k], origin [slots, 3]
and held [1 + slots], int32), for the padded layout's slots (worst case, and the capacity above) and the packed
layout's worst-case rows (max_num_tokens * ranks * min(k, local experts)), beside the layer's out_expert_x it
describes, and the symmetric memory ``gradients=True`` adds per AllToAll on GPUs (the gradient rows and words).

Uses the formulas of moecomm/transport/gpu_alltoall.py (132 SMs, an H100/H200). Bytes on the wire are
expectations for uniform top-k routing: a token reaches r = W * (1 - C(E - E/W, k) / C(E, k)) ranks.
Dispatch sends a record to each of the r * (W - 1) / W other ranks (rows for the rank's own experts are
stored in place); combine sends one partial row to each of the r ranks (the own one is a local copy);
without router weights at dispatch, one row per (token, k).
"""
import argparse
from math import ceil, comb

from moecomm._config import AllToAllConfig
from moecomm.transport.gpu_alltoall import record_bytes, symmetric_bytes


def r1(world, tokens, gradients=False):
    return AllToAllConfig.create(world, 0, tokens, 256, 8, 7168, 56, "float8_e4m3fn", "bfloat16", None, 1,
                                 gradients=gradients)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--capacity-factor", type=float, default=2.0,
                   help="the capacity column: this many times the mean demand per expert (default 2)")
    args = p.parse_args()
    print(f"{'config':<22} {'symmetric/rank':>15} {'ranks/token':>12} {'dispatch B/rank':>16} "
          f"{'combine B/rank':>15} {'combine B (no w)':>17}")
    for world in (2, 8):
        for tokens in (128, 4096):
            c = r1(world, tokens)
            E, L, k = c.num_experts, c.num_local_experts, c.experts_per_token
            ranks = world * (1 - comb(E - L, k) / comb(E, k))
            out_row = c.hidden_dim * c.out_dtype.itemsize
            print(f"R1 EP{world} {tokens:>5} tok     {symmetric_bytes(c) / 2**20:>11.1f} MiB {ranks:>12.2f} "
                  f"{tokens * ranks * (world - 1) / world * record_bytes(c) / 2**20:>12.2f} MiB "
                  f"{tokens * ranks * out_row / 2**20:>11.2f} MiB"
                  f" {tokens * k * out_row / 2**20:>13.2f} MiB")
    print(f"\n{'out_expert_x + scales':<22} {'worst-case slots':>17} {'worst case':>11} "
          f"{f'capacity {args.capacity_factor:g}x mean':>21} {'memory':>10}")
    for tokens in (128, 4096):
        for world in (2, 8, 16, 32, 64):
            c = r1(world, tokens)
            row = c.hidden_dim * c.in_dtype.itemsize + 4 * c.hidden_dim_scale
            demand = args.capacity_factor * tokens * world * c.experts_per_token / c.num_experts
            cap = min(c.expert_capacity, ceil(demand))
            worst = c.num_local_experts * c.expert_capacity * row
            print(f"R1 EP{world:<3} {tokens:>5} tok    {c.expert_capacity:>17} {worst / 2**30:>8.2f} GiB "
                  f"{cap:>15} slots {c.num_local_experts * cap * row / 2**30:>6.2f} GiB")
    print(f"\n{'routing plan per layer':<22} {'padded worst':>13} {f'padded {args.capacity_factor:g}x mean':>19} "
          f"{'packed worst':>13} {'out_expert_x worst':>19} {'gradients=True adds':>20}")
    for tokens in (128, 4096):
        for world in (2, 8, 64):
            c = r1(world, tokens)
            row = c.hidden_dim * c.in_dtype.itemsize + 4 * c.hidden_dim_scale
            demand = args.capacity_factor * tokens * world * c.experts_per_token / c.num_experts
            cap = min(c.expert_capacity, ceil(demand))
            expert = 2 * 4 * tokens * c.experts_per_token  # plan.expert and plan.local
            packed = tokens * world * min(c.experts_per_token, c.num_local_experts)
            plans = [expert + 16 * slots + 4 for slots in (c.num_local_experts * c.expert_capacity,
                                                       c.num_local_experts * cap, packed)]
            grads = symmetric_bytes(r1(world, tokens, True)) - symmetric_bytes(c)
            print(f"R1 EP{world:<3} {tokens:>5} tok    " + " ".join(f"{b / 2**20:>9.2f} MiB" for b in plans)
                  + f" {c.num_local_experts * c.expert_capacity * row / 2**20:>15.1f} MiB"
                  + f" {grads / 2**20:>16.1f} MiB")


if __name__ == "__main__":
    main()
